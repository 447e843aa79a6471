"""MLA's per-head matmuls for one token (models/mla_heads.py), on the CPU through Triton's interpreter
(float16): `absorb` and `values` against the einsums of the absorbed form, value rows that fill
their tile and rows that leave part of it masked; a tiny DeepSeek-V3 decoding one row through them
gives the general path's logits."""
import pytest
import torch

from eaglet.kernels import EAGER
from eaglet.models import mla_heads

from .conftest import hf_model
from .triton_kernels import CACHE_ATTENTION, greedy_logits, triton_device

DEV = triton_device()


@pytest.mark.parametrize("nh,nope,v,c", [(4, 16, 16, 64), (3, 32, 24, 128)])
def test_per_head_matmuls_match_the_einsums(nh, nope, v, c):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(nh, nope + v, c, generator=gen).half().to(DEV)
    q = torch.randn(1, 1, nh, nope + 8, generator=gen).half().to(DEV)[..., :nope]  # a strided view, as split gives
    q_lat = mla_heads.absorb(q.view(nh, nope), w, nope)
    want = torch.einsum("hn,hnc->hc", q[0, 0].float(), w[:, :nope].float())
    torch.testing.assert_close(q_lat.float(), want, atol=2e-2, rtol=2e-2)
    o_lat = torch.randn(nh, c, generator=gen).half().to(DEV)
    out = torch.full((nh, v), float("nan"), dtype=torch.float16, device=DEV)
    mla_heads.values(o_lat, w, nope, out)
    torch.testing.assert_close(out.float(), torch.einsum("hc,hvc->hv", o_lat.float(), w[:, nope:].float()),
                               atol=2e-2, rtol=2e-2)


@torch.inference_mode()
def test_one_row_decoding_through_them_matches_the_general_path(tmp_path):
    from eaglet.kvcache import KVCache
    from eaglet.weights import load_model

    hf_model("deepseek_v3", kv_lora_rank=32, num_hidden_layers=2).save_pretrained(tmp_path, safe_serialization=True)
    prompt = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2)).to(DEV)
    runs, calls = [], []
    inner = mla_heads.values
    mla_heads.values = lambda *a: calls.append(1) or inner(*a)
    try:
        for kernels in (CACHE_ATTENTION, EAGER):
            model = load_model(tmp_path, dtype="float16", device=DEV, tokenizer=False, kernels=kernels).model
            cache = KVCache.for_model(model.config, 1, 32, torch.float16, DEV)
            runs.append(greedy_logits(model, cache, prompt, 6))
    finally:
        mla_heads.values = inner
    assert len(calls) == 5 * model.config.num_layers  # each one-token step, each layer; not the prompt
    torch.testing.assert_close(runs[0], runs[1], atol=2e-2, rtol=2e-2)
