"""Generator on tiny random models: greedy decoding against transformers, batching, stopping (budget,
EOS, context), seeded sampling, bad prompts; TextStream's streaming and stop strings."""
import pytest
import torch

from eaglet.errors import InvalidInput
from eaglet.generate import GenerationConfig, Generator
from eaglet.sampling import SamplingParams
from eaglet.tokenizer import TextStream, Tokenizer
from eaglet.weights import load_model

GREEDY = GenerationConfig(max_new_tokens=16, ignore_eos=True)


def load(tiny_dirs, family: str = "llama3"):
    return load_model(tiny_dirs[family][0], dtype="float32", device="cpu", tokenizer=False).model


def rand_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """transformers' model, argmax loop recomputing the whole sequence each step."""
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = ref(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], 1)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def gen(tiny_dirs):
    return Generator(load(tiny_dirs), None)


@pytest.fixture(scope="module")
def text_gen(tiny_dirs, tiny_tokenizer):
    return Generator(load(tiny_dirs), Tokenizer(tiny_tokenizer, eos_ids={2}))


# ---- tokens -------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama3", "mistral"])  # mistral: past its sliding window of 8
def test_greedy_equals_transformers(tiny_dirs, family):
    prompt = rand_prompt(7, 0)
    [c] = Generator(load(tiny_dirs, family), None).generate([prompt], GREEDY)
    assert c.tokens == hf_greedy(tiny_dirs[family][1], prompt, 16)
    assert c.prompt_tokens == 7 and c.finish_reason == "length"


def test_batch_equals_each_prompt_alone(gen):
    prompts = [rand_prompt(n, seed) for seed, n in enumerate([3, 11, 1, 6])]
    batch = gen.generate(prompts, GREEDY)
    for p, c in zip(prompts, batch):
        assert c.tokens == gen.generate([p], GREEDY)[0].tokens


def test_max_new_tokens_gives_length(gen):
    events = list(gen.stream([rand_prompt(5, 1)], GenerationConfig(max_new_tokens=5, ignore_eos=True)))
    assert len(events) == 5
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"]


def test_eos_stops_and_ignore_eos_does_not(tiny_dirs):
    model = load(tiny_dirs)
    prompt = rand_prompt(6, 2)
    free = Generator(model, None).generate([prompt], GREEDY)[0].tokens
    at = next(i for i in range(3, 16) if free[i] not in free[:i])  # first time this token shows up
    model.config = model.config.replace(eos_token_ids=(free[at],))

    [c] = Generator(model, None).generate([prompt], GenerationConfig(max_new_tokens=16))
    assert c.tokens == free[: at + 1] and c.finish_reason == "stop"
    [c] = Generator(model, None).generate([prompt], GREEDY)
    assert c.tokens == free and c.finish_reason == "length"


def test_eos_stops_only_its_own_row(tiny_dirs):
    model = load(tiny_dirs)
    prompts = [rand_prompt(6, 2), rand_prompt(4, 3)]
    free = [c.tokens for c in Generator(model, None).generate(prompts, GREEDY)]
    eos = next(t for t in free[0][2:] if t not in free[1])
    model.config = model.config.replace(eos_token_ids=(eos,))
    a, b = Generator(model, None).generate(prompts, GenerationConfig(max_new_tokens=16))
    assert a.finish_reason == "stop" and a.tokens[-1] == eos and len(a.tokens) < 16
    assert b.finish_reason == "length" and b.tokens == free[1]


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_tokens_only_equals_generation_with_text(tiny_dirs, tiny_tokenizer, spec):
    """generate(text=False), the path of data regeneration and eval-draft: the same tokens, finish
    reasons and speculation counters as with text, rows stopping at EOS at different steps, or at the
    budget; no text, and no events or stop strings asked of it."""
    from eaglet.config import SpecConfig
    from eaglet.spec.speculator import Speculator

    model = load(tiny_dirs)
    prompts = [rand_prompt(n, seed) for seed, n in enumerate([6, 4, 9, 3, 5])]
    free = [c.tokens for c in Generator(model, None).generate(prompts, GREEDY)]
    eos = next(t for t in free[0][2:] if sum(t in f for f in free) in (2, 3))  # ends some rows, not all
    model.config = model.config.replace(eos_token_ids=(eos,))
    make = lambda: Generator(model, Tokenizer(tiny_tokenizer, eos_ids={2}),  # noqa: E731
                             Speculator(SpecConfig("ngram", steps=3)) if spec else None)
    cfg = GenerationConfig(max_new_tokens=16)
    want, got = make().generate(prompts, cfg), make().generate(prompts, cfg, text=False)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert {"stop", "length"} <= {c.finish_reason for c in got}
    assert all(c.text == "" for c in got) and any(c.text for c in want)
    if spec:
        assert [c.spec.to_dict() for c in got] == [c.spec.to_dict() for c in want]
    with pytest.raises(InvalidInput, match="stop strings"):
        make().generate(prompts, GenerationConfig(max_new_tokens=4, stop=("x",)), text=False)


