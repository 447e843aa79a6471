"""The random-weight shapes behind `eaglet bench --shape` and the bytes its roofline divides by."""
import dataclasses

import torch

from eaglet.models.llama import CausalLM
from eaglet.perf.shapes import SHAPES, decode_bytes, weight_bytes


def test_roofline_bytes_of_the_8b_shapes():
    """The bytes the roofline divides by, on the meta device: Llama-3.1-8B has 8,030,261,248
    parameters (its model card); a decode step reads all but the input embedding table, plus the KV
    cache; a table tied to the head is read once, as the head."""
    with torch.device("meta"):
        llama = CausalLM(SHAPES["llama-3.1-8b"]).to(torch.bfloat16)
    assert weight_bytes(llama) == 2 * 8_030_261_248
    kv = 2 * 32 * 8 * 128 * 576 * 2
    assert decode_bytes(llama, 576) == 2 * 8_030_261_248 - 2 * 128256 * 4096 + kv
    with torch.device("meta"):
        tied = CausalLM(dataclasses.replace(SHAPES["llama-3.1-8b"], tie_embeddings=True)).to(torch.bfloat16)
    assert weight_bytes(tied) == decode_bytes(tied) == 2 * (8_030_261_248 - 128256 * 4096)
