"""The EAGLE-3 training-time test (TTT): the head is unrolled for `steps` steps over a whole
sequence at once, each step seeing what it would see at that drafting depth.

At sequence index t, step k feeds the true token x[t+1+k] with the previous step's output at t
(step 0: fc(target taps at t)), at RoPE position t+k, and is trained toward the target's own
next-token distribution at t+1+k (it predicts x[t+2+k]), restricted to the draft vocabulary. Step
k attends to step-0 keys causally and, for each earlier step j >= 1, to its key at the same index
only (a diagonal): exactly the committed prefix plus the node's own ancestors at inference.
`TTTAttention` computes that as causal scores plus one diagonal score per earlier step, never a
(T, (k+1)T) mask. Loss: sum_k 0.8^k * soft cross-entropy (against the target's distribution, or a
sharpened one: `sharpen`), on assistant tokens whose target argmax is in the draft vocabulary; the
head's lm_head runs only at those positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..spec.drafters.eagle3_head import Eagle3Head


@dataclass
class TTTOut:
    loss: torch.Tensor  # scalar, weighted sum over steps
    step_loss: list[float]
    step_acc: list[float]  # draft argmax == target argmax, per step
    tokens: int  # positions that carried loss at step 0


@dataclass
class Targets:
    """What the head is trained toward, from the target's logits at each (b, t)."""
    p: torch.Tensor  # (B, T, Vd) float32: the target's distribution restricted to the draft vocabulary
    arg: torch.Tensor  # (B, T) its argmax, as a draft id
    in_vocab: torch.Tensor  # (B, T) bool: the target's argmax over its full vocabulary is draftable

    @staticmethod
    def from_logits(head: Eagle3Head, logits: torch.Tensor, temperature: float = 1.0) -> Targets:
        """From full target logits (B, T, V)."""
        z = logits[..., head.draft_to_target()].float()  # (B, T, Vd)
        return Targets(sharpen(z, temperature), z.argmax(-1), head.t2d[logits.argmax(-1)])

    @staticmethod
    def from_hidden(head: Eagle3Head, hidden: torch.Tensor, lm_weight: torch.Tensor,
                    temperature: float = 1.0) -> Targets:
        """From the target's final hidden states (B, T, H) and its lm_head weight (V, H), without a
        full-vocabulary logits tensor: the draft rows' logits, and the best other logit's value."""
        z = F.linear(hidden, lm_weight[head.draft_to_target()]).float()  # (B, T, Vd)
        in_vocab = torch.ones(z.shape[:2], dtype=torch.bool, device=z.device)
        if not bool(head.t2d.all()):
            rest = F.linear(hidden, lm_weight[~head.t2d]).amax(-1)  # (B, T): best non-draftable logit
            in_vocab = z.amax(-1) >= rest
        return Targets(sharpen(z, temperature), z.argmax(-1), in_vocab)