def sampled(gen, seed: int) -> list[int]:
    cfg = GenerationConfig(max_new_tokens=16, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=seed))
    return gen.generate([rand_prompt(4, 3)], cfg)[0].tokens


def test_seeded_sampling_repeats_and_seeds_differ(gen):
    assert sampled(gen, 0) == sampled(gen, 0)
    assert sampled(gen, 0) != sampled(gen, 1)


# ---- the context and bad prompts ----------------------------------------------------------------

def test_prompt_filling_the_context_raises(gen):
    with pytest.raises(InvalidInput, match="context"):
        gen.generate([rand_prompt(gen.context, 4)], GREEDY)


def test_prompt_one_short_of_context_gets_one_token(gen):
    [c] = gen.generate([rand_prompt(gen.context - 1, 5)], GREEDY)
    assert len(c.tokens) == 1 and c.finish_reason == "length"


def test_batch_with_context_clipped_row(gen):
    """A row whose budget the context clips finishes early; the batch keeps stepping it, which must
    not run past the cache (it did: IndexError) nor change the other rows."""
    long, short = rand_prompt(gen.context - 2, 6), rand_prompt(3, 7)
    a, b = gen.generate([long, short], GREEDY)
    assert len(a.tokens) == 2 and a.finish_reason == "length"
    assert b.tokens == gen.generate([short], GREEDY)[0].tokens and len(b.tokens) == 16


@pytest.mark.parametrize("prompts", [[[]], [[5, 6], []], []])
def test_empty_prompt_raises(gen, prompts):
    with pytest.raises(InvalidInput, match="empty"):
        gen.generate(prompts, GREEDY)


def test_max_new_tokens_must_be_positive():
    with pytest.raises(InvalidInput):
        GenerationConfig(max_new_tokens=0)


# ---- text ---------------------------------------------------------------------------------------

def test_streamed_deltas_concatenate_to_final_text(text_gen):
    tok = text_gen.tokenizer
    events = []
    [c] = text_gen.generate([tok.encode("the quick brown")], GenerationConfig(max_new_tokens=24, ignore_eos=True),
                            on_event=events.append)
    assert len(c.text) > 10
    assert "".join(e.text for e in events) == c.text == tok.decode(c.tokens)


