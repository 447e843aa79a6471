"""The few-row matmul kernels (models/gemv.py) on the CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1 without a GPU), in float16 (the interpreter has no bfloat16): the GEMV (one row)
and the tensor-core kernel (2 to 16 rows) equal F.linear for even and ragged widths, with and without
bias, and with the MLP's SiLU·mul fused in (`glu`); linear() sends them up to MAX_ROWS rows, and only
where they may run (no autograd, half precision); as custom ops they trace under torch.compile; a
model prefilling and decoding through them gives the logits of the cuBLAS/MKL path."""
import pytest
import torch
import torch.nn.functional as F

from eaglet import load_model
from eaglet.kvcache import KVCache
from eaglet.models import gemv
from eaglet.models.linear import linear

from eaglet.kernels import EAGER

from .conftest import hf_model
from .triton_kernels import GEMV, greedy_logits, triton_device

DEV = triton_device()


@pytest.mark.parametrize("rows,n,k,bias", [(1, 96, 576, False), (1, 37, 100, True), (1, 33, 9000, True),
                                           (1, 64, 1024, False), (2, 40, 576, True), (6, 64, 256, False),
                                           (16, 33, 100, True), (6, 70, 9000, False), (3, 2100, 40, True),
                                           (1, 37, 2048, True)])
def test_matches_linear(rows, n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).half().to(DEV)
    b = torch.randn(n, generator=g).half().to(DEV) if bias else None
    x = torch.randn(1, rows, k, generator=g).half().to(DEV)
    with torch.no_grad():
        y = gemv.gemv(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.shape == (1, rows, n) and y.dtype == torch.float16
    torch.testing.assert_close(y.float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("rows,i,k,bias", [(1, 48, 576, False), (1, 37, 100, True), (2, 48, 576, True),
                                           (6, 70, 9000, False), (16, 33, 100, True)])
def test_glu_matches_silu_of_gate_times_up(rows, i, k, bias):
    """gate-up and SiLU·mul in one kernel equal F.linear, chunk, silu(gate) * up on the rounded
    products; the up rows are the second half of the weight (and of the bias)."""
    g = torch.Generator().manual_seed(i + k)
    w = (torch.randn(2 * i, k, generator=g) * 0.05).half().to(DEV)
    b = torch.randn(2 * i, generator=g).half().to(DEV) if bias else None
    x = torch.randn(1, rows, k, generator=g).half().to(DEV)
    with torch.no_grad():
        y = gemv.glu(x, w, b)
    gate, up = F.linear(x.float(), w.float(), None if b is None else b.float()).half().float().chunk(2, -1)
    assert y.shape == (1, rows, i) and y.dtype == torch.float16
    torch.testing.assert_close(y.float(), F.silu(gate) * up, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="dependent launch needs compute capability 9")
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("n,k", [(2048, 4096), (5120, 2048), (576, 576)])
def test_a_decode_chain_by_dependent_launch_gives_the_bits_of_plain_launches(n, k, rows, monkeypatch):
    """A norm, two GEMVs and a gate-up after it, each launched dependent on the kernel before and (the
    GEMVs) reading its first weight slices before it waits for its input: the bits of the same GEMVs
    launched plainly, eagerly and in a replayed graph, where each starts while the one before still
    writes its input."""
    from eaglet.models import exact

    g = torch.Generator().manual_seed(n)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.05).bfloat16().cuda()
    nw, w1, w2, w3 = rand(k), rand(n, k), rand(k, n), rand(2 * n, k)
    x, r = rand(rows, k), rand(rows, k)

    def chain():
        h, s = exact.chained_norm(x, nw, 1e-5, r)
        y = gemv.gemv(gemv.gemv(h, w1), w2)
        return torch.cat([y, s, gemv.glu(y, w3)], -1)

    with torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        inputs, eager, replayed = [], [], []
        for _ in range(3):
            inputs.append(rand(rows, k))
            x.copy_(inputs[-1])
            eager.append(chain())
            graph.replay()
            replayed.append(out.clone())
        monkeypatch.setattr(gemv, "PRE_SLICES", 0)  # plain launches
        for xi, got, again in zip(inputs, replayed, eager):
            x.copy_(xi)
            plain = chain()
            assert torch.equal(got, plain) and torch.equal(again, plain)
        assert not torch.equal(replayed[0], replayed[1])


def test_tiles():
    assert gemv.tiles(4096, 14336) == (1, 1024, 8)  # Llama-3.1-8B's down projection
    assert gemv.tiles(960, 576) == (2, 1024, 2)  # SmolLM2's q/k/v
    assert gemv.tiles(49152, 576) == (4, 1024, 2)  # its head
    assert gemv.tiles(576, 1536) == (2, 2048, 4)
    assert gemv.tiles(10, 40) == (2, 64, 2)
    assert gemv.tiles(5120, 2048) == (2, 2048, 8)  # Qwen3-30B-A3B's q/k/v: two rows, one slice
    assert gemv.tiles(151936, 2048) == (4, 2048, 8)  # its head
    assert gemv.dot_tiles(6, 4096, 14336) == (16, 32, 512, 4, 4)
    assert gemv.dot_tiles(16, 28672, 4096) == (16, 64, 128, 4, 3)
    assert gemv.dot_tiles(6, 49152, 576) is None  # SmolLM2's head: cuBLAS
    assert not gemv.usable(torch.ones(6, 576).half(), torch.ones(49152, 576).half(), 6)
    assert gemv.glu_tiles(1, 4096) == (1, 2048, 8) and gemv.glu_tiles(1, 576) == (1, 256, 4)
    assert gemv.glu_tiles(16, 4096) == (16, 32, 128, 4, 3) and gemv.glu_tiles(6, 576) == (16, 32, 128, 4, 4)


def test_linear_routes_single_half_rows_without_grad(monkeypatch):
    calls = []
    monkeypatch.setattr(gemv, "gemv", lambda x, w, b=None: calls.append(x.shape) or F.linear(x, w, b))
    w = torch.randn(8, 16).half().to(DEV)
    with torch.no_grad():
        linear(torch.randn(1, 1, 16).half().to(DEV), w, kernels=GEMV)
        linear(torch.randn(1, 16).half().to(DEV), w, kernels=GEMV)
        linear(torch.randn(1, 3, 16).half().to(DEV), w, kernels=GEMV)  # three rows: a verify step
        linear(torch.randn(2, 10, 16).half().to(DEV), w, kernels=GEMV)  # 20 rows: more than MAX_ROWS
        linear(torch.randn(1, 16).to(DEV), w.float(), kernels=GEMV)  # float32
        linear(torch.randn(1, 16).half().to(DEV), w)  # a model whose kernels leave it out
    linear(torch.randn(1, 16).half().to(DEV), w, kernels=GEMV)  # autograd on: training
    assert calls == [(1, 1, 16), (1, 16), (1, 3, 16)]


def test_custom_op_traces():
    """The op's fake implementation gives the shape torch.compile plans with (the GPU compiles the MLP
    around it)."""
    w = torch.randn(24, 40).half().to(DEV)
    x = torch.randn(1, 1, 40).half().to(DEV)
    for op in (torch.ops.eaglet.gemv.default, torch.ops.eaglet.gemv_glu.default):
        torch.library.opcheck(op, (x, w, None), test_utils=("test_schema", "test_faketensor"))


@torch.inference_mode()
def test_two_models_with_their_own_kernels_in_one_process(tmp_path, monkeypatch):
    """A tiny SmolLM2-shaped model (one layer) in float16, loaded twice in one process: one running
    the kernel, one F.linear, used in turn (on, off, on). A 4-token prompt, then 2 one-token steps:
    each model's choice holds whatever the other did before it (every projection and the head of
    each step through the kernel, gate-up with SiLU·mul as one, or none), and the logits agree."""
    hf_model("smollm2", num_hidden_layers=1).save_pretrained(tmp_path, safe_serialization=True)
    calls = []
    for name in ("gemv", "glu"):
        monkeypatch.setattr(gemv, name, lambda *a, f=getattr(gemv, name), n=name: calls.append(n) or f(*a))
    models = {k: load_model(tmp_path, dtype="float16", device=DEV, tokenizer=False, kernels=k).model
              for k in (GEMV, EAGER)}
    c = models[GEMV].config
    prompt = torch.randint(3, c.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0)).to(DEV)
    runs = []
    for kernels in (GEMV, EAGER, GEMV):
        model = models[kernels]
        assert model.kernels == kernels
        runs.append(greedy_logits(model, KVCache.for_model(c, 1, 32, torch.float16, DEV), prompt, 3))
        assert calls.count("gemv") == (3 * (3 * c.num_layers + 1) if kernels.gemv else 0)
        assert calls.count("glu") == (3 * c.num_layers if kernels.gemv else 0)
        calls.clear()
    torch.testing.assert_close(runs[0], runs[1], atol=2e-2, rtol=2e-2)
    assert torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("n,k,glu,bias", [(96, 576, False, True), (2100, 40, False, False), (140, 100, True, False),
                                          (49, 9000, False, False)])
