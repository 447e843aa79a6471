"""Shared fixtures: tiny random models of each Llama-family member, built with transformers (the
reference) and saved as HF directories that eaglet loads through its real loader."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CPU's few-row matmul is timed per host (models/linear.py `cpu_wxt`); the suite runs W @ xᵀ, which
# rounds a row alike at 1 to 64 rows, on every host, and its F.linear tests choose F.linear themselves.
os.environ.setdefault("EAGLET_CPU_MATMUL", "wxt")
if not torch.cuda.is_available():  # Triton kernels run in its interpreter (before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`make test` runs `-n 2`) the workers share the cores: each takes its share of
# threads, as more than one thread per core only makes them wait on each other.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

def pytest_collection_modifyitems(config, items):
    """Tests marked slow first (stable otherwise): two xdist workers then end together, instead of
    one running the long tests at the end while the other has nothing left to take."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if os.environ.get("TRITON_INTERPRET") != "1":  # a GPU machine: CPU tensors cannot reach compiled kernels
        off = pytest.mark.skip(reason="Triton's interpreter is off (the GPU tests cover these kernels)")
        for item in items:
            if item.get_closest_marker("interpreted"):
                item.add_marker(off)


BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5)

# family member -> (transformers config class name, overrides)
FAMILIES = {
    "llama2": ("LlamaConfig", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0)),
    "llama3.1": ("LlamaConfig", dict(rope_theta=500000.0, max_position_embeddings=256, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "smollm2": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=1, rope_theta=100000.0)),
    # routed experts: a dense first layer (mlp_only_layers), top-2 of 8 renormalized; Mixtral top-2 of 4
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, mlp_only_layers=[0])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    # MLA: V2-Lite's direct queries, V3's low-rank ones; a dense first layer, shared experts, expert groups
    "deepseek_v2": ("DeepseekV2Config", dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=24,
                                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                             topk_method="group_limited_greedy", routed_scaling_factor=2.0)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24,
                                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                             routed_scaling_factor=2.5, norm_topk_prob=True)),
}


def hf_model(family: str, seed: int = 0, **overrides):
    """A transformers model of `family` with random weights (biases and norms too), float32, eval."""
    import transformers

    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """family -> (HF directory with config.json + model.safetensors, the transformers model)."""
    out = {}
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(fam.replace(".", "_"))
        m = hf_model(fam)
        m.save_pretrained(d, safe_serialization=True)
        out[fam] = (d, m)
    return out


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (SmolLM2-135M-Instruct, float32 on the CPU), loaded once per worker.
    Its GGUF is converted once into the user's cache (eaglet.weights.gguf_cache, atomic by rename);
    a file lock there makes a second xdist worker wait for the first's conversion and reuse it
    instead of converting the same file again beside it."""
    from filelock import FileLock

    from eaglet import load_model
    from eaglet.weights.gguf_cache import cache_root

    cache_root().mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_root() / "smollm2-tests.lock")):
        return load_model(None, dtype="float32", device="cpu")


def once_per_run(tmp_path_factory, name: str, make):
    """make()'s JSON-able result, computed by the first xdist worker that asks and read back by the
    others (a file under the run's shared temporary directory, behind a file lock); without xdist,
    make() itself."""
    import json

    from filelock import FileLock

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make()
    path = tmp_path_factory.getbasetemp().parent / f"{name}.json"  # the run's directory, above the workers'
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            path.write_text(json.dumps(make()))
        return json.loads(path.read_text())


# A tiny BPE tokenizer trained in-process (offline, ~10 ms): exactly 128 tokens, matching the tiny
# models' vocab_size, with <unk>=0, <s>=1, </s>=2 (LlamaConfig's default bos/eos ids).
TOKENIZER_CORPUS = ["the quick brown fox jumps over the lazy dog",
                    "a stitch in time saves nine, said the old tailor",
                    "pack my box with five dozen liquor jugs!",
                    "how vexingly quick daft zebras jump; the end.",
                    "sphinx of black quartz, judge my vow? yes: 0123456789"]


def make_tiny_tokenizer():
    """A transformers.PreTrainedTokenizerFast over a 128-token Metaspace BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    assert len(hf) == 128 and hf.eos_token_id == 2
    return hf


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tiny HF tokenizer (see make_tiny_tokenizer); wrap it with eaglet.tokenizer.Tokenizer."""
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def one_thread():
    """Ops on tiny tensors gain nothing from threads and lose a lot to a busy CPU: one thread keeps
    such modules fast and their timings comparable."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# the server tests' module fixtures (tests/serving.py builds on the helpers above); the GPU machine
# runs tests/test_cuda_graphs.py without the server's test dependencies (openai)
try:
    from .serving import drafter_dir, model_dir, plain, tiny  # noqa: E402, F401
except ModuleNotFoundError as e:
    if e.name not in ("openai", "uvicorn", "fastapi", "httpx"):
        raise
