"""Tensor parallelism: each rank holds a slice of every layer and is, to the rest of eaglet, a
smaller model of the same family.

A rank's model is built from `local_config` (attention heads / N; KV heads / N, or one replicated
where there are fewer KV heads than ranks; MLA's heads / N; the MLP's and each expert's width / N,
shared experts' too) and `shard_pairs` slices the checkpoint's tensors as they stream in by name:
column-parallel projections (q / q_b / kv_b, gate and up) keep their rank's rows, k / v their KV
heads' rows, row-parallel ones (o_proj, down) their rank's columns, a row-parallel bias stays on
rank 0 only, and the input embedding and output layer their rank's rows of the vocabulary
(dist/vocab.py: the lookup all-reduced, the logits all-gathered). Everything else is whole on every
rank: norms, routers, MLA's latent projections and cache, and every drafter. `all_reduce_outputs`
then sums the partial outputs over the ranks, once after attention and once after the MLP or MoE
block, so all ranks hold the same residual stream and logits and walk the same decoding loop.

MoE layers split one of two ways (TP.moe, `--moe-parallel`): each routed expert by its width as
above ("tp"), or expert parallelism ("ep"): rank r holds experts [r E/N, (r+1) E/N) whole, renumbered
from 0 (MoEConfig.local_experts); every rank routes with the whole router and computes only its own
experts' pairs (models/moe.py), and the same all-reduce sums them. Shared experts, dense MLPs and
attention split as above either way. Routed experts a checkpoint stores quantized (INT4 packs, FP8
blocks) stay as stored under EP, each a whole expert; split by width they are dequantized at load.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import InvalidInput
from . import vocab

MOE_SPLITS = ("tp", "ep")  # MoE layers: each expert by its width, or whole experts over the ranks
ROUTED = re.compile(r"\.experts\.(\d+)\.")  # a routed expert's tensor (not the shared experts')
COLUMN = re.compile(r"\.(q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|w1|w3)\.(weight|bias)$")
KV = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
ROW = re.compile(r"\.(o_proj|down_proj|w2)\.(weight|bias)$")
VOCAB = re.compile(r"^(model\.embed_tokens|lm_head)\.weight$")


@dataclass(frozen=True)
class TP:
    """This process's place among the tensor-parallel ranks, and how MoE layers split over them."""
    rank: int = 0
    world: int = 1
    moe: str = "tp"  # one of MOE_SPLITS

    def __post_init__(self):
        if self.moe not in MOE_SPLITS:
            raise InvalidInput(f"--moe-parallel {self.moe}: choose from {', '.join(MOE_SPLITS)}")


def dense_mlp_used(c: ModelConfig) -> bool:
    return c.moe is None or bool(c.moe.dense_layers) or any(not c.moe.sparse(i) for i in range(c.num_layers))


def check(c: ModelConfig, world: int, moe: str = "tp") -> None:
    """Refuse a model that does not split `world` ways, its MoE layers as `moe` says (TP.moe), naming
    what does not divide."""
    if c.num_heads % world:
        raise InvalidInput(f"{c.num_heads} attention heads do not split {world} ways (--tp {world})")
    if c.mla is None:
        nkv = c.num_kv_heads
        if (world <= nkv and nkv % world) or (world > nkv and world % nkv):
            raise InvalidInput(f"{nkv} key/value heads neither split {world} ways nor replicate evenly "
                               f"(--tp {world})")
    if dense_mlp_used(c) and c.intermediate_size % world:
        raise InvalidInput(f"MLP width {c.intermediate_size} does not split {world} ways (--tp {world})")
    if c.moe is not None and moe == "ep":
        if c.moe.num_experts % world:
            raise InvalidInput(f"{c.moe.num_experts} routed experts do not split {world} ways "
                               f"(--tp {world} --moe-parallel ep)")
        if (shared := c.moe.expert_size * c.moe.shared_experts) % world:
            raise InvalidInput(f"shared experts' width {shared} does not split {world} ways (--tp {world})")
    elif c.moe is not None and c.moe.expert_size % world:
        raise InvalidInput(f"expert width {c.moe.expert_size} does not split {world} ways (--tp {world})")
    if c.moe is not None and c.moe.stored and moe != "ep":
        raise InvalidInput(f"routed experts kept quantized ({c.moe.stored[0]}) are not split by width: "
                           f"--moe-parallel ep keeps them whole, as stored")