def test_the_exact_kernel_gives_a_row_the_same_bits_at_any_row_count(n, k, glu, bias):
    """`gemv.exact` (an exact model's matmul on the GPU): F.linear's values (with glu, SiLU(gate) * up),
    and each row of a 40-row call bitwise the row computed alone or among 3."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).half().to(DEV)
    b = torch.randn(n, generator=g).half().to(DEV) if bias else None
    x = torch.randn(40, k, generator=g).half().to(DEV)
    with torch.no_grad():
        y = gemv.exact(x, w, b, glu=glu)
        alone = torch.cat([gemv.exact(x[i:i + 1], w, b, glu=glu) for i in (0, 17, 39)])
        three = gemv.exact(x[17:20], w, b, glu=glu)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    if glu:
        gate, up = ref.half().float().chunk(2, -1)
        ref = F.silu(gate) * up
    torch.testing.assert_close(y.float(), ref, atol=3e-3, rtol=3e-3)
    assert torch.equal(alone, y[[0, 17, 39]]) and torch.equal(three, y[17:20])


def test_the_exact_norm_gives_a_row_the_same_bits_at_any_row_count():
    """exact.rms_norm: llama.rms_norm's values, a row's bits alike alone, and with a residual the sum
    torch's add makes and the norm of it."""
    from eaglet.models import exact
    from eaglet.models.llama import rms_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 20, 576, generator=g).half().to(DEV)
    w = (1 + 0.1 * torch.randn(576, generator=g)).half().to(DEV)
    y = exact.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y.float(), rms_norm(x.float(), w.float(), 1e-5), atol=4e-3, rtol=4e-3)
    assert torch.equal(exact.rms_norm(x[1, 3:4], w, 1e-5), y[1, 3:4])
    r = torch.randn(2, 20, 576, generator=g).half().to(DEV)
    y, s = exact.rms_norm(x, w, 1e-5, residual=r)
    assert torch.equal(s, x + r) and torch.equal(exact.rms_norm(x + r, w, 1e-5), y)
