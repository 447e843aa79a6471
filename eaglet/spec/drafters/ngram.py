"""N-gram / prompt-lookup drafter: no model. Finds the longest recent suffix of the sequence so far
(prompt and output, `ngram_max` down to `ngram_min` tokens) that occurred before, and proposes the
tokens that followed it. A chain takes the most recent occurrence; a tree merges the continuations
of the `topk` most recent ones into a trie (repeats share nodes), cut to the verify budget in
breadth order. Proposals are deterministic (q one-hot), so sampled acceptance stays lossless.

Everything runs on the device over a per-row token history (a fixed-size buffer and its lengths),
with no host sync, so a step's lookup, verify and accept are one CUDA graph like EAGLE-3's: the
lookup compares every earlier window of the history with the suffix at once, for each n."""
from __future__ import annotations

import torch

from ...config import SpecConfig
from ...kernels import EAGER, Kernels, fusable
from ...transfer import zero_rows
from ..tree import DraftProposal, chain
from .base import row_view


@fusable
def continuations(hist: torch.Tensor, lens: torch.Tensor, ngram_min: int, ngram_max: int, steps: int,
                  want: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hist (B, L) token histories holding lens (B,) tokens each. Returns the `steps` tokens after
    each of the `want` most recent earlier occurrences of the row's longest recurring suffix (most
    recent first) and whether each token exists (a continuation stops at the history's end; a row
    with fewer occurrences, or none, has rows of False): (B, want, steps) each."""
    b, width = hist.shape
    dev = hist.device
    ar = torch.arange(width, device=dev)
    padded = torch.cat([hist, hist.new_zeros(b, ngram_max + steps)], 1)
    starts = hist.new_full((b, want), -1)  # where each continuation begins; -1: none
    found = torch.zeros(b, dtype=torch.bool, device=dev)
    for n in range(ngram_max, ngram_min - 1, -1):  # the longest suffix with an earlier occurrence wins
        suffix = padded.gather(1, (lens[:, None] - n + torch.arange(n, device=dev)).clamp(min=0))  # (B, n)
        match = ar[None] < (lens - n)[:, None]  # earlier windows with at least one token after them
        for j in range(n):
            match = match & (padded[:, j:j + width] == suffix[:, j:j + 1])
        recent = torch.where(match, ar[None], -1).topk(want, 1).values  # (B, want) start positions
        take = ~found & (recent[:, 0] >= 0)
        starts = torch.where(take[:, None], torch.where(recent >= 0, recent + n, -1), starts)
        found = found | take
    pos = starts[..., None] + torch.arange(steps, device=dev)  # (B, want, steps)
    ok = (starts[..., None] >= 0) & (pos < lens[:, None, None])
    tokens = padded.gather(1, pos.clamp(min=0).flatten(1)).view(b, want, steps)
    return torch.where(ok, tokens, 0), ok


@fusable
def trie(conts: torch.Tensor, ok: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge continuations (B, C, S) (ok: which tokens exist) into a trie below the root (node 0):
    a token at depth d of continuation c is a new node unless an earlier continuation has the same
    tokens through d. Nodes are numbered breadth first (depth, then the continuation that made
    them) and cut to `budget` - 1. Returns tokens, parents and valid, (B, budget) each, root
    first (its token left 0)."""
    b, c, s = conts.shape
    dev = conts.device
    same = (conts[:, :, None] == conts[:, None, :]).to(torch.int32).cumprod(-1).bool()  # (B, C', C, S) prefixes equal
    same = same & ok[:, :, None] & ok[:, None, :]
    rep = same.to(torch.uint8).argmax(1)  # (B, C, S): the first continuation with the same prefix
    new = ok & (rep == torch.arange(c, device=dev)[None, :, None])  # (B, C, S)
    order = new.transpose(1, 2).flatten(1)  # (B, S*C): depth-major, breadth order
    rank = order.cumsum(1) - 1  # node id - 1 of each new node
    node = torch.where(order & (rank < budget - 1), rank + 1, 0).view(b, s, c).transpose(1, 2)  # (B, C, S)
    # the parent of (c, d) is the node of its prefix at d - 1, made by rep[c, d - 1]; the root at d = 0
    up = node.gather(1, rep[:, :, :-1])
    parent = torch.cat([torch.zeros_like(node[:, :, :1]), up], 2)
    keep = node > 0
    slot = torch.where(keep, node, budget).flatten(1)  # dropped candidates go to a spill column
    tokens = conts.new_zeros(b, budget + 1).scatter_(1, slot, conts.flatten(1))
    parents = conts.new_zeros(b, budget + 1).scatter_(1, slot, parent.flatten(1))
    valid = torch.zeros(b, budget + 1, dtype=torch.bool, device=dev).scatter_(1, slot, keep.flatten(1))
    parents[:, 0] = -1
    valid[:, 0] = True
    return tokens[:, :budget], parents[:, :budget], valid[:, :budget]


class NgramDrafter:
    taps = ()
    graphable = True
    row_tensors = ("hist", "lens")  # sliced by rows(k)

    def __init__(self, spec: SpecConfig, batch: int, max_len: int, device=None, kernels: Kernels = EAGER):
        self.spec, self.kernels = spec, kernels
        self.hist = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # prompt, then emitted tokens
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)

    def start(self, batch, taps, first) -> None:
        b, t = batch.ids.shape
        width = self.hist.shape[1]
        rows = batch.ids.new_zeros(b, max(t, width))
        rows[:, :t] = batch.ids
        rows.scatter_(1, batch.lens[:, None].clamp(max=width - 1), first[:, None])  # the first token after the prompt
        self.hist.index_copy_(0, batch.rows, rows[:, :width])
        self.lens.index_copy_(0, batch.rows, batch.lens + 1)

    def start_host(self, rows, prompts, first) -> None:
        pass

    def commit(self, prop, res, taps) -> None:
        """Append each row's emitted tokens (res.tokens[:count], ending with the next root)."""
        j = torch.arange(res.tokens.shape[1], device=res.tokens.device)
        pos = (self.lens[:, None] + j).clamp(max=self.hist.shape[1] - 1)
        new = torch.where(j[None] < res.count[:, None], res.tokens, self.hist.gather(1, pos))
        self.hist.scatter_(1, pos, new)
        self.lens += res.count

    def commit_host(self, emitted) -> None:
        pass

    def release(self, rows) -> None:
        zero_rows(self.lens, rows)

    def rows(self, k: int) -> "NgramDrafter":
        return row_view(self, k)

    def propose(self, roots: torch.Tensor, sampling=None) -> DraftProposal:
        """roots are the histories' last tokens (the last emitted ones)."""
        sp = self.spec
        want = 1 if sp.is_chain else sp.topk
        conts, ok = self.kernels.fuse(continuations)(self.hist, self.lens, sp.ngram_min, sp.ngram_max, sp.steps, want)
        if sp.is_chain:
            return chain(torch.cat([roots[:, None], conts[:, 0]], 1),
                         valid=torch.cat([torch.ones_like(ok[:, 0, :1]), ok[:, 0]], 1))
        tokens, parents, valid = self.kernels.fuse(trie)(conts, ok, sp.draft_tokens)
        tokens[:, 0] = roots
        return DraftProposal.from_parents(tokens, parents, valid, max_depth=sp.steps, kernels=self.kernels)
