"""Tensor parallelism (eaglet/dist/tp.py) on CPUs with gloo: each rank holds a slice of every
layer's heads (MLA's too) and MLP or expert width, or its share of the routed experts whole (expert
parallelism), and the ranks' logits equal the whole model's."""
import dataclasses

import pytest
import torch

from eaglet.dist.tp import TP, check, kv_heads, local_config, shard_pairs
from eaglet.dist.workers import run
from eaglet.errors import InvalidInput


def tp_logits(tp: TP, path: str, moe: str = "tp", fused: bool = False) -> tuple[torch.Tensor, list[int]]:
    """A prefill of 7 tokens and two decode steps on this rank's slice of the model at `path`, its MoE
    layers split as `moe` says (`fused`: through the fused MoE kernels): the logits, and each MoE
    layer's count of the distinct experts it touched."""
    from eaglet.kernels import EAGER
    from eaglet.kvcache import KVCache
    from eaglet.models.moe import SparseMoE
    from eaglet.weights import load_model

    from tests.test_model_parity import eaglet_step

    model = load_model(path, dtype="float32", device="cpu", tokenizer=False, tp=dataclasses.replace(tp, moe=moe),
                       kernels=dataclasses.replace(EAGER, moe=fused)).model
    cache = KVCache.for_model(model.config, 2, 32, torch.float32, "cpu")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = torch.cat([eaglet_step(model, cache, ids[:, :7]), eaglet_step(model, cache, ids[:, 7:8]),
                            eaglet_step(model, cache, ids[:, 8:9])], 1)
    return logits, [int(m.touched) for m in model.modules() if isinstance(m, SparseMoE)]


@pytest.mark.parametrize("family, world", [("llama3", 2), ("llama3", 4), ("qwen3", 2), ("qwen3_moe", 2),
                                           ("qwen3_moe", 4), ("mixtral", 2), ("deepseek_v3", 2), ("deepseek_v3", 4)])
def test_tensor_parallel_logits_equal_the_whole_model(tiny_dirs, family, world):
    path = str(tiny_dirs[family][0])
    want, _ = tp_logits(TP(0, 1), path)
    got = run(tp_logits, world, "cpu", (path,))
    for rank, (logits, _) in enumerate(got):
        assert (logits - want).abs().max() <= 1e-5 * want.abs().max(), rank


@pytest.mark.parametrize("family, world, fused", [("qwen3_moe", 2, False), ("qwen3_moe", 4, False),
                                                  ("mixtral", 2, False), ("deepseek_v3", 2, False),
                                                  ("deepseek_v3", 4, False),
                                                  pytest.param("qwen3_moe", 2, True, marks=pytest.mark.slow)])
def test_expert_parallel_logits_equal_the_whole_model(tiny_dirs, family, world, fused):
    """--moe-parallel ep at TP 2 and 4 (8, 4 and 8 routed experts: 4 or 2, 2, and 4 or 2 whole experts
    a rank), through the gathered and grouped paths (or the routing and fused kernels, in Triton's
    interpreter): every rank's logits equal the whole model's, and since each rank counts only the
    experts it holds, the ranks' distinct-expert counts add up to the whole model's, layer by layer."""
    path = str(tiny_dirs[family][0])
    want, touched = tp_logits(TP(0, 1), path)
    got = run(tp_logits, world, "cpu", (path, "ep", fused))
    for rank, (logits, _) in enumerate(got):
        assert (logits - want).abs().max() <= 1e-5 * want.abs().max(), rank
    assert [sum(ns) for ns in zip(*(counts for _, counts in got))] == touched
    assert all(n < t for _, counts in got for n, t in zip(counts, touched))  # each rank a share


