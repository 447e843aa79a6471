"""Quantized MoE checkpoints (weights/quant.py), written here from a tiny random Qwen3-MoE the way
DeepSeek-V3 / Kimi-K2 (FP8 in 128 x 128 blocks) and Kimi-K2.5 (compressed-tensors INT4 packs, groups
of 32) ship: eaglet loads each to the tensors of their reference dequantization, computed here
independently, and refuses an unknown method or a scale of the wrong shape by name."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglet.errors import ModelLoadError
from eaglet.weights import load_model


def quantizable(name: str, t: torch.Tensor) -> bool:
    """The linear weights a quantized release stores quantized (not norms, embeddings, router, head)."""
    return t.dim() == 2 and name.endswith("proj.weight")


def fp8_reference(w: torch.Tensor, block: int = 8):
    """(float8 weight, scale_inv per block, its dequantization): scale = block absmax / 448."""
    r, c = w.shape
    nb = (-(-r // block), -(-c // block))
    scale = torch.zeros(nb)
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    deq = torch.empty(r, c)
    for i in range(nb[0]):
        for j in range(nb[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = blk.abs().max().clamp(min=1e-8) / 448
            qb = (blk / s).to(torch.float8_e4m3fn)
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = qb
            deq[i * block:(i + 1) * block, j * block:(j + 1) * block] = qb.float() * s
    return q, scale, deq


def int4_reference(w: torch.Tensor, group: int = 32):
    """(int32 packs, scales, shape, dequantization): q = round(w / s) in [-8, 7], s = group absmax / 7,
    packed eight to an int32 (column 8c + i in bits 4i of column c) with an offset of 8."""
    r, c = w.shape
    s = w.reshape(r, c // group, group).abs().amax(-1).clamp(min=1e-8) / 7  # (r, c / group)
    q = (w / s.repeat_interleave(group, 1)).round().clamp(-8, 7).to(torch.int64)
    u = (q + 8).numpy().astype(np.uint32)
    packed = np.zeros((r, c // 8), dtype=np.uint32)
    for i in range(8):
        packed |= u[:, i::8] << (4 * i)
    return (torch.from_numpy(packed.view(np.int32)), s.to(torch.bfloat16), torch.tensor([r, c]),
            q.float() * s.to(torch.bfloat16).float().repeat_interleave(group, 1))


def write_quantized(src, dst, method: str) -> dict[str, torch.Tensor]:
    """A copy of the checkpoint in `src` quantized by `method`; returns the reference weights."""
    shutil.copytree(src, dst)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    out, ref = {}, {}
    for name, t in state.items():
        base = name.removesuffix(".weight")
        if not quantizable(name, t):
            out[name] = ref[name] = t
        elif method == "fp8":
            q, s, ref[name] = fp8_reference(t)
            out[name], out[base + ".weight_scale_inv"] = q, s
        else:
            out[base + ".weight_packed"], out[base + ".weight_scale"], out[base + ".weight_shape"], ref[name] = \
                int4_reference(t)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [8, 8]},
                                  "int4": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                               "num_bits": 4, "type": "int", "symmetric": True,
                                               "strategy": "group", "group_size": 32}}}}}[method]
    (dst / "config.json").write_text(json.dumps(cfg))
    return ref


@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_quantized_moe_checkpoint_loads_to_its_dequantization(tiny_dirs, tmp_path, method):
    ref = write_quantized(tiny_dirs["qwen3_moe"][0], tmp_path / method, method)
    model = load_model(tmp_path / method, dtype="float32", device="cpu", tokenizer=False).model
    state = model.state_dict()
    assert sum(quantizable(n, t) for n, t in ref.items()) > 40  # attention and every expert's linears
    for name, want in ref.items():
        assert torch.equal(state[name], want.float()), name
    plain = tiny_dirs["qwen3_moe"][1].model.layers[1].self_attn.q_proj.weight
    assert 0 < (state["model.layers.1.self_attn.q_proj.weight"] - plain).abs().max() < 0.1 * plain.abs().max()


def test_bad_quantized_checkpoints_are_refused_by_name(tiny_dirs, tmp_path):
    d = tmp_path / "fp8"
    write_quantized(tiny_dirs["qwen3_moe"][0], d, "fp8")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ModelLoadError, match="quant_method 'awq' is not supported"):
        load_model(d, dtype="float32", device="cpu", tokenizer=False)
    (d / "config.json").write_text(json.dumps(cfg))
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    bad = "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"
    state[bad] = state[bad][:, :1].contiguous()
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=bad.replace(".", r"\.")):
        load_model(d, dtype="float32", device="cpu", tokenizer=False)
    del state[bad]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="is missing"):
        load_model(d, dtype="float32", device="cpu", tokenizer=False)


@pytest.mark.parametrize("method", ["fp8", "int4"])
@torch.inference_mode()
def test_quantized_experts_stay_stored_for_the_fused_kernels(tiny_dirs, tmp_path, method):
    """With the fused MoE kernels (Triton's interpreter here), a quantized checkpoint's routed experts
    stay as stored (INT4 packs, FP8 blocks) and the kernels read them so: a prefill of 9 tokens, one
    of 70 (64 tokens at a time) and a decode step give the logits of the same checkpoint dequantized
    at load."""
    import dataclasses

    from eaglet.kernels import EAGER
    from eaglet.kvcache import KVCache
    from eaglet.models.fused_moe import Fp8Block, Int4
    from eaglet.models.moe import SparseMoE

    from .test_model_parity import eaglet_step

    write_quantized(tiny_dirs["qwen3_moe"][0], tmp_path / method, method)
    plain = load_model(tmp_path / method, dtype="float32", device="cpu", tokenizer=False).model
    kept = load_model(tmp_path / method, dtype="float32", device="cpu", tokenizer=False,
                      kernels=dataclasses.replace(EAGER, moe=True)).model
    layer = next(m for m in kept.modules() if isinstance(m, SparseMoE))
    assert isinstance(layer.stacks()[0], Fp8Block if method == "fp8" else Int4)
    assert kept.config.moe.stored == (("fp8", 8) if method == "fp8" else ("int4", 32))
    assert plain.config.moe.stored is None  # no kernels: dequantized as before
    g = torch.Generator().manual_seed(0)
    for t in (9, 70):
        caches = [KVCache.for_model(m.config, 1, 128, torch.float32, "cpu") for m in (plain, kept)]
        for n in (t, 1):
            ids = torch.randint(0, 128, (1, n), generator=g)
            a, b = (eaglet_step(m, c, ids) for m, c in zip((plain, kept), caches))
            assert (a - b).abs().max() <= 1e-5 * a.abs().max(), (t, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["fp8", "int4"])
@torch.inference_mode()
def test_quantized_experts_stay_stored_on_the_gpu(tiny_dirs, tmp_path, method):
    """On the GPU in bfloat16 the fused kernels read the stored experts (chosen by default there): the
    stored stacks dequantize to the dequantized load's weights, and the kernels give on them what they
    give on those weights at 1 to 64 tokens: bitwise for INT4; for FP8 to a bfloat16 rounding (on the
    H200 one call in twelve differed by one unit in the last place, in the down kernel: its gate-up
    output was bitwise equal). Whole models are not compared: in bfloat16 the plain load's MoE path
    rounds otherwise, and a tiny random router flips an expert at a position now and then, moving
    that position's logits by several percent."""
    from eaglet.kernels import Kernels
    from eaglet.models import fused_moe
    from eaglet.models.moe import SparseMoE
    from eaglet.weights.loader import load_model as load

    write_quantized(tiny_dirs["qwen3_moe"][0], tmp_path / method, method)
    kept = load(tmp_path / method, dtype="bfloat16", device="cuda", tokenizer=False).model
    plain = load(tmp_path / method, dtype="bfloat16", device="cuda", tokenizer=False,
                 kernels=Kernels.choose("cuda", disable=("moe",))).model
    assert kept.config.moe.stored and plain.config.moe.stored is None
    for lk, lp in zip(*([m for m in model.modules() if isinstance(m, SparseMoE)] for model in (kept, plain))):
        (gs, ds), (gp, dp) = lk.stacks(), lp.stacks()
        assert torch.equal(gs.dequantized(torch.bfloat16), gp) and torch.equal(ds.dequantized(torch.bfloat16), dp)
        for t in (1, 4, 16, 64):
            x = torch.randn(t, gp.shape[2], dtype=torch.bfloat16, device="cuda")
            weights, experts = lp.route(x, kernel=False)
            a, b = (fused_moe.fused_moe(x, experts, weights, g, d) for g, d in ((gs, ds), (gp, dp)))
            if method == "int4":
                assert torch.equal(a, b), t
            else:
                assert (a.float() - b.float()).abs().max() <= 2 ** -8 * b.float().abs().max(), t


def stored_logits(tp, path: str, moe: str = "tp") -> tuple[torch.Tensor, str, int]:
    """A prefill of 9 tokens and a decode step on this rank of `path` (its MoE layers split as `moe`
    says) with the fused MoE kernels (Triton's interpreter): the logits, the routed experts' storage
    and how many this rank holds."""
    import dataclasses

    from eaglet.kernels import EAGER
    from eaglet.kvcache import KVCache
    from eaglet.models.moe import SparseMoE

    from .test_model_parity import eaglet_step

    model = load_model(path, dtype="float32", device="cpu", tokenizer=False, tp=dataclasses.replace(tp, moe=moe),
                       kernels=dataclasses.replace(EAGER, moe=True)).model
    layer = next(m for m in model.modules() if isinstance(m, SparseMoE))
    cache = KVCache.for_model(model.config, 1, 32, torch.float32, "cpu")
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = torch.cat([eaglet_step(model, cache, ids[:, :9]), eaglet_step(model, cache, ids[:, 9:])], 1)
    return logits, type(layer.stacks()[0]).__name__, layer.held


@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_expert_parallel_ranks_keep_quantized_experts_as_stored(tiny_dirs, tmp_path, method):
    """`--tp 2 --moe-parallel ep` on a quantized checkpoint (as Kimi-K2.5's INT4 experts must run: a
    terabyte once dequantized): each rank keeps its 4 of the 8 experts packed as stored, and the
    logits equal one process's with every expert stored; split by width, they are dequantized."""
    from eaglet.dist.tp import TP
    from eaglet.dist.workers import run

    write_quantized(tiny_dirs["qwen3_moe"][0], tmp_path / method, method)
    path = str(tmp_path / method)
    want, kind, held = stored_logits(TP(0, 1), path)
    assert kind == ("Fp8Block" if method == "fp8" else "Int4") and held == 8
    for logits, kind_r, held_r in run(stored_logits, 2, "cpu", (path, "ep")):
        assert (kind_r, held_r) == (kind, 4)
        assert (logits - want).abs().max() <= 1e-5 * want.abs().max()
    for logits, kind_r, held_r in run(stored_logits, 2, "cpu", (path, "tp")):
        assert kind_r == "Tensor" and held_r == 8  # each expert split by width: dequantized
        assert (logits - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("gate_step,down_step", [(16, 16), (32, 64), (128, 32)])
@torch.inference_mode()
def test_int4_tiles_inside_a_group_and_over_several(gate_step, down_step):
    """The fused kernels unpack INT4 words tile by tile: a reduction step shorter than the group (one
    scale a row), equal to it, or spanning several groups gives the dequantized experts' result
    (Triton's interpreter on the CPU, or the GPU)."""
    pytest.importorskip("triton")
    from eaglet.models import fused_moe
    from eaglet.models.fused_moe import Int4, Tiles

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if not (dev == "cuda" or fused_moe.INTERPRET):
        pytest.skip("needs a GPU or Triton's interpreter")
    g = torch.Generator().manual_seed(gate_step + down_step)
    e, h, i = 4, 96, 64  # H = 96: a tile past the last group of each row

    def stack(rows, cols):
        packs = [int4_reference(torch.randn(rows, cols, generator=g) * 0.1) for _ in range(e)]
        return (Int4(torch.stack([p[0] for p in packs]).to(dev), torch.stack([p[1] for p in packs]).to(dev)),
                torch.stack([p[3] for p in packs]).to(dev))
    (gu, gu_ref), (dn, dn_ref) = stack(2 * i, h), stack(h, i)
    x = torch.randn(5, h, generator=g).to(dev)
    experts = torch.randint(0, e, (5, 2), generator=g).to(dev)
    weights = torch.rand(5, 2, generator=g).to(dev)
    tiles = Tiles(gate_cols=16, gate_step=gate_step, down_cols=16, down_step=down_step)
    out = fused_moe.fused_moe(x, experts, weights, gu, dn, tiles)
    ref = fused_moe.fused_moe(x, experts, weights, gu_ref, dn_ref, tiles)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
