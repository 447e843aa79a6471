"""Mixture-of-Experts feed-forward layers: a router picks each token's top-k experts, their
SiLU-gated MLPs run on it and their outputs are summed with the routing weights.

Module names are the checkpoints' (Qwen3-MoE: `mlp.gate`, `mlp.experts.{e}.gate_proj/up_proj/
down_proj`; Mixtral: `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2`), so a
safetensors file loads as it is. For inference `fuse()` stacks the experts' weights into one
(E, 2I, H) gate-up tensor and one (E, H, I) down tensor, each expert's parameters becoming views of
them (the state dict keeps its names), and the forward works on the stacks:

- a few tokens (decode, a verify tree): with Kernels.moe two Triton kernels that read each touched
  expert once (models/fused_moe.py); otherwise each token's k experts' weights gathered and applied
  with batched matmuls; both with static shapes and no host sync (what the CUDA graphs capture);
- many tokens (prefill): the pairs sorted by expert and each expert's rows multiplied as one group
  of a grouped matmul (`torch._grouped_mm`, no host sync: a prefill's CUDA graph captures it); on a
  GPU without it (float16, or older than Hopper) the Triton kernels MAX_TOKENS tokens at a time, also
  free of host syncs; with neither (training, the CPU without a grouped matmul, `--disable-kernels moe` on
  such a GPU) expert by expert over the tokens routed to it, a host sync a call (`capturable`: no graphs).

Each token's result depends on its own routing only. The layer counts, on the device and without a
host sync, the forwards it ran and the distinct experts they touched (`touched`, `forwards`): what a
verify of T tokens reads against a decode's k experts.

Under expert parallelism (dist/tp.py) a layer holds `held` of the routed experts whole, from `first`
on (MoEConfig.local_experts), numbered from 0. The router stays whole, so every rank chooses the same
top k; a pair whose expert another rank holds gets the index `held` and the weight 0, adds nothing
here, and is not counted. The ranks' partial outputs are summed after the layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels import EAGER, Kernels
from . import fused_moe, gemv, moe_route, moe_stored
from .linear import Linear

# Tokens a call up to which the routing kernel does the post-attention norm: every one of its programs
# recomputes its token's statistics, and on the H100 that paid at 1 and 2 tokens (decode 1.01x on Qwen3-30B-A3B
# and DeepSeek-V2-Lite) and lost at 16 (0.985x a Qwen3 forward); docs/notebook.md
NORM_TOKENS = 2
# Tokens a call from which the shared experts run inside the fused kernels: at one token their two GEMVs,
# each reading its weights before it waits, were faster (DeepSeek-V2-Lite decode 0.98x folded, its
# forwards of 2 / 4 / 16 tokens 1.05x / 1.04x / 1.02x on an H100); docs/notebook.md
FOLD_TOKENS = 2


def fold_at(tokens: int, exact: bool) -> bool:
    """Whether a call of `tokens` tokens runs the shared experts inside the fused kernels. An exact
    model (Kernels.exact) never does: its verify must round them as its one-token decode does."""
    return not exact and tokens >= FOLD_TOKENS

# model_type -> (the feed-forward module's name in a layer, an expert's gate / up / down names)
NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


class Expert(nn.Module):
    """One expert's SiLU-gated MLP, its linears under the checkpoint's names. A shared expert (run on
    every token) is fused for inference: gate and up one weight, and for a few rows one GEMV kernel
    with the SiLU·mul (models/gemv.py), as the dense MLP."""

    def __init__(self, hidden: int, width: int, names: tuple[str, str, str], kernels: Kernels = EAGER,
                 stored: tuple[str, int] | None = None):
        super().__init__()
        self.names, self.kernels = names, kernels
        gate, up, down = names
        make = (lambda i, o: moe_stored.StoredLinear(i, o, stored)) if stored else \
            (lambda i, o: Linear(i, o, bias=False, kernels=kernels))  # routed experts kept as a release stores them
        setattr(self, gate, make(hidden, width))
        setattr(self, up, make(hidden, width))
        setattr(self, down, make(width, hidden))
        self.fused = False

    def linears(self) -> tuple[Linear, Linear, Linear]:
        return tuple(getattr(self, n) for n in self.names)

    def fuse(self) -> None:
        gate, up, _ = self.linears()
        w = torch.cat([gate.weight.data, up.weight.data])
        gate.weight.data, up.weight.data = w[: gate.weight.shape[0]], w[gate.weight.shape[0]:]
        self.register_buffer("gate_up_weight", w, persistent=False)
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.linears()
        rows = x.numel() // x.shape[-1]
        if self.fused and self.kernels.gemv and gemv.usable(x, self.gate_up_weight, rows, glu=True):
            return down(gemv.glu(x, self.gate_up_weight))
        return down(F.silu(gate(x)) * up(x))


class Router(nn.Module):
    """The router's weight (E, H) and, where the model learns one (DeepSeek-V3), the bias added to
    the scores when choosing experts (not to the weights)."""

    def __init__(self, hidden: int, experts: int, score_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        if score_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels = EAGER):
        super().__init__()
        self.cfg = moe = config.moe
        self.kernels = kernels
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.first, self.held = moe.local_experts or (0, moe.num_experts)  # the routed experts held here
        names = NAMES[config.model_type][1]
        self.gate = Router(config.hidden_size, moe.num_experts, moe.score_bias)
        self.experts = nn.ModuleList(Expert(config.hidden_size, moe.expert_size, names, kernels, moe.stored)
                                     for _ in range(self.held))
        if moe.shared_experts:  # always on, beside the routed ones (DeepSeek)
            width = moe.shared_width or moe.expert_size * moe.shared_experts
            self.shared_experts = Expert(config.hidden_size, width, names, kernels)
        self.register_buffer("touched", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long), persistent=False)
        # the routing kernel's per-token counters of finished programs, zero between calls
        self.register_buffer("route_counts", torch.zeros(fused_moe.MAX_TOKENS, dtype=torch.int32), persistent=False)
        self.fused = False
        self.spread = False  # route_spread(): benchmarks of random weights only

    def route_spread(self) -> None:
        """Route as a trained model spreads its tokens, for random-weight shapes: a random model's
        hidden states share one direction (attention averages the same random context for every
        token), so its router sends every token to the same experts. The router's logits are then
        scrambled, sin(10^4 logits), unrelated from one token to the next: each token's experts as
        if drawn uniformly (what the touched-bytes model assumes), the same for the same input,
        inside the routing kernel where it runs (no extra kernel in what is timed)."""
        self.spread = True

    def fuse(self) -> None:
        """The experts' weights as two stacks, each expert's parameters views of them."""
        if self.cfg.stored:
            self.stored_stacks = moe_stored.stack(self.experts, self.cfg.stored)
        else:
            self.fuse_dense()
        if self.cfg.shared_experts:
            self.shared_experts.fuse()
        if self.cfg.router_fp32:  # once, not a float32 copy of the router every forward
            self.register_buffer("router32", self.gate.weight.data.float(), persistent=False)
        self.fused = True

    def fuse_dense(self) -> None:
        g0, _, d0 = self.experts[0].linears()
        width, hidden, n = g0.weight.shape[0], g0.weight.shape[1], len(self.experts)
        # filled expert by expert, each expert's tensors freed as it becomes a view: one layer's
        # experts are tens of GB at Kimi-K2's width, and a stack of copies would hold them twice
        gate_up = g0.weight.new_empty(n, 2 * width, hidden)  # (E, 2I, H)
        for i, e in enumerate(self.experts):
            g, u, _ = e.linears()
            gate_up[i, :width].copy_(g.weight.data)
            gate_up[i, width:].copy_(u.weight.data)
            g.weight.data, u.weight.data = gate_up[i, :width], gate_up[i, width:]
        down = d0.weight.new_empty(n, hidden, width)  # (E, H, I), once gate and up are freed
        for i, e in enumerate(self.experts):
            d = e.linears()[2]
            down[i].copy_(d.weight.data)
            d.weight.data = down[i]
        self.register_buffer("gate_up", gate_up, persistent=False)
        self.register_buffer("down", down, persistent=False)

    def router_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The router's weight as routing reads it (float32 where the model routes in float32) and its
        learned bias on the choice, or None."""
        c = self.cfg
        w = (self.router32 if self.fused else self.gate.weight.float()) if c.router_fp32 else self.gate.weight
        return w, (self.gate.e_score_correction_bias if c.score_bias else None)

    def route(self, x: torch.Tensor, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H) -> each token's expert weights (N, k) float32 and experts (N, k): the router's
        scores (softmax or sigmoid of its float32 logits); the top k, within the best groups where
        the model groups its experts, chosen by the scores plus the learned bias where it has one;
        their scores as weights, renormalized where the model does, times its scaling factor.
        With `kernel`, all of it in one Triton kernel (models/moe_route.py). The experts
        are numbered as held here: another rank's get the index `held` and the weight 0."""
        c = self.cfg
        w, bias = self.router_weight()
        if kernel:  # logits and choice in one kernel
            return self.local(*moe_route.router(x, w, c, bias, self.route_counts, spread=self.spread))
        if c.router_fp32:
            x32 = x.float()
            if self.kernels.exact:  # a float32 GEMM reduces a row differently at different row counts
                logits = torch.cat([F.linear(row, w) for row in x32.split(1)])
            else:
                logits = F.linear(x32, w)
        else:
            logits = self.gate(x)
        logits = logits.float()
        if self.spread:
            logits = torch.sin(logits * 1e4)
        scores = logits.sigmoid() if c.scoring == "sigmoid" else logits.softmax(-1)
        choice = scores if bias is None else scores + bias
        if c.n_group > 1:
            groups = choice.view(-1, c.n_group, self.num_experts // c.n_group)
            g = groups.topk(2, -1).values.sum(-1) if c.group_top2 else groups.amax(-1)  # (N, n_group)
            keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(c.topk_group, -1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // c.n_group, 1), float("-inf"))
        experts = choice.topk(self.top_k, -1).indices
        weights = scores.gather(1, experts)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return self.local(weights * c.scaling, experts)

    def route_normed(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float):
        """`route(norm(x, residual), kernel=True)` with the norm in the routing kernel -> (normed x,
        x + residual, weights, experts)."""
        w, bias = self.router_weight()
        normed, stream, weights, experts = moe_route.route_normed(x, residual, norm_weight, eps, w, self.cfg, bias,
                                                                  self.route_counts, spread=self.spread)
        return (normed, stream, *self.local(weights, experts))

    def local(self, weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts (N, k) numbered as held here; another rank's: index `held`, weight 0."""
        if self.held == self.num_experts:
            return weights, experts
        experts = experts - self.first
        here = (experts >= 0) & (experts < self.held)
        return weights * here, experts.where(here, self.held)

    def normed(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its RMSNorm with the residual add: norm(x, residual) -> (output, x + residual).
        Where the routing kernel runs (at most NORM_TOKENS tokens, not exact) the norm is done inside
        it: one kernel fewer a layer."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if not (self.kernels.moe and not self.kernels.exact and len(flat) <= NORM_TOKENS and fused_moe.usable(flat)):
            x, residual = norm(x, residual)
            return self(x), residual
        x, stream, weights, experts = self.route_normed(flat, residual, norm.weight, norm.eps)
        return self.through_kernels(x, weights, experts).view(shape), stream.view(shape)

    def through_kernels(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed (and shared) experts of x (N, H) by the fused kernels (fused_moe.fused_moe),
        counting the routed experts touched. Shared experts as wide as a whole number of routed ones
        run inside the kernels as each token's extra pairs (`fused_moe.foldable`) in a call of
        FOLD_TOKENS tokens or more (`fold_at`); otherwise as their own GEMVs, added in the kernels' final sum."""
        gate_up, down = self.stacks()
        shared = add = None
        if self.cfg.shared_experts:
            se = self.shared_experts
            down_w = se.linears()[2].weight
            fold = fold_at(len(x), self.kernels.exact)
            if se.fused and fold and fused_moe.foldable(gate_up, se.gate_up_weight, down_w):
                shared = (se.gate_up_weight, down_w)  # run as each token's extra pairs
            else:
                add = se(x)  # added in the kernels' final sum
        counts = (self.touched, self.forwards)
        if self.held < self.num_experts:  # the kernels index only the experts held here: another
            # rank's pair runs on the last one with its weight 0 (a clamped index: right, if some work
            # for nothing), and the pairs are counted here, where that expert does not count
            self.count(experts)
            experts, counts = experts.clamp(max=self.held - 1), None
        return fused_moe.fused_moe(x, experts, weights, gate_up, down, counts=counts, add=add, shared=shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        m = fused_moe.MAX_TOKENS
        if (self.kernels.moe and x.shape[0] > m and fused_moe.usable(x[:m])
                and (self.kernels.exact or not has_grouped_mm(x))):
            # many tokens (a batch's verify, a prefill) as few: routed and computed by the kernels
            # MAX_TOKENS at a time; an exact model's token so gets its result as at any count, and a GPU
            # without torch's grouped matmul no host sync (what by_expert would need)
            return torch.cat([self(part) for part in x.split(m)]).reshape(shape)
        fast = self.kernels.moe and fused_moe.usable(x)  # Triton: routing, experts read once, counting
        weights, experts = self.route(x, kernel=fast)
        if fast:
            return self.through_kernels(x, weights, experts).reshape(shape)
        gate_up, down = self.stacks()
        shared = self.shared_experts(x) if self.cfg.shared_experts else None
        self.count(experts)
        if self.cfg.stored:  # quantized experts, many tokens: the fused kernels, MAX_TOKENS at a time
            m = fused_moe.MAX_TOKENS
            experts = experts.clamp(max=self.held - 1)  # another rank's pairs (weight 0) on one held here
            out = torch.cat([fused_moe.fused_moe(x[i:i + m], experts[i:i + m], weights[i:i + m], gate_up, down)
                             for i in range(0, x.shape[0], m)])
        elif self.kernels.exact:  # each token by the call of its decode, in prefill too (models/exact.py)
            out = torch.cat([gathered(x[i:i + 1], experts[i:i + 1], weights[i:i + 1], gate_up, down)
                             for i in range(x.shape[0])])
        elif experts.numel() <= 2 * self.held:  # few tokens: gathered, static shapes
            out = gathered(x, experts, weights, gate_up, down)
        elif has_grouped_mm(x):
            out = grouped(x, experts, weights, gate_up, down)
        else:
            out = by_expert(x, experts, weights, gate_up, down)
        if shared is not None:
            out = out + shared
        return out.reshape(shape)

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[fused_moe.Stack, fused_moe.Stack]:
        if self.cfg.stored:
            if not self.fused:
                raise RuntimeError("quantized experts are read only by the fused kernels of a fused model")
            return self.stored_stacks
        if self.fused:
            return self.gate_up, self.down
        # unfused (training, tests on the modules as loaded): stacked on the fly
        return (torch.stack([torch.cat([e.linears()[0].weight, e.linears()[1].weight]) for e in self.experts]),
                torch.stack([e.linears()[2].weight for e in self.experts]))

    def reset_counts(self) -> None:
        self.touched.zero_()
        self.forwards.zero_()

    def reset_buffers(self) -> None:
        """After materializing (their values until a checkpoint loads): zero counters, no score bias."""
        self.reset_counts()
        self.route_counts.zero_()
        if self.cfg.score_bias:
            self.gate.e_score_correction_bias.zero_()
        for m in self.experts.modules():
            if isinstance(m, moe_stored.StoredLinear):
                m.reset_dtypes()

    def count(self, experts: torch.Tensor) -> None:
        """Add this forward's distinct experts held here to `touched` (device, no host sync)."""
        hit = torch.zeros(self.held + 1, dtype=torch.bool, device=experts.device)  # and one for another rank's
        hit.index_fill_(0, experts.reshape(-1), True)  # a scalar fill: nothing copied from the host
        self.touched += hit[:self.held].sum()
        self.forwards += 1


def gathered(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor) -> torch.Tensor:
    """Each token's k experts' weights gathered and applied: x (N, H), experts and weights (N, k),
    gate_up (E, 2I, H), down (E, H, I) -> (N, H). A pair of expert E (another rank's, weight 0) is
    applied with expert E - 1's weights and adds 0."""
    n, k = experts.shape
    experts = experts.clamp(max=gate_up.shape[0] - 1)
    gu = torch.einsum("nh,nkih->nki", x, gate_up[experts])  # (N, k, 2I)
    g, u = gu.chunk(2, -1)
    y = torch.einsum("nki,nkhi->nkh", F.silu(g) * u, down[experts])  # (N, k, H)
    return (y * weights.to(y.dtype)[..., None]).sum(1)


def has_grouped_mm(x: torch.Tensor) -> bool:
    """torch's grouped matmul takes x: on the CPU, or bfloat16 on a GPU of compute capability 9 or more."""
    return not torch.is_grad_enabled() and grouped_mm_takes(x.dtype, x.device)


def grouped_mm_takes(dtype: torch.dtype, device: torch.device) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9


def capturable(kernels: Kernels, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an MoE layer's forward at any token count runs without a host sync on `device`, as a
    CUDA graph needs: through the Triton kernels (Kernels.moe), or torch's grouped matmul for many
    tokens; otherwise many tokens go expert by expert (`by_expert`, a sync for the experts in use)."""
    return device.type != "cuda" or kernels.moe or grouped_mm_takes(dtype, device)


def grouped(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
    """The (token, slot) pairs sorted by expert, each expert's run one group of a grouped matmul
    (group ends found on the device: no host sync), summed back per token in slot order. Pairs of
    expert E (another rank's) sort last, past every group: not computed, they add 0."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    ranked = flat[order]
    ends = torch.searchsorted(ranked, torch.arange(gate_up.shape[0], device=x.device), right=True).to(torch.int32)
    g, u = torch._grouped_mm(x[order // k], gate_up.transpose(1, 2), offs=ends).chunk(2, -1)
    y = torch._grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=ends)  # rows past the last group: not written
    y = (y * weights.reshape(-1)[order].to(y.dtype)[:, None]).where(ranked[:, None] < gate_up.shape[0], 0)
    out = torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1)
    acc = out[:, 0]
    for j in range(1, k):  # slot by slot, as the fused kernels sum
        acc = acc + out[:, j]
    return acc


def by_expert(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """Expert by expert over the tokens routed to it (many tokens; sizes depend on the routing), not
    over pairs of expert E (another rank's)."""
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():  # sync: the experts in use
        if e == gate_up.shape[0]:
            continue
        tok, slot = (experts == e).nonzero(as_tuple=True)
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, -1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[tok, slot].to(x.dtype)[:, None]
        out.index_add_(0, tok, y)
    return out
