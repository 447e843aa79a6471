"""The fused MoE kernels (models/fused_moe.py) against the gathered path and the grouped matmul: routed
experts for 1 to 64 tokens, shared experts as extra pairs, INT4 packs and FP8 blocks read in place; on
the GPU, each token's row bitwise the same whatever else the call holds."""
import pytest
import torch
import torch.nn.functional as F

from eaglet.models.fused_moe import fused_moe
from eaglet.models.moe import gathered, grouped


def routed(n: int, e: int, k: int, h: int, g: torch.Generator):
    """n tokens (n, h), each with k distinct experts of e and their routing weights."""
    x = torch.randn(n, h, generator=g)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    return x, experts, torch.rand(n, k, generator=g)


def assert_reads_in_place(gate_up, down, n, e, k, h, g):
    """The fused kernels on quantized stacks equal the gathered path on the stacks as the loader
    dequantizes them."""
    x, experts, weights = routed(n, e, k, h, g)
    want = gathered(x, experts, weights, gate_up.dequantized(torch.float32), down.dequantized(torch.float32))
    assert (fused_moe(x, experts, weights, gate_up, down) - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.interpreted
@pytest.mark.parametrize("n,variant", [(1, None), (5, None), (20, None), (64, None), (1, "spans"), (20, "spans"),
                                       (1, "pre1"), (1, "pre2"), (20, "pre1")])
@torch.inference_mode()
def test_fused_kernels_equal_the_gathered_path(n, variant):
    """The fused MoE kernels (Triton, in its interpreter here): each expert's run of (token, slot)
    pairs owned by one program, in chunks of 16; the result is the gathered path's for 1 to 64
    tokens, runs longer than a chunk included. With spans (Tiles.gate_span / down_span) a program
    covers fewer columns than its tile (10 and 12 of 16, neither dividing the width), the rest masked;
    with down_pre the down kernel's first one or two steps (of 16 of the 24 columns) use weights read
    before the loop in a one-token call (more tokens: the loop alone)."""
    from eaglet.models.fused_moe import Tiles

    g = torch.Generator().manual_seed(n)
    e, k, h, i = 8, 3, 40, 24
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x, experts, weights = routed(n, e, k, h, g)
    want = gathered(x, experts, weights, gate_up, down)
    tiles = None
    if variant == "spans":
        tiles = Tiles(gate_cols=16, gate_step=16, down_cols=16, down_step=16, gate_span=10, down_span=12)
        assert tiles.spans() == (10, 12) and Tiles().spans() == (Tiles.gate_cols, Tiles.down_cols)
    elif variant:
        tiles = Tiles(gate_cols=16, gate_step=16, down_cols=16, down_step=16, down_pre=int(variant[-1]))
    got = fused_moe(x, experts, weights, gate_up, down, tiles=tiles)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.interpreted
@pytest.mark.parametrize("n,chunks,pre", [(1, 1, 1), (1, 2, 2), (5, 2, 0), (20, 3, 1)])
@torch.inference_mode()
def test_shared_experts_run_inside_the_fused_kernels(n, chunks, pre):
    """Shared experts of `chunks` times an expert's width, run as each token's extra pairs of the
    fused kernels (weight 1, read from the shared expert's own fused gate-up (2S, H) and down (H, S)):
    the routed sum plus the shared MLP, as the gathered path and the MLP give it; the touched count
    is the routed experts' alone. A shared weight passed in a layout other than gate rows then up
    rows, or a chunk read at the wrong columns, changes the result."""
    from eaglet.models.fused_moe import Tiles, foldable

    g = torch.Generator().manual_seed(n + chunks)
    e, k, h, i = 8, 3, 40, 24
    s = chunks * i
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    shared_gate_up, shared_down = torch.randn(2 * s, h, generator=g), torch.randn(h, s, generator=g)
    x, experts, weights = routed(n, e, k, h, g)
    mlp = F.linear(F.silu(F.linear(x, shared_gate_up[:s])) * F.linear(x, shared_gate_up[s:]), shared_down)
    want = gathered(x, experts, weights, gate_up, down) + mlp
    assert foldable(gate_up, shared_gate_up, shared_down)
    assert not foldable(gate_up, shared_gate_up[:, :-1], shared_down[:, :-1])  # no whole number of experts
    counts = (torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long))
    tiles = Tiles(gate_cols=16, gate_step=16, down_cols=16, down_step=16, down_pre=pre)
    got = fused_moe(x, experts, weights, gate_up, down, tiles=tiles, counts=counts, shared=(shared_gate_up, shared_down))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert int(counts[0]) == len(set(experts.flatten().tolist())) and int(counts[1]) == 1
    swapped = torch.cat([shared_gate_up[s:], shared_gate_up[:s]])  # up rows first: another function
    bad = fused_moe(x, experts, weights, gate_up, down, tiles=tiles, shared=(swapped, shared_down))
    assert (bad - want).abs().max() > 1e-2 * want.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_fused_kernels_on_the_gpu_are_row_invariant():
    """On the GPU in bfloat16: the fused kernels agree with the grouped matmul, and each token's row
    is bitwise the same computed alone, among 7 tokens or among 64, with narrower column spans, and
    with the down kernel's first steps read before its wait; so with shared experts run inside them."""
    from eaglet.models.fused_moe import Tiles

    g = torch.Generator(device="cuda").manual_seed(0)
    e, k, h, i = 32, 4, 256, 96
    gate_up = torch.randn(e, 2 * i, h, device="cuda", generator=g).bfloat16() * 0.05
    down = torch.randn(e, h, i, device="cuda", generator=g).bfloat16() * 0.05
    x = torch.randn(64, h, device="cuda", generator=g).bfloat16()
    experts = torch.rand(64, e, device="cuda", generator=g).topk(k, -1).indices
    weights = torch.rand(64, k, device="cuda", generator=g).softmax(-1)
    full = fused_moe(x, experts, weights, gate_up, down)
    want = grouped(x, experts, weights, gate_up, down)
    assert ((full.float() - want.float()).abs().max() / want.float().abs().max()).item() < 0.02
    assert torch.equal(fused_moe(x[:7], experts[:7], weights[:7], gate_up, down), full[:7])
    assert torch.equal(fused_moe(x[5:6], experts[5:6], weights[5:6], gate_up, down), full[5:6])
    spans = Tiles(gate_span=24, down_span=20)  # fewer columns a program than its tile covers: the same bits
    for n in (1, 64):
        assert torch.equal(fused_moe(x[:n], experts[:n], weights[:n], gate_up, down, tiles=spans), full[:n])
    for pre in (0, 1, 2):  # one token (where down_pre acts): the first steps' weights read early, the same bits
        for row in (0, 5):
            got = fused_moe(x[row:row + 1], experts[row:row + 1], weights[row:row + 1], gate_up, down,
                            tiles=Tiles(down_pre=pre))
            assert torch.equal(got, full[row:row + 1]), (pre, row)
    # the shared experts as two extra pairs a token: the routed sum plus the shared MLP, the same bits alone
    shared = (torch.randn(4 * i, h, device="cuda", generator=g).bfloat16() * 0.05,
              torch.randn(h, 2 * i, device="cuda", generator=g).bfloat16() * 0.05)
    both = fused_moe(x, experts, weights, gate_up, down, shared=shared)
    mlp = F.linear(F.silu(F.linear(x.float(), shared[0][:2 * i].float())) * F.linear(x.float(), shared[0][2 * i:].float()),
                   shared[1].float())
    assert ((both.float() - want.float() - mlp).abs().max() / mlp.abs().max()).item() < 0.02
    for rows in (slice(0, 7), slice(5, 6)):
        assert torch.equal(fused_moe(x[rows], experts[rows], weights[rows], gate_up, down, shared=shared), both[rows])