def sharpen(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(z / temperature): 1 is the target's own distribution (EAGLE-3's soft labels), below 1
    a sharper one, 0 its argmax alone (hard labels; greedy acceptance asks only for the argmax)."""
    if temperature == 0:
        return F.one_hot(z.argmax(-1), z.shape[-1]).to(z.dtype)
    return (z / temperature).softmax(-1)


class TTTAttention:
    """The head's cache during the TTT (the `Cache` interface of kvcache.py): step 0 is causal over
    its own keys; step k's query at index t also sees the keys of steps 1..k at t, in the same
    layer. Scores in the query's dtype (bfloat16 under autocast), softmax accumulated in float32."""

    in_place = False

    def __init__(self):
        self.k0: dict[int, torch.Tensor] = {}  # per layer: step 0's keys and values (B, Hkv, T, D)
        self.v0: dict[int, torch.Tensor] = {}
        self.kd: dict[int, list[torch.Tensor]] = {}  # per layer: later steps' keys and values, one diagonal each
        self.vd: dict[int, list[torch.Tensor]] = {}

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta=None) -> torch.Tensor:
        """q (B, Hkv, G*T, D) and this step's keys and values kv (B, T, 2, Hkv, D) -> (B, H, T, D)."""
        b, t, _, hkv, d = kv.shape
        q = q.view(b, -1, t, d)  # (B, H, T, D)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (B, Hkv, T, D)
        if layer not in self.k0:
            self.k0[layer], self.v0[layer], self.kd[layer], self.vd[layer] = k, v, [], []
        else:
            self.kd[layer].append(k)
            self.vd[layer].append(v)
        k0, v0, kds, vds = self.k0[layer], self.v0[layer], self.kd[layer], self.vd[layer]
        b, h, t, d = q.shape
        dev = q.device.type  # under autocast (bfloat16 on the GPU): scores and products in its dtype
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
        qg = q.to(dt).view(b, k.shape[1], h // k.shape[1], t, d) * d ** -0.5  # (B, Hkv, G, T, D)
        s = qg @ k0.to(dt)[:, :, None].transpose(-1, -2)  # (B, Hkv, G, T, T)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))  # causal
        if kds:
            kd = torch.stack(kds, -2).to(dt)[:, :, None]  # (B, Hkv, 1, T, k, D)
            s = torch.cat([s, (qg.unsqueeze(-2) * kd).sum(-1)], -1)  # (B, Hkv, G, T, T + k)
        p0, pd = s.softmax(-1, dtype=torch.float32).to(dt).split([t, len(kds)], -1)
        o = p0 @ v0.to(dt)[:, :, None]  # (B, Hkv, G, T, D)
        if kds:
            vd = torch.stack(vds, -2).to(dt)[:, :, None]  # (B, Hkv, 1, T, k, D)
            o = o + (pd.unsqueeze(-1) * vd).sum(-2)
        return o.view(b, h, t, d)


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at index t (dim 1), padded with `fill` past the end."""
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], 1)


def ttt_mask(t: int, k: int, device) -> torch.Tensor:
    """(T, (k+1)T) bool: causal over step 0, then one diagonal per earlier step and itself (the
    visibility TTTAttention computes; the reference for tests)."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * k, 1)


def loss_positions(loss_mask: torch.Tensor, in_vocab: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """For each step k, the flat indices b*T + t that carry loss (x[t+2+k] is an assistant token and
    the target's choice at t+1+k is draftable), and their counts. One host sync for all steps."""
    m = torch.stack([shift(loss_mask, 2 + k, False) & shift(in_vocab, 1 + k, False) for k in range(steps)])  # (K, B, T)
    counts = m.sum((1, 2)).tolist()  # sync
    return list(m.flatten(1).nonzero()[:, 1].split(counts)), counts


def ttt_hidden(head: Eagle3Head, embed_weight: torch.Tensor, taps: torch.Tensor, input_ids: torch.Tensor,
               steps: int):
    """The head's output (B, T, H) at each training-time-test step k = 0..steps-1: at index t it has
    seen the taps of x[t] and the tokens x[t+1..t+1+k], and guesses x[t+2+k]."""
    b, t = input_ids.shape
    h = head.fc(taps)  # (B, T, H)
    attn = TTTAttention()
    for k in range(steps):
        positions = (torch.arange(t, device=input_ids.device) + k).expand(b, t)
        emb = F.embedding(shift(input_ids, 1 + k), embed_weight)  # (B, T, H): x[t+1+k]
        h = head(emb, h, positions, attn, None)  # (B, T, H)
        yield h


def ttt_loss(head: Eagle3Head, embed_weight: torch.Tensor, taps: torch.Tensor, target: Targets | torch.Tensor,
             input_ids: torch.Tensor, loss_mask: torch.Tensor, steps: int = 7, decay: float = 0.8) -> TTTOut:
    """taps (B, T, 3Ht) and target (Targets, or full logits (B, T, V)) from the frozen target over
    input_ids (B, T); loss_mask (B, T) marks assistant tokens (padding False)."""
    if isinstance(target, torch.Tensor):
        target = Targets.from_logits(head, target)
    dev = input_ids.device
    where, counts = loss_positions(loss_mask, target.in_vocab, steps)
    p_all, arg_all = target.p.flatten(0, 1), target.arg.flatten()  # (B*T, Vd), (B*T,)
    total = torch.zeros((), device=dev)
    stats = []  # per step (loss, accuracy), brought to the host once at the end
    for k, h in enumerate(ttt_hidden(head, embed_weight, taps, input_ids, steps)):
        if counts[k] == 0:
            stats.append(torch.zeros(2, device=dev))
            continue
        idx = where[k]  # (N,) flat b*T + t
        logits = head.logits(h.flatten(0, 1)[idx]).float()  # (N, Vd): only where there is a loss
        loss_k = F.cross_entropy(logits, p_all[idx + 1 + k])  # soft targets: the target at t+1+k
        total = total + decay ** k * loss_k
        acc = (logits.argmax(-1) == arg_all[idx + 1 + k]).float().mean()
        stats.append(torch.stack([loss_k.detach(), acc]))
    step_loss, step_acc = zip(*torch.stack(stats).tolist())  # sync
    return TTTOut(total, list(step_loss), list(step_acc), counts[0])
