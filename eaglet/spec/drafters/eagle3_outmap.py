"""Moving an EAGLE-3 head onto the target's output layer without discarding what it learned.

A head with its own lm_head rows writes its residual stream in a basis of its own; the target's
rows read another. The head's residual stream is private (fc, o_proj and down_proj write it; the
norms before q/k/v, the MLP and lm_head read it; the next draft step reads it back), and RMSNorm
commutes with an orthogonal change of basis once its weight is folded into the layer that reads it.
So the whole head can be rotated by any orthogonal Q without changing a single draft
(`rotate_residual`), and the rotation plus the final norm's weight s are free to bring the head's
rows onto the target's: rows(draft ids) ≈ target_rows[ids] · diag(s) · Q (`fit_output_map`,
alternating orthogonal Procrustes and per-dimension least squares). The fit is as good as the two
sets of rows are related; training finishes the move.
"""
from __future__ import annotations

import copy

import torch

from .eagle3_head import Eagle3Head


def output_rows(head: Eagle3Head) -> torch.Tensor:
    """(Vd, H) the head's output rows with its final norm's weight folded in (float32): what it drafts with."""
    return head.lm_head.weight.detach().float() * head.norm.weight.detach().float()


def fit_output_map(rows: torch.Tensor, target_rows: torch.Tensor, iters: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, s), Q (H, H) orthogonal and s (H,), minimising ||target_rows · diag(s) · Q - rows||:
    `rows` (V, H) are the head's output rows with its final norm's weight folded in, `target_rows`
    (V, H) the target's rows of the same ids."""
    rows, t = rows.detach().double(), target_rows.detach().double()
    s = torch.full((t.shape[1],), float(rows.norm() / t.norm()), dtype=torch.float64, device=t.device)
    for _ in range(iters):
        u, _, vh = torch.linalg.svd((t * s).T @ rows)
        q = u @ vh  # Procrustes: the rotation of t·diag(s) closest to rows
        s = (t * (rows @ q.T)).sum(0) / (t * t).sum(0).clamp_min(1e-12)  # each dimension's scale, given q
    return q.float(), s.float()


@torch.no_grad()
def rotate_residual(head: Eagle3Head, q: torch.Tensor) -> None:
    """Change the head's residual basis to h' = q·h, in place, its drafts unchanged: the writers
    (fc, o_proj, down_proj) are multiplied by q; the weights of the norms that read the stream
    (hidden_norm, post_attention_layernorm, norm) are folded into their readers (the hidden half
    of q/k/v, gate/up, lm_head), which are multiplied by q^T, and set to one. Refused for a shared
    (frozen) lm_head, and for norm_before_residual (hidden_norm's output joins the stream)."""
    layer = head.midlayer
    head.one_layer("rotate_residual")
    if layer.self_attn.fused or layer.mlp.fused:
        raise ValueError("rotate_residual: the head's projections are fused (inference only)")
    if head.cfg.shared_lm_head:
        raise ValueError("rotate_residual: the head drafts through the target's output layer, which cannot turn")
    if head.cfg.norm_before_residual:  # hidden_norm's output is the residual: its weight cannot be folded away
        raise ValueError("rotate_residual: the head's residual starts from hidden_norm (norm_before_residual)")
    q = q.to(head.fc.weight)
    h = q.shape[0]
    for lin in (head.fc, layer.self_attn.o_proj, layer.mlp.down_proj):
        lin.weight.copy_(q @ lin.weight)
    g = layer.hidden_norm.weight.clone()
    for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
        lin.weight[:, h:] = (lin.weight[:, h:] * g) @ q.T  # [embedding; hidden]: only the hidden half
    for norm, readers in ((layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj)),
                          (head.norm, (head.lm_head,))):
        g = norm.weight.clone()
        for lin in readers:
            lin.weight.copy_((lin.weight * g) @ q.T)
    for norm in (layer.hidden_norm, layer.post_attention_layernorm, head.norm):
        norm.weight.fill_(1.0)


def onto_target_output(head: Eagle3Head, target_lm_head: torch.Tensor,
                       output_map: tuple[torch.Tensor, torch.Tensor] | None = None) -> Eagle3Head:
    """A copy of `head` drafting through `target_lm_head` (V, H), rotated so its output lands as near
    the target's rows as one rotation and one norm weight can bring it (`fit_output_map` over the
    head's draft ids, unless `output_map` = (Q, s) is given). A norm_before_residual head cannot turn
    (`rotate_residual`): its rows are dropped as they are (`Eagle3Head.with_shared_lm_head`)."""
    if head.cfg.shared_lm_head:
        raise ValueError("onto_target_output: the head already drafts through the target's output layer")
    if head.cfg.norm_before_residual:
        return head.with_shared_lm_head(target_lm_head)
    if output_map is None:
        t = target_lm_head.detach().float()
        output_map = fit_output_map(output_rows(head).to(t.device), t[head.draft_to_target().to(t.device)])
    q, s = output_map
    turned = copy.deepcopy(head)
    rotate_residual(turned, q)
    shared = turned.with_shared_lm_head(target_lm_head)
    with torch.no_grad():
        shared.norm.weight.copy_(s)
    return shared
