"""Tensor parallelism (eaglet/dist/tp.py) on CPUs with gloo: each rank holds a slice of every
layer's heads (MLA's too) and MLP or expert width, and the ranks' logits equal the whole model's."""
import pytest
import torch

from eaglet.dist.tp import TP, check, kv_heads, local_config
from eaglet.dist.workers import run
from eaglet.errors import InvalidInput


def tp_logits(tp: TP, path: str) -> torch.Tensor:
    """A prefill of 7 tokens and two decode steps on this rank's slice of the model at `path`."""
    from eaglet.kvcache import KVCache
    from eaglet.weights import load_model

    from tests.test_model_parity import eaglet_step

    model = load_model(path, dtype="float32", device="cpu", tokenizer=False, tp=tp).model
    cache = KVCache.for_model(model.config, 2, 32, torch.float32, "cpu")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return torch.cat([eaglet_step(model, cache, ids[:, :7]), eaglet_step(model, cache, ids[:, 7:8]),
                          eaglet_step(model, cache, ids[:, 8:9])], 1)


@pytest.mark.parametrize("family, world", [("llama3", 2), ("llama3", 4), ("qwen3", 2), ("qwen3_moe", 2),
                                           ("mixtral", 2), ("deepseek_v3", 2)])
def test_tensor_parallel_logits_equal_the_whole_model(tiny_dirs, family, world):
    path = str(tiny_dirs[family][0])
    want = tp_logits(TP(0, 1), path)
    got = run(tp_logits, world, "cpu", (path,))
    for rank, logits in enumerate(got):
        assert (logits - want).abs().max() <= 1e-5 * want.abs().max(), rank


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
    assert main(argv + ["--tp", "2"]) == 1  # 9 heads do not split two ways: the worker's error, once
    err = capfd.readouterr().err
    assert err.count("do not split 2 ways") == 1
