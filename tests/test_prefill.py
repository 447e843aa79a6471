"""Prefill into free rows (models/prefill.py), the graph's contract checked on the CPU: prompts
admitted together into any rows, padded to a bucket, leave every row exactly as a prefill of that
prompt alone would (target cache, first token, drafter state), and a row that is not free is
refused."""
import pytest
import torch

from eaglet import load_model
from eaglet.config import SpecConfig
from eaglet.models.prefill import prompt_bucket
from eaglet.runtime.decoder import Decoder
from eaglet.spec.loop import spec_decoder
from eaglet.spec.speculator import Speculator

from .test_spec_greedy import random_head


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["mistral"][0], dtype="float32", device="cpu", tokenizer=False).model


PROMPTS = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 11)]


def test_prompt_bucket():
    assert [prompt_bucket(n, 1000) for n in (1, 16, 17, 32, 33, 200)] == [16, 16, 32, 32, 64, 256]
    assert prompt_bucket(300, 320) == 320  # never past the cache


def decoders(target, name):
    if name == "plain":
        return lambda batch: Decoder(target, batch, 64, graphs=False)
    kind = "draft" if name == "draft" else "eagle3"
    sp = Speculator(SpecConfig(kind, steps=3), draft_model=target) if kind == "draft" else \
        Speculator(SpecConfig(kind, steps=3), head=random_head(target.config))
    return lambda batch: spec_decoder(target, sp.make(target, batch, 64), sp.spec, batch, 64,
                                      graphs=False)


def row_state(dec, row: int, n: int):
    """What a row holds after admission: target K/V of its n prompt tokens, lengths, and for a
    speculative decoder the drafter's cache, root state and length."""
    c = dec.cache
    out = [c.kv[:, :, row, :, :n], c.lens[row], int(c.host_lens[row]), dec.slots.last[row]]
    if dec.current is dec.plain:
        return out
    d = dec.current.drafter
    m = int(d.cache.host_lens[row])
    return out + [d.cache.kv[:, :, row, :, :m], d.cache.lens[row], m, d.root_h[row]]


@pytest.mark.parametrize("name", ["plain", "eagle3", "draft"])
def test_rows_together_equal_alone(target, name):
    make = decoders(target, name)
    together = make(4)
    rows = [3, 0, 2]  # not adjacent, not in order; padded to the longest prompt's bucket (32)
    first = together.admit(rows, PROMPTS)
    for row, p, f in zip(rows, PROMPTS, first):
        alone = make(1)
        assert alone.admit([0], [p]) == [f]
        for a, b in zip(row_state(together, row, len(p)), row_state(alone, 0, len(p))):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                assert a == b
    assert together.cache.host_lens[1] == 0 and together.cache.lens[1] == 0  # the row left out is untouched
    with pytest.raises(RuntimeError, match="not free"):
        together.admit([2], [PROMPTS[0]])
