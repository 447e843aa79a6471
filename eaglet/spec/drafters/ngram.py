"""N-gram / prompt-lookup drafter: no model. Finds the longest recent suffix of the sequence so far
(prompt and output, `ngram_max` down to `ngram_min` tokens) that occurred before, and proposes the
tokens that followed it. A chain takes the most recent match; a tree merges the continuations of
up to `topk` matches (most recent first) into a trie, cut to the verify budget in breadth order.
Proposals are deterministic (q one-hot), so sampled acceptance stays lossless."""
from __future__ import annotations

import torch

from ...config import SpecConfig
from ..tree import DraftProposal


def find_continuations(hist: list[int], spec: SpecConfig, want: int) -> list[list[int]]:
    """Up to `want` continuations (each up to spec.steps tokens), from the longest matching suffix."""
    n_hist = len(hist)
    for n in range(min(spec.ngram_max, n_hist - 1), spec.ngram_min - 1, -1):
        suffix = hist[n_hist - n:]
        found: list[list[int]] = []
        for i in range(n_hist - n - 1, -1, -1):  # most recent occurrence first, never the suffix itself
            if hist[i:i + n] == suffix:
                cont = hist[i + n: i + n + spec.steps]
                if cont and cont not in found:  # a repeat adds no branch to the trie
                    found.append(cont)
                    if len(found) == want:
                        return found
        if found:
            return found
    return []


def build_trie(conts: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """Merge continuations into a trie below the root (node 0); return (tokens, parents) of at most
    `budget` nodes, parents before children (breadth-first)."""
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens, parents, depth = [0], [-1], [0]
    for cont in conts:
        node = 0
        for tok in cont:
            if (node, tok) not in children:
                children[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                depth.append(depth[node] + 1)
            node = children[(node, tok)]
    order = sorted(range(1, len(tokens)), key=lambda i: (depth[i], i))[: budget - 1]
    new = {0: 0, **{old: j + 1 for j, old in enumerate(order)}}
    keep = set(order)
    kept = [i for i in order if parents[i] == 0 or parents[i] in keep]
    return [tokens[i] for i in kept], [new[parents[i]] for i in kept]


class NgramDrafter:
    taps = ()
    graphable = False  # the lookup runs on the host

    def __init__(self, spec: SpecConfig, batch: int):
        self.spec = spec
        self.hist: list[list[int]] = [[] for _ in range(batch)]

    def start(self, batch, taps, first) -> None:
        pass  # everything happens on the host

    def start_host(self, rows, prompts, first) -> None:
        for r, p, t in zip(rows, prompts, first):
            self.hist[r] = list(p) + [t]

    def commit(self, prop, res, taps) -> None:
        pass

    def commit_host(self, emitted) -> None:
        for h, e in zip(self.hist, emitted):
            h.extend(e)

    def release(self, rows) -> None:
        for r in rows:
            self.hist[r] = []

    def rows(self, k: int) -> "NgramDrafter":
        return self  # propose drafts for as many rows as it is given roots

    def propose(self, roots: torch.Tensor) -> DraftProposal:
        n = self.spec.draft_tokens
        b = roots.shape[0]
        tokens = torch.zeros(b, n, dtype=torch.long)
        parents = torch.zeros(b, n, dtype=torch.long)
        valid = torch.zeros(b, n, dtype=torch.bool)
        parents[:, 0] = -1
        valid[:, 0] = True
        for i, hist in enumerate(self.hist[:b]):
            conts = find_continuations(hist, self.spec, 1 if self.spec.is_chain else self.spec.topk)
            toks, pars = build_trie(conts, n)
            tokens[i, 1:1 + len(toks)] = torch.tensor(toks, dtype=torch.long)
            parents[i, 1:1 + len(pars)] = torch.tensor(pars, dtype=torch.long)
            valid[i, 1:1 + len(toks)] = True
        dev = roots.device
        tokens = tokens.to(dev)
        tokens[:, 0] = roots
        return DraftProposal.from_parents(tokens, parents.to(dev), valid.to(dev), max_depth=self.spec.steps)