def kv_heads(c: ModelConfig, tp: TP) -> tuple[int, int]:
    """(first KV head, count) held by this rank: its share, or the one its query heads read."""
    nkv = c.num_kv_heads
    if c.mla is not None:
        return 0, nkv
    if tp.world <= nkv:
        return tp.rank * nkv // tp.world, nkv // tp.world
    return tp.rank // (tp.world // nkv), 1


def experts_held(c: ModelConfig, tp: TP) -> tuple[int, int] | None:
    """(first routed expert, count) held whole by this rank under expert parallelism; None otherwise."""
    if c.moe is None or tp.moe != "ep":
        return None
    n = c.moe.num_experts // tp.world
    return tp.rank * n, n


def local_config(c: ModelConfig, tp: TP) -> ModelConfig:
    """The config of this rank's slice: a model of it is what the rank builds."""
    if tp.world == 1:
        return c
    check(c, tp.world, tp.moe)
    heads = c.num_heads // tp.world
    kw = dict(num_heads=heads, intermediate_size=c.intermediate_size // tp.world,
              num_kv_heads=heads if c.mla is not None else kv_heads(c, tp)[1])
    if held := experts_held(c, tp):
        kw["moe"] = dataclasses.replace(c.moe, local_experts=held,
                                        shared_width=c.moe.expert_size * c.moe.shared_experts // tp.world)
    elif c.moe is not None:
        kw["moe"] = dataclasses.replace(c.moe, expert_size=c.moe.expert_size // tp.world)
    return c.replace(**kw, vocab_slice=vocab.rows(c.vocab_size, tp.rank, tp.world), whole=c)


def split(t: torch.Tensor, dim: int, tp: TP) -> torch.Tensor:
    n = t.shape[dim] // tp.world
    return t.narrow(dim, tp.rank * n, n)


def shard_pairs(pairs: Iterable[tuple[str, torch.Tensor]], c: ModelConfig, tp: TP) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs cut to this rank's slice (see the module's docstring)."""
    check(c, tp.world, tp.moe)
    first, count = kv_heads(c, tp)
    own = experts_held(c, tp)
    for name, t in pairs:
        if own and (m := ROUTED.search(name)):  # a whole expert: this rank's, renumbered, or none
            e = int(m.group(1)) - own[0]
            if 0 <= e < own[1]:
                yield f"{name[:m.start()]}.experts.{e}.{name[m.end():]}", t
            continue
        if VOCAB.match(name):
            t = vocab.slice_rows(t, *vocab.rows(c.vocab_size, tp.rank, tp.world))
        elif COLUMN.search(name):
            t = split(t, 0, tp)
        elif KV.search(name) and c.mla is None:
            t = t[first * c.head_dim:(first + count) * c.head_dim]
        elif ROW.search(name):
            if name.endswith(".weight"):
                t = split(t, 1, tp)
            elif tp.rank:  # the bias is added once, after the sum
                t = torch.zeros_like(t)
        yield name, t


def _all_reduce(module, inputs, output):
    import torch.distributed as dist

    dist.all_reduce(output[0] if isinstance(output, tuple) else output)
    return output


def all_reduce_outputs(model) -> None:
    """Sum each layer's partial attention output and partial MLP / MoE output over the ranks (the
    default process group): a forward hook on the attention and one on the layer, whose first
    output is its feed-forward block's."""
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(_all_reduce)
        layer.register_forward_hook(_all_reduce)