def test_stop_string_stops_generation_and_is_excluded(text_gen):
    tok = text_gen.tokenizer
    prompt = tok.encode("the quick brown")
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    [free] = text_gen.generate([prompt], cfg)
    m = next(m for m in range(len(free.text) // 3, len(free.text) - 3)
             if free.text.find(free.text[m:m + 3]) == m)  # a 3-char stop first seen at m
    stop = free.text[m:m + 3]

    events = []
    [c] = text_gen.generate([prompt], GenerationConfig(max_new_tokens=24, ignore_eos=True, stop=("zzz", stop)),
                            on_event=events.append)
    assert c.text == free.text[:m] and stop not in c.text
    assert c.finish_reason == "stop" and len(c.tokens) < len(free.tokens)
    assert c.tokens == free.tokens[: len(c.tokens)]
    assert stop in tok.decode(c.tokens) and stop not in tok.decode(c.tokens[:-1])  # stopped at once
    assert "".join(e.text for e in events) == c.text


def test_text_held_for_a_stop_string_is_released_at_the_end(text_gen):
    """The text ends with the start of a stop string that never completes: the final event carries it."""
    prompt = text_gen.tokenizer.encode("the quick brown")
    [free] = text_gen.generate([prompt], GenerationConfig(max_new_tokens=24, ignore_eos=True))
    stop = free.text[-3:] + "QQ"  # never generated: the vocab has no capitals
    events = []
    [c] = text_gen.generate([prompt], GenerationConfig(max_new_tokens=24, ignore_eos=True, stop=(stop,)),
                            on_event=events.append)
    assert c.text == free.text and c.finish_reason == "length"
    assert events[-1].text.endswith(free.text[-3:])
    assert "".join(e.text for e in events) == free.text


def push_all(stream: TextStream, tok: Tokenizer, text: str) -> list[tuple[str, str, str]]:
    """Push `text`'s tokens one by one; per token: (decoded so far, delta, stream.text)."""
    ids, out = tok.encode(text), []
    for i, t in enumerate(ids):
        delta = stream.push(t)
        out.append((tok.decode(ids[: i + 1]), delta, stream.text))
    return out


@pytest.fixture
def tok(tiny_tokenizer):
    return Tokenizer(tiny_tokenizer, eos_ids={2})


def test_possible_stop_prefix_is_held_then_released(tok):
    stream = TextStream(tok, stop=("brown cow",))
    steps = push_all(stream, tok, "the quick brown fox")
    held = [(full, text) for full, _, text in steps if full == "the quick brown"]
    assert held == [("the quick brown", "the quick ")]  # "brown" could begin "brown cow"
    assert steps[-1][2] == "the quick brown fox" and not stream.stopped  # "brown f" is not
    assert stream.flush() == ""
    assert "".join(d for _, d, _ in steps) == "the quick brown fox"


def test_flush_releases_held_tail(tok):
    stream = TextStream(tok, stop=("fox jumps",))
    steps = push_all(stream, tok, "the quick brown fox")
    assert steps[-1][2] == "the quick brown "
    assert stream.flush() == "fox" and stream.text == "the quick brown fox"


@pytest.mark.parametrize("stop, want", [("brown fox", "the quick "), ("ick", "the qu"),
                                        ("o", "the quick br")])
def test_stop_string_across_or_inside_tokens(tok, stop, want):
    stream = TextStream(tok, stop=(stop,))
    steps = push_all(stream, tok, "the quick brown fox jumps")
    first = next(i for i, (full, _, _) in enumerate(steps) if stop in full)
    assert stream.stopped and stream.text == want
    assert "".join(d for _, d, _ in steps) == want
    assert all(d == "" for _, d, _ in steps[first + 1:])
    assert stream.flush() == ""


def test_push_many_is_push_of_each(tok):
    """SeqState.push_many of a step's tokens (one decode of the window): the text and count of
    push_each (push of each until the sequence finishes), with EOS inside the step and the budget
    ending mid-step."""
    from eaglet.generate import SeqState

    ids = tok.encode("the quick brown fox jumps over the lazy dog")
    for eos_at in (None, 5):
        toks = ids[:eos_at] + [2] + ids[eos_at:] if eos_at else ids
        for budget in (4, len(toks) + 2):
            for size in (1, 2, 3, 5):
                one, many = SeqState(tok, (), frozenset({2}), budget), SeqState(tok, (), frozenset({2}), budget)
                for i in range(0, len(toks), size):
                    assert many.push_many(toks[i:i + size]) == one.push_each(toks[i:i + size])
                    assert (many.count, many.finish_reason) == (one.count, one.finish_reason)
                assert many.stream.text == one.stream.text
                assert many.finish_reason == ("length" if budget == 4 else "stop" if eos_at else None)
                bare = SeqState(None, (), frozenset({2}), budget)  # tokens only: the same counts, no text
                assert [bare.push_many(toks[i:i + size]) for i in range(0, len(toks), size)][-1][0] == ""
                assert (bare.count, bare.finish_reason) == (many.count, many.finish_reason)


def test_push_many_ends_at_a_stop_string_inside_the_step(tok):
    """A stop string completed by the second of a step's three tokens: the text ends before it, the
    sequence stops, and the third token does not count."""
    from eaglet.generate import SeqState

    ids = tok.encode("the quick brown fox jumps")
    end = next(i for i in range(len(ids)) if "own f" in tok.decode(ids[:i + 1]))  # the token completing it
    seq = SeqState(tok, ("own f",), frozenset({2}), 100)
    text, n = seq.push_many(ids[:end - 1])
    more, m = seq.push_many(ids[end - 1:end + 2])
    assert text + more == "the quick br" and seq.stream.text == "the quick br"
    assert seq.finish_reason == "stop" and n + m == end + 1 == seq.count