@pytest.mark.interpreted
@pytest.mark.parametrize("n", [1, 20])
@torch.inference_mode()
def test_fused_kernels_read_int4_packs(n):
    """Experts kept as compressed-tensors INT4 packs (eight values a int32, offset 8, a scale per 32
    columns): the fused kernels, unpacking tile by tile, equal the gathered path on the weights as the
    loader dequantizes them."""
    from eaglet.models.fused_moe import Int4

    g = torch.Generator().manual_seed(n)
    e, k, h, i = 8, 3, 64, 32
    stacks = [Int4(torch.randint(-2**31, 2**31 - 1, (e, rows, cols // 8), generator=g, dtype=torch.int32),
                   torch.rand(e, rows, cols // 32, generator=g) * 0.1)
              for rows, cols in ((2 * i, h), (h, i))]
    gate_up, down = stacks
    assert_reads_in_place(gate_up, down, n, e, k, h, g)


@pytest.mark.interpreted
@pytest.mark.parametrize("n", [1, 20])
@torch.inference_mode()
def test_fused_kernels_read_fp8_blocks(n):
    """Experts kept as float8 with a scale per 128 x 128 block (DeepSeek-V3's release format): the
    fused kernels, scaling tile by tile (blocks that cross tiles and end inside a stack included),
    equal the gathered path on the weights as the loader dequantizes them."""
    from eaglet.models.fused_moe import Fp8Block

    g = torch.Generator().manual_seed(n)
    e, k, h, i = 6, 2, 320, 160
    stacks = [Fp8Block(torch.randn(e, rows, cols, generator=g).to(torch.float8_e4m3fn),
                       torch.rand(e, -(-rows // 128), -(-cols // 128), generator=g) * 0.05)
              for rows, cols in ((2 * i, h), (h, i))]
    gate_up, down = stacks
    assert_reads_in_place(gate_up, down, n, e, k, h, g)
