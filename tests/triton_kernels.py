"""What the Triton kernel tests share: the device they run on (the GPU, or the CPU through Triton's
interpreter, which conftest turns on without a GPU), skipping a module where neither can run, and
the kernels a model runs with one of them on."""
import os

import pytest
import torch

from eaglet.kernels import Kernels


def triton_device() -> str:
    """Call at module level: 'cuda' or 'cpu', or skip the module."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 (set by conftest)", allow_module_level=True)
    return dev


CACHE_ATTENTION = Kernels(cache_attention=True)
GEMV = Kernels(gemv=True)
TOPK = Kernels(topk=True)


def greedy_logits(model, cache, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Feed `prompt` (B, T) into `cache`, then `steps - 1` greedy one-token steps: (steps, B, V) float
    logits of each forward's last token."""
    from eaglet.models.attention import AttnMeta

    ids, logits = prompt, []
    for _ in range(steps):
        t = ids.shape[1]
        pos = cache.lens[:, None] + torch.arange(t, device=ids.device)
        h, _ = model(ids, pos, cache, AttnMeta.build(cache.lens, pos, cache.kv_len(t), kernels=model.kernels))
        cache.advance(t)
        logits.append(model.logits(h[:, -1]).float())
        ids = logits[-1].argmax(-1, keepdim=True)
    return torch.stack(logits)


def tree_mask(b, t, gen):
    """Random trees: each node's parent is an earlier node; a node sees itself and its ancestors."""
    m = torch.zeros(b, t, t, dtype=torch.bool)
    for i in range(b):
        for u in range(t):
            m[i, u, u] = True
            if u:
                m[i, u] |= m[i, int(torch.randint(0, u, (1,), generator=gen))]
    return m


def decode_then_tree(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On a fresh 2-row cache: a 2 x 9 prompt, 12 one-token greedy steps, then a random 5-node tree
    block (not committed). Returns each forward's last logits (13, 2, V), the tree's logits and the
    cache entries the forwards wrote."""
    from eaglet.kvcache import KVCache
    from eaglet.models.attention import AttnMeta

    c, dev = model.config, next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, c.vocab_size, (2, 9), generator=gen).to(dev)
    tree_ids = torch.randint(3, c.vocab_size, (2, 5), generator=gen).to(dev)
    tree = tree_mask(2, 5, gen).to(dev)
    cache = KVCache.for_model(c, 2, 64, torch.float16, dev)
    logits = greedy_logits(model, cache, prompt, 13)
    pos = cache.lens[:, None] + tree.sum(-1) - 1  # each node's depth below the first
    h, _ = model(tree_ids, pos, cache, AttnMeta.build(cache.lens, pos, cache.kv_len(5), tree_mask=tree,
                                                      kernels=model.kernels))
    return logits, model.logits(h).float(), cache.kv[..., :cache.host_lens.max() + 5, :].clone()


def kernel_matches_general_path(path, module, name: str) -> None:
    """The model in `path` (float16) with the cache-attention kernels and without: decode_then_tree
    gives the same logits and cache entries, and `module.name` (the kernel's entry) is called once a
    layer a forward with them and never without."""
    from eaglet.kernels import EAGER
    from eaglet.weights import load_model

    dev = triton_device()
    runs = []
    for kernels in (CACHE_ATTENTION, EAGER):
        model = load_model(path, dtype="float16", device=dev, tokenizer=False, kernels=kernels).model
        calls = []
        inner = getattr(module, name)
        setattr(module, name, lambda *a, **k: calls.append(1) or inner(*a, **k))
        try:
            runs.append(decode_then_tree(model))
        finally:
            setattr(module, name, inner)
        assert len(calls) == (14 * model.config.num_layers if kernels.cache_attention else 0)
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
