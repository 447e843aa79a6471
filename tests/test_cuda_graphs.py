"""On the GPU: CUDA-graphed decoding gives exactly the tokens of eager decoding (greedy), for plain
decoding and every drafter, batch 1 and a batch of 20. Skipped without a GPU. The model is
SmolLM2-135M-Instruct with its bundled drafter ($EAGLET_TEST_GGUF or the installed default)."""
import json
import os
from pathlib import Path

# cuBLAS may pick workspace-dependent (split-K) kernels, and a graph is captured on another stream
# than eager work runs on: a fixed workspace configuration makes both pick the same kernels. Must
# be set before the first cuBLAS call of the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

from eaglet.config import SpecConfig  # noqa: E402
from eaglet.datasets import load_prompts  # noqa: E402
from eaglet.generate import GenerationConfig, Generator  # noqa: E402
from eaglet.perf.record import environment, path_fingerprint, write_atomic  # noqa: E402
from eaglet.spec.speculator import bundled_drafter, load_speculator  # noqa: E402
from eaglet.weights import load_model  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SETTINGS = {"plain": None, "ngram-chain5": SpecConfig("ngram", steps=5),
            "eagle3-chain5": SpecConfig("eagle3", str(bundled_drafter()), steps=5),
            "eagle3-tree6x8x32": SpecConfig("eagle3", str(bundled_drafter()), steps=6, topk=8, draft_tokens=32)}
GEN = GenerationConfig(max_new_tokens=128, ignore_eos=True)
RESULTS: dict = {}


@pytest.fixture(scope="module")
def smollm2():
    loaded = load_model(os.environ.get("EAGLET_TEST_GGUF"), dtype="bfloat16", device="cuda")
    prompts = [loaded.tokenizer.apply_chat([{"role": "user", "content": p}]) for p in load_prompts("mtbench")[:20]]
    yield loaded.model, loaded.tokenizer, prompts
    if os.environ.get("EAGLET_TEST_RECORD"):  # the environment too, as every record has
        rec = {"kind": "cuda-graphs-test", "environment": environment(),
               "models": {"target": path_fingerprint(loaded.path)}, "results": RESULTS}
        write_atomic(Path(os.environ["EAGLET_TEST_RECORD"]), json.dumps(rec, indent=1))


@pytest.mark.parametrize("name", list(SETTINGS))
@torch.inference_mode()
def test_graphed_equals_eager(smollm2, name):
    model, tok, prompts = smollm2
    spec = SETTINGS[name]
    sp = load_speculator(spec, model, "given") if spec else None
    out = {}
    for mode, graphs in (("eager", False), ("graphed", True)):
        gen = Generator(model, tok, sp, graphs=graphs)
        single = [gen.generate([p], GEN)[0].tokens for p in prompts[:5]]
        batch = [c.tokens for c in gen.generate(prompts, GEN)]
        out[mode] = (single, batch)
        if graphs:  # the graphed run really replayed graphs
            assert gen.decoder_in_use().graphs.captured > 0
    equal = [sum(a == b for a, b in zip(out["graphed"][i], out["eager"][i])) for i in (0, 1)]
    RESULTS[name] = {"new_tokens": GEN.max_new_tokens, "batch1_equal": f"{equal[0]}/5",
                     "batch20_equal": f"{equal[1]}/{len(prompts)}"}
    assert equal == [5, len(prompts)]


@pytest.mark.parametrize("spec", [None, SpecConfig("draft", steps=3), SpecConfig("draft", steps=3, topk=2, draft_tokens=6)],
                         ids=["plain", "draft-chain3", "draft-tree3x2"])
@torch.inference_mode()
def test_seeded_sampling_graphed_equals_eager(tiny_dirs, spec):
    """Sampling inside graphs: a seeded generator is registered with each graph, so graphed and eager
    runs draw the same numbers (tiny random models, no staged model needed)."""
    from eaglet.sampling import SamplingParams
    from eaglet.spec.speculator import Speculator

    target = load_model(tiny_dirs["llama3"][0], dtype="float32", device="cuda", tokenizer=False).model
    draft = load_model(tiny_dirs["qwen3"][0], dtype="float32", device="cuda", tokenizer=False).model
    sp = Speculator(spec, draft_model=draft) if spec else None
    prompts = [[5 + i, 17, 33, 2 * i + 40, 9] for i in range(6)]
    cfg = GenerationConfig(max_new_tokens=48, ignore_eos=True, sampling=SamplingParams(0.9, top_p=0.95, seed=7))
    eager, graphed = eager_and_graphed(target, sp, prompts, cfg)
    assert graphed == eager


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("spec", [None, SpecConfig("draft", steps=3), SpecConfig("draft", steps=3, topk=2, draft_tokens=6)],
                         ids=["plain", "draft-chain3", "draft-tree3x2"])
@torch.inference_mode()
def test_moe_graphed_equals_eager(tiny_dirs, family, spec):
    """MoE targets in bfloat16 (the fused expert kernels for decode and verify, the grouped matmul for
    prefill; MLA for DeepSeek-V3): graphed greedy tokens equal eager ones, plain and speculative."""
    from eaglet.spec.speculator import Speculator

    target = load_model(tiny_dirs[family][0], dtype="bfloat16", device="cuda", tokenizer=False).model
    assert target.kernels.moe
    draft = load_model(tiny_dirs["qwen3"][0], dtype="bfloat16", device="cuda", tokenizer=False).model
    sp = Speculator(spec, draft_model=draft) if spec else None
    prompts = [[5 + i, 17, 33, 2 * i + 40, 9, 11, 60 + i, 3, 21, 8, 90, 4][: 9 + i % 3] for i in range(6)]
    eager, graphed = eager_and_graphed(target, sp, prompts, GenerationConfig(max_new_tokens=48, ignore_eos=True))
    assert graphed == eager


@pytest.mark.parametrize("moe_kernels", [True, False], ids=["moe-kernels", "moe-kernels-off"])
@torch.inference_mode()
def test_moe_in_float16_prefills_long_prompts_graphed(tiny_dirs, moe_kernels):
    """float16, where torch's grouped matmul does not run: a 100-token prompt's prefill goes through the
    MoE kernels 64 tokens at a time (graphed == eager); with those kernels off the model is not
    captured at all, since its many-token path syncs with the host (it used to break the capture)."""
    import dataclasses

    from eaglet.kernels import Kernels
    from eaglet.runtime.graphs import graphable

    kernels = dataclasses.replace(Kernels.choose("cuda"), moe=moe_kernels)
    target = load_model(tiny_dirs["qwen3_moe"][0], dtype="float16", device="cuda", tokenizer=False,
                        kernels=kernels).model
    assert graphable(target) == moe_kernels
    prompts = [[5 + i % 90 for i in range(100)], [7, 8, 9]]
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    out = []
    for graphs in (False, True):
        gen = Generator(target, None, graphs=graphs)
        for _ in range(2):  # a graph key's first call runs eagerly, its second captures: the prefill's too
            out.append([c.tokens for c in gen.generate(prompts, cfg)])
        assert (gen.decoder_in_use().graphs.captured > 0) == (graphs and moe_kernels)
    assert out[1:] == out[:1] * 3


def eager_and_graphed(target, sp, prompts, cfg) -> list[list[list[int]]]:
    """The replies without CUDA graphs and with them (checked to have replayed graphs)."""
    out = []
    for graphs in (False, True):
        gen = Generator(target, None, sp, graphs=graphs)
        out.append([c.tokens for c in gen.generate(prompts, cfg)])
        if graphs:
            assert gen.decoder_in_use().graphs.captured > 0
    return out
