"""The EAGLE-3 training-time test (TTT): the head is unrolled for `steps` steps over a whole
sequence at once, each step seeing what it would see at that drafting depth.

At sequence index t, step k feeds the true token x[t+1+k] with the previous step's output at t
(step 0: fc(target taps at t)), at RoPE position t+k, and is trained toward the target's own
next-token distribution at t+1+k (it predicts x[t+2+k]), restricted to the draft vocabulary. Step
k attends to step-0 keys causally and, for each earlier step j >= 1, to its key at the same index
only (a diagonal): exactly the committed prefix plus the node's own ancestors at inference.
Loss: sum_k 0.8^k * soft cross-entropy, on assistant tokens whose target argmax is in the draft
vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kvcache import AppendKV
from ..models.attention import AttnMeta
from ..spec.drafters.eagle3_head import Eagle3Head


@dataclass
class TTTOut:
    loss: torch.Tensor  # scalar, weighted sum over steps
    step_loss: list[float]
    step_acc: list[float]  # draft argmax == target argmax, per step
    tokens: int  # positions that carried loss at step 0


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at index t (dim 1), padded with `fill` past the end."""
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], 1)


def ttt_mask(t: int, k: int, device) -> torch.Tensor:
    """(T, (k+1)T) bool: causal over step 0, then one diagonal per earlier step and itself."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * k, 1)


def ttt_loss(head: Eagle3Head, embed_weight: torch.Tensor, taps: torch.Tensor, target_logits: torch.Tensor,
             input_ids: torch.Tensor, loss_mask: torch.Tensor, steps: int = 7, decay: float = 0.8) -> TTTOut:
    """taps (B, T, 3Ht) and target_logits (B, T, V) from the frozen target over input_ids (B, T);
    loss_mask (B, T) marks assistant tokens (padding False)."""
    b, t = input_ids.shape
    dev = input_ids.device
    draft_ids = head.draft_to_target()  # (Vd,)
    with torch.no_grad():
        p_all = target_logits[..., draft_ids].float().softmax(-1)  # (B, T, Vd)
        in_vocab = head.t2d[target_logits.argmax(-1)]  # (B, T): target's choice is draftable
        target_arg = p_all.argmax(-1)
    h = head.fc(taps)  # (B, T, H)
    kv = AppendKV(1)
    zeros = torch.zeros(b, dtype=torch.long, device=dev)
    total = torch.zeros((), device=dev)
    step_loss, step_acc, n0 = [], [], 0
    for k in range(steps):
        tok = shift(input_ids, 1 + k)
        p = shift(p_all, 1 + k)
        # the predicted token x[t+2+k] is an assistant token, and the target's choice at t+1+k is draftable
        m = shift(loss_mask, 2 + k, False) & shift(in_vocab, 1 + k, False)
        positions = (torch.arange(t, device=dev) + k).expand(b, t)
        meta = AttnMeta.build(zeros, positions, (k + 1) * t, tree_mask=ttt_mask(t, k, dev).expand(b, t, -1),
                              pending=k * t)
        emb = torch.nn.functional.embedding(tok, embed_weight)
        h = head(emb, h, positions, kv, meta)  # (B, T, H)
        logp = head.logits(h).float().log_softmax(-1)  # (B, T, Vd)
        n = int(m.sum())  # sync: a count for averaging and the progress bar
        if k == 0:
            n0 = n
        if n == 0:
            step_loss.append(0.0)
            step_acc.append(0.0)
            continue
        loss_k = -(p * logp).sum(-1)[m].mean()
        total = total + decay ** k * loss_k
        step_loss.append(float(loss_k.detach()))
        step_acc.append(float((logp.argmax(-1) == shift(target_arg, 1 + k))[m].float().mean()))
    return TTTOut(total, step_loss, step_acc, n0)