def test_kv_heads_split_or_replicate_and_bad_splits_are_refused(tiny_dirs):
    from eaglet.config import ModelConfig

    c = ModelConfig.from_file(tiny_dirs["llama3"][0] / "config.json")
    assert (c.num_heads, c.num_kv_heads) == (4, 2)
    assert [kv_heads(c, TP(r, 2)) for r in range(2)] == [(0, 1), (1, 1)]
    assert [kv_heads(c, TP(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert local_config(c, TP(1, 4)).num_heads == 1
    with pytest.raises(InvalidInput, match="attention heads"):
        check(c, 3)
    moe = ModelConfig.from_file(tiny_dirs["qwen3_moe"][0] / "config.json")
    assert local_config(moe, TP(0, 2)).moe.expert_size == moe.moe.expert_size // 2
    with pytest.raises(InvalidInput, match="expert width"):
        check(moe.replace(moe=moe.moe.__class__(**{**moe.moe.__dict__, "expert_size": 33})), 2)


def test_expert_parallel_slices_and_bad_splits_are_refused(tiny_dirs):
    """Under EP rank 1 of 2 keeps experts 4 to 7 of 8 whole, renumbered 0 to 3; the shared experts,
    the dense MLP and the heads are split by width as under TP, the router whole. A count of experts
    that does not split is refused, naming it."""
    from eaglet.config import ModelConfig

    c = ModelConfig.from_file(tiny_dirs["deepseek_v3"][0] / "config.json")
    m, h, i = c.moe, c.hidden_size, c.moe.expert_size
    assert (m.num_experts, m.shared_experts, m.local_experts) == (8, 1, None)
    local = local_config(c, TP(1, 2, "ep"))
    assert (local.moe.local_experts, local.moe.expert_size, local.moe.shared_width) == ((4, 4), i, i // 2)
    assert (local.num_heads, local.intermediate_size) == (c.num_heads // 2, c.intermediate_size // 2)
    assert local_config(c, TP(1, 2)).moe.local_experts is None  # the default: each expert by width

    g = torch.Generator().manual_seed(0)
    layer = "model.layers.1.mlp."
    pairs = {layer + "experts.5.gate_proj.weight": torch.randn(i, h, generator=g),
             layer + "experts.7.down_proj.weight": torch.randn(h, i, generator=g),
             layer + "experts.2.up_proj.weight": torch.randn(i, h, generator=g),
             layer + "shared_experts.up_proj.weight": torch.randn(i, h, generator=g),
             layer + "shared_experts.down_proj.weight": torch.randn(h, i, generator=g),
             layer + "gate.weight": torch.randn(8, h, generator=g),
             "model.layers.0.mlp.gate_proj.weight": torch.randn(c.intermediate_size, h, generator=g)}
    got = dict(shard_pairs(pairs.items(), c, TP(1, 2, "ep")))
    assert set(got) == {layer + "experts.1.gate_proj.weight", layer + "experts.3.down_proj.weight",
                        layer + "shared_experts.up_proj.weight", layer + "shared_experts.down_proj.weight",
                        layer + "gate.weight", "model.layers.0.mlp.gate_proj.weight"}  # expert 2: rank 0's
    assert torch.equal(got[layer + "experts.1.gate_proj.weight"], pairs[layer + "experts.5.gate_proj.weight"])
    assert torch.equal(got[layer + "experts.3.down_proj.weight"], pairs[layer + "experts.7.down_proj.weight"])
    assert torch.equal(got[layer + "shared_experts.up_proj.weight"],
                       pairs[layer + "shared_experts.up_proj.weight"][i // 2:])
    assert torch.equal(got[layer + "shared_experts.down_proj.weight"],
                       pairs[layer + "shared_experts.down_proj.weight"][:, i // 2:])
    assert torch.equal(got[layer + "gate.weight"], pairs[layer + "gate.weight"])
    assert got["model.layers.0.mlp.gate_proj.weight"].shape == (c.intermediate_size // 2, h)
    mixtral = ModelConfig.from_file(tiny_dirs["mixtral"][0] / "config.json")  # 4 experts, w1 / w3 / w2
    w1 = torch.randn(mixtral.moe.expert_size, mixtral.hidden_size, generator=g)
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(4)]
    assert [[(n, t.shape) for n, t in shard_pairs([(name, w1) for name in names], mixtral, TP(r, 2, "ep"))]
            for r in range(2)] == [[(n, w1.shape) for n in names[:2]]] * 2

    six = c.replace(moe=dataclasses.replace(m, num_experts=6, n_group=1))
    check(six, 2, "ep")
    with pytest.raises(InvalidInput, match="6 routed experts do not split 4 ways"):
        check(six, 4, "ep")
    check(six, 4)  # by width: 32 columns an expert split four ways
    with pytest.raises(InvalidInput, match="--moe-parallel"):
        TP(0, 2, "dp")


def vocab_parallel(tp: TP, table: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor):
    """This rank's rows of `table` as the loader cuts them: the lookup of `ids`, the logits of
    `hidden`, the gathered whole table and the rows held."""
    from eaglet.dist import vocab

    first, n = vocab.rows(len(table), tp.rank, tp.world)
    mine = vocab.slice_rows(table, first, n)
    return (vocab.lookup(mine, ids, first), vocab.gather(hidden @ mine.T, len(table)),
            vocab.whole_table(mine, len(table)), n)


def test_vocabulary_parallel_lookup_and_logits_equal_the_whole_tables(tiny_dirs):
    from eaglet.config import ModelConfig

    """128 rows over 3 ranks (43 a rank, the last padded with one zero row): each rank holds its
    third, and the lookup, the logits over all 128 ids and the gathered table are the whole
    table's, bitwise."""
    g = torch.Generator().manual_seed(0)
    table, hidden = torch.randn(128, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    ids = torch.tensor([[0, 42, 43, 85, 86, 127, 5]])
    for rank, (rows, logits, whole, n) in enumerate(run(vocab_parallel, 3, "cpu", (table, ids, hidden))):
        assert n == 43, rank
        assert torch.equal(rows, table[ids]) and torch.equal(whole, table), rank
        assert logits.shape == (2, 5, 128) and torch.allclose(logits, hidden @ table.T, atol=1e-6), rank
    # the loader's rows by name: the tables split, nothing else
    c = ModelConfig.from_file(tiny_dirs["llama3"][0] / "config.json")
    got = dict(shard_pairs([("lm_head.weight", table), ("model.embed_tokens.weight", table),
                            ("model.norm.weight", table[0])], c, TP(1, 2)))
    assert torch.equal(got["lm_head.weight"], table[64:]) and torch.equal(got["model.embed_tokens.weight"],
                                                                            table[64:])
    assert torch.equal(got["model.norm.weight"], table[0])
    assert local_config(c, TP(1, 2)).vocab_slice == (64, 64)


def shard_of(args) -> TP:
    from eaglet.dist.launch import shard

    return shard(args)


def test_launched_commands_get_the_moe_split_of_their_flags():
    """`--tp 2 --moe-parallel ep` (dist/launch.py's flags): each worker's command loads its slice
    with the experts whole."""
    import argparse

    from eaglet.dist.launch import add_tp_args, command_rank

    parser = argparse.ArgumentParser()
    add_tp_args(parser)
    parser.add_argument("--device")
    args = parser.parse_args(["--tp", "2", "--moe-parallel", "ep", "--device", "cpu"])
    assert run(command_rank, args.tp, "cpu", (shard_of, args)) == [TP(0, 2, "ep"), TP(1, 2, "ep")]


def tp_generate(tp: TP, path: str, head_dir: str) -> dict[str, list[list[int]]]:
    """Greedy replies of this rank's slice of the model at `path`, plain and speculating: n-gram, the
    model itself as a whole (unsharded) draft model (every draft accepted), and a random EAGLE-3
    tree head; every rank runs the same loop."""
    from pathlib import Path

    from eaglet.config import SpecConfig
    from eaglet.generate import GenerationConfig, Generator
    from eaglet.spec.speculator import load_speculator
    from eaglet.weights import load_model

    model = load_model(path, dtype="float32", device="cpu", tokenizer=False, tp=tp).model
    prompts = [[5 + i, 17, 33, 2 * i + 40, 9, 5 + i, 17] for i in range(3)]
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    settings = {"plain": None, "ngram": SpecConfig("ngram", steps=3), "draft": SpecConfig("draft", path, steps=3),
                "eagle3-chain": SpecConfig("eagle3", head_dir, steps=3),
                "eagle3-tree": SpecConfig("eagle3", head_dir, steps=3, topk=2, draft_tokens=6)}
    out = {}
    with torch.inference_mode():
        for name, spec in settings.items():
            sp = load_speculator(spec, model, Path(path)) if spec else None
            out[name] = [c.tokens for c in Generator(model, None, sp).generate(prompts, cfg)]
    return out


def test_speculative_greedy_equals_plain_under_tensor_parallelism(tiny_dirs, tmp_path):
    from eaglet.spec.drafters.eagle3_ckpt import save_eagle3
    from eaglet.weights import load_model

    from .test_spec_greedy import random_head

    path = str(tiny_dirs["llama3"][0])
    whole = load_model(path, dtype="float32", device="cpu", tokenizer=False).model
    save_eagle3(random_head(whole.config), tmp_path / "head", dtype=torch.float32)
    want = tp_generate(TP(0, 1), path, str(tmp_path / "head"))["plain"]
    for rank, got in enumerate(run(tp_generate, 2, "cpu", (path, str(tmp_path / "head")))):
        for name, replies in got.items():
            assert replies == want, (rank, name)


def test_generate_with_tensor_parallel_workers(capfd):
    """`eaglet generate --tp 3` (SmolLM2's 9 heads, 3 KV heads: three ranks; gloo workers on the CPU)
    prints what one process prints, once: rank 0 speaks, the others follow; bad flags fail before
    any worker starts."""
    from eaglet.cli import main

    argv = ["generate", "The capital of France is", "--device", "cpu", "--max-new-tokens", "5", "--spec", "ngram"]
    assert main(argv) == 0
    one = capfd.readouterr().out
    assert main(argv + ["--tp", "3"]) == 0
    assert capfd.readouterr().out == one
    # the bundled EAGLE-3 drafter embeds its draft vocabulary through rows of the target's split
    # table: the same text (lossless either way) and the same accept length (the same drafts)
    import re

    eagle = argv[:-1] + ["eagle3", "--max-new-tokens", "12"]
    outs = []
    for tp in ("1", "3"):
        assert main(eagle + ["--tp", tp]) == 0
        got = capfd.readouterr()
        outs.append((got.out, re.search(r"eagle3 accept length ([\d.]+)", got.err)[1]))
    assert outs[0] == outs[1]
    assert main(argv + ["--tp", "2"]) == 1  # 9 heads do not split two ways: the worker's error, once
    err = capfd.readouterr().err
    assert err.count("do not split 2 ways") == 1


def tp_shape_bench(tp: TP, config, out: str, moe: str) -> dict:
    """`eaglet bench --shape` on this rank (its slice of random weights of `config`, registered as
    the shape "tiny-tp": spawned workers do not see the test's registry)."""
    from eaglet.cli import build_parser
    from eaglet.perf import shapes
    from eaglet.perf.bench_shape import run_shape_bench

    shapes.SHAPES["tiny-tp"] = config
    args = build_parser().parse_args(["bench", "--shape", "tiny-tp", "--device", "cpu", "--dtype", "float32",
                                      "--context", "16", "--max-new-tokens", "6", "--repeats", "1",
                                      "--tree", "2,2,4", "--out", out])
    args.shard = dataclasses.replace(tp, moe=moe)
    bench = run_shape_bench(args)
    with torch.device("meta"):
        model = shapes.CausalLM(local_config(config, args.shard) if tp.world > 1 else config)
    return bench, shapes.decode_bytes(model, 16)


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_shape_bench_under_tensor_parallelism(tmp_path, moe):
    """`bench --shape --tp 2` (random weights at a shape's sizes, dist/launch.py's workers): every
    rank builds its slice of a Qwen3-MoE-like shape, the ranks decode and speculate in step (the
    same tokens on both: what both hold whole is drawn alike), a rank's roofline bytes are about
    half the model's, and rank 0 alone writes the record, without a transformers baseline."""
    from eaglet.perf.shapes import SHAPES

    q = SHAPES["qwen3-30b-a3b"]
    tiny = dataclasses.replace(q, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
                               head_dim=16, vocab_size=256, moe=dataclasses.replace(q.moe, num_experts=16,
                                                                                      expert_size=16, top_k=2))
    (one, whole), = run(tp_shape_bench, 1, "cpu", (tiny, str(tmp_path / "1"), moe))
    two = run(tp_shape_bench, 2, "cpu", (tiny, str(tmp_path / "2"), moe))
    assert "transformers" in one["decode"] and "transformers" not in two[0][0]["decode"]
    for name, s in two[0][0]["speculation"].items():
        assert s["equals_plain"] and s["accept_length"] == two[1][0]["speculation"][name]["accept_length"], name
    assert [b for _, b in two] == [two[0][1]] * 2 and 0.4 * whole < two[0][1] < 0.6 * whole
    assert len(list((tmp_path / "2").glob("bench-shape-tiny-tp-*.json"))) == 1
