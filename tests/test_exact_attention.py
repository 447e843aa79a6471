"""The exact path's attention kernel (models/exact_attention.py) on the CPU through Triton's
interpreter (conftest sets TRITON_INTERPRET=1 without a GPU), in float16 (the interpreter has no
bfloat16), and on the GPU where there is one: it attends as SDPA does over the slots each token's
mask shows, and a token verified in a tree, a chain or a batch gets bitwise the output of the
one-token decode that would produce it, over another span."""
import math

import pytest
import torch
import torch.nn.functional as F

from eaglet.models.exact_attention import exact_attention
from eaglet.models.llama import rms_norm, rotate_half

from .triton_kernels import triton_device

DEV = triton_device()
DT = torch.float16 if DEV == "cpu" else torch.bfloat16
HKV, G, D = 2, 3, 16
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6]  # a tree of 8 nodes, each after its parent


def depth(t: int) -> int:
    return 0 if PARENTS[t] < 0 else 1 + depth(PARENTS[t])


def ancestors(t: int) -> list[int]:
    return [] if t < 0 else ancestors(PARENTS[t]) + [t]


def rope(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = pos[..., None].float() * inv
    emb = torch.cat([emb, emb], -1)
    return emb.cos().to(DT)[:, :, None].to(DEV), emb.sin().to(DT)[:, :, None].to(DEV)


def setup(rows: int, committed: list[int], t: int, span: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.zeros(rows, HKV, span + 64, D, dtype=DT)
    v = torch.zeros_like(k)
    for r, c in enumerate(committed):
        k[r, :, :c] = torch.randn(HKV, c, D, generator=g).to(DT)
        v[r, :, :c] = torch.randn(HKV, c, D, generator=g).to(DT)
    qkv = torch.randn(rows, t, HKV * G + 2 * HKV, D, generator=g).to(DT)
    norm = ((1 + 0.1 * torch.randn(D, generator=g)).to(DT).to(DEV), (1 + 0.1 * torch.randn(D, generator=g)).to(DT).to(DEV),
            1e-6)
    return k.to(DEV), v.to(DEV), qkv.to(DEV), norm


def reference(qkv, k, v, start, seen, cos, sin, norm) -> torch.Tensor:
    """Row 0's attention (T, H * D) in float32 from the cache `k`, `v` and new tokens visible per
    `seen` (T, T), with q/k normed and rotated as the kernel does."""
    t = qkv.shape[1]
    q, kn, vn = qkv[0].float().split([HKV * G, HKV, HKV], 1)
    q = rms_norm(q, norm[0].float(), norm[2]) * cos[0].float() + rotate_half(rms_norm(q, norm[0].float(), norm[2])) * sin[0].float()
    kn = rms_norm(kn, norm[1].float(), norm[2]) * cos[0].float() + rotate_half(rms_norm(kn, norm[1].float(), norm[2])) * sin[0].float()
    out = []
    for i in range(t):
        keys = torch.cat([k[0, :, :start].float(), kn[seen[i]].transpose(0, 1)], 1)  # (Hkv, S, D)
        vals = torch.cat([v[0, :, :start].float(), vn[seen[i]].transpose(0, 1)], 1)
        qi = q[i].view(HKV, G, D)
        out.append(F.scaled_dot_product_attention(qi, keys, vals, scale=1 / math.sqrt(D)).reshape(-1))
    return torch.stack(out)


@torch.inference_mode()
def test_a_tree_verify_attends_as_its_mask_says_and_each_node_as_its_decode():
    c, t = 300, len(PARENTS)
    k, v, qkv, norm = setup(1, [c], t, 600)
    seen = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        seen[i, ancestors(i)] = True
    pos = c + torch.tensor([depth(i) for i in range(t)])[None]
    cos, sin = rope(pos)
    start = torch.tensor([c], device=DEV)
    kv, vv = k.clone(), v.clone()
    out = exact_attention(qkv, kv, vv, start, seen[None].to(DEV), 560, G, rope=(cos, sin), qk_norm=norm)
    ref = reference(qkv, k, v, c, seen, cos, sin, norm)
    torch.testing.assert_close(out[0].float(), ref, atol=2e-2, rtol=2e-2)
    for i in range(t):  # the node decoded alone: its ancestors committed in order before it, a shorter span
        path = ancestors(i)
        kd, vd = k.clone(), v.clone()
        kd[0, :, c:c + len(path) - 1] = kv[0, :, [c + a for a in path[:-1]]]
        vd[0, :, c:c + len(path) - 1] = vv[0, :, [c + a for a in path[:-1]]]
        s = c + len(path) - 1
        alone = exact_attention(qkv[:, i:i + 1], kd, vd, torch.tensor([s], device=DEV), None, s + 1, G,
                                rope=(cos[:, i:i + 1], sin[:, i:i + 1]), qk_norm=norm)
        assert torch.equal(alone[0, 0], out[0, i]), i
        assert torch.equal(kd[0, :, s], kv[0, :, c + i]) and torch.equal(vd[0, :, s], vv[0, :, c + i])


@torch.inference_mode()
def test_a_chain_in_a_batch_gives_each_token_its_decode_alone():
    committed, t = [70, 250], 6
    k, v, qkv, _ = setup(2, committed, t, 400, seed=1)
    pos = torch.tensor(committed)[:, None] + torch.arange(t)
    cos, sin = rope(pos)
    start = torch.tensor(committed, device=DEV)
    kv, vv = k.clone(), v.clone()
    out = exact_attention(qkv, kv, vv, start, None, 384, G, rope=(cos, sin))
    for r in range(2):
        kd, vd = k[r:r + 1].clone(), v[r:r + 1].clone()
        for i in range(t):
            s = committed[r] + i
            alone = exact_attention(qkv[r:r + 1, i:i + 1], kd, vd, torch.tensor([s], device=DEV), None, s + 1, G,
                                    rope=(cos[r:r + 1, i:i + 1], sin[r:r + 1, i:i + 1]))
            assert torch.equal(alone[0, 0], out[r, i]), (r, i)
    assert torch.equal(kd, kv[1:]) and torch.equal(vd, vv[1:])


@torch.inference_mode()
def test_pending_tree_levels_are_seen_as_the_mask_says():
    """A drafter's later tree level: `pending` slots before start, the mask covering them too."""
    c, p, t = 40, 3, 2
    k, v, qkv, _ = setup(1, [c + p], t, 64, seed=2)
    mask = torch.tensor([[[True, False, True, True, False], [False, True, False, False, True]]])
    cos, sin = rope(torch.tensor([[c + 2, c + 1]]))
    out = exact_attention(qkv, k.clone(), v.clone(), torch.tensor([c + p], device=DEV), mask.to(DEV), 64, G,
                          rope=(cos, sin), pending=p)
    q, kn, vn = qkv[0].float().split([HKV * G, HKV, HKV], 1)
    q = q * cos[0].float() + rotate_half(q) * sin[0].float()
    kn = kn * cos[0].float() + rotate_half(kn) * sin[0].float()
    for i in range(t):
        keys = torch.cat([k[0, :, :c].float(), k[0, :, c:c + p][:, mask[0, i, :p]].float(), kn[mask[0, i, p:]].transpose(0, 1)], 1)
        vals = torch.cat([v[0, :, :c].float(), v[0, :, c:c + p][:, mask[0, i, :p]].float(), vn[mask[0, i, p:]].transpose(0, 1)], 1)
        ref = F.scaled_dot_product_attention(q[i].view(HKV, G, D), keys, vals, scale=1 / math.sqrt(D)).reshape(-1)
        torch.testing.assert_close(out[0, i].float(), ref, atol=2e-2, rtol=2e-2)
