"""Drafting with a neural drafter (EAGLE-3 head or a draft model): a chain of `steps`, or the
EAGLE-2 dynamic tree. Subclasses provide `absorb` (run a block of committed inputs through the
drafter), `root_logits` and `draft_step` (feed a level of nodes, return their children's logits).

Per-row state lives in persistent tensors so that drafting runs inside a CUDA graph: the drafter's
KV cache, the hidden state of the last absorbed position (`root_h`), and what the last verify
committed but the drafter has not absorbed yet (`pend_ids`, `pend_count`; EAGLE-3 adds features).
`propose` first absorbs that block, then drafts.

Tree expansion, level by level: each of the `topk` frontier nodes proposes its `topk` best
children; every child becomes a candidate scored by cumulative log-probability; the best `topk`
children form the next frontier. A sampled row ranks its children by its logits plus the noise the
target draws each position with (sampling.RowSampling.noised): the best child is then the
drafter's own draw there, the one that matches the target's draw when the two models agree. After `steps` levels the best `draft_tokens - 1` candidates are
kept (tree.select_tree). What a level does besides the drafter's forward and its two top-k picks
(the level's mask, the next frontier, the candidates) is `@fusable` functions: on the GPU one or
two kernels each; 22 kernels of a tree 5,4,16 draft step instead of 101 (bench/cpu/step_ops.py). Nodes fed to the drafter sit in its cache's uncommitted block, each
attending to the committed prefix and its own ancestors.
"""
from __future__ import annotations

import torch

from ...config import SpecConfig
from ...kvcache import KVCache
from ...models.attention import AttnMeta
from ...models.prefill import FreshRows, PromptBatch, fresh_meta
from ...kernels import EAGER, fusable
from ...sampling import RowSampling, argmax
from ...transfer import zero_rows
from ..topk import topk
from .base import row_view
from ..tree import DraftProposal, chain, select_tree


class NeuralDrafter:
    graphable = True
    row_tensors: tuple[str, ...] = ("root_h", "pend_ids", "pend_count")  # sliced by rows()
    feeds_state = False  # True: draft steps take their parent's hidden state (EAGLE-3)
    window: int | None = None  # the drafter's sliding attention window, if any
    fed_past_prompt = 0  # what an admitted prompt feeds the drafter: its tokens plus this many
    kernels = EAGER  # what the drafter's model runs (set by subclasses from it)

    def __init__(self, spec: SpecConfig, vocab_size: int, cache: KVCache, hidden_size: int):
        self.spec, self.vocab_size = spec, vocab_size
        self.cache = cache
        b, dev = cache.batch, cache.lens.device
        self.root_h = torch.zeros(b, hidden_size, dtype=cache.k.dtype, device=dev)  # last absorbed position
        self.pend_ids = torch.zeros(b, spec.steps + 1, dtype=torch.long, device=dev)  # committed, not absorbed
        self.pend_count = torch.zeros(b, dtype=torch.long, device=dev)
        self._vocab: torch.Tensor | None = None  # the target id of each drafter logit (made when first sampled)

    # ---- provided by subclasses ----
    def absorb(self, cache: KVCache, ids: torch.Tensor, feats: torch.Tensor | None, positions: torch.Tensor,
               meta: AttnMeta) -> torch.Tensor:
        """Run inputs (B, T) (and EAGLE-3's fused features (B, T, H)) through the drafter; (B, T, H)."""
        raise NotImplementedError

    def root_logits(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def draft_step(self, ids: torch.Tensor, state: torch.Tensor | None, depth: int, mask: torch.Tensor | None,
                   pending: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed nodes ids (B, K) (drafter vocabulary) of the given depth with their parents' states;
        mask (B, K, pending + K) over the uncommitted block, None for causal (a chain). Returns (logits (B, K, Vd), states)."""
        raise NotImplementedError

    def prompt_inputs(self, batch: PromptBatch, taps, first) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What newly admitted prompts feed (device): ids (b, T'), the first len + fed_past_prompt
        of each row real, and features or None."""
        raise NotImplementedError

    def pending_feats(self) -> torch.Tensor | None:
        return None

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Drafter-vocabulary ids -> target ids (identity unless a draft vocabulary is used)."""
        return ids

    # ---- state ----
    def rows(self, k: int) -> "NeuralDrafter":
        """This drafter over rows 0..k-1: the same storage, sliced."""
        return row_view(self, k)

    def _run_block(self, cache: KVCache, ids, feats) -> torch.Tensor:
        positions = cache.lens[:, None] + torch.arange(ids.shape[1], device=ids.device)  # (B, T)
        meta = AttnMeta.build(cache.lens, positions, cache.kv_len(ids.shape[1]), sliding_window=self.window,
                              kernels=self.kernels)
        return self.absorb(cache, ids, feats, positions, meta)

    def start(self, batch, taps, first) -> None:
        ids, feats = self.prompt_inputs(batch, taps, first)
        counts = batch.lens + self.fed_past_prompt
        b, t = ids.shape
        positions, meta = fresh_meta(b, t, ids.device, self.window, self.kernels)
        h = self.absorb(FreshRows(self.cache, batch.rows), ids, feats, positions, meta)  # (b, T, H)
        self.cache.lens.index_copy_(0, batch.rows, counts)
        self.root_h.index_copy_(0, batch.rows, h.gather(1, (counts - 1)[:, None, None].expand(b, 1, h.shape[-1]))[:, 0])
        self.pend_count.index_fill_(0, batch.rows, 0)

    def start_host(self, rows, prompts, first) -> None:
        self.cache.host_lens[rows] = [len(p) + self.fed_past_prompt for p in prompts]

    def commit(self, prop, res, taps) -> None:
        self.pend_ids[:, :res.tokens.shape[1]].copy_(res.tokens)  # as wide as the widest setting sharing it
        self.pend_count.copy_(res.count)

    def commit_host(self, emitted) -> None:
        self.cache.commit_host([len(e) for e in emitted])  # the device catches up in the next propose

    def release(self, rows) -> None:
        self.cache.release(rows)
        zero_rows(self.pend_count, rows)

    def level_meta(self, b: int, k: int, depth: int, mask: torch.Tensor | None, pending: int):
        """Positions (B, K) and attention metadata of a draft level of k nodes at `depth`, after
        `pending` nodes of earlier levels in the uncommitted block."""
        positions = (self.cache.lens + (depth - 1))[:, None].expand(b, k)
        meta = AttnMeta.build(self.cache.lens, positions, self.cache.kv_len(pending + k), tree_mask=mask,
                              pending=pending, sliding_window=self.window, kernels=self.kernels)
        return positions, meta

    def catch_up(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorb what the last verify committed (rows with count 0 keep their root). Returns the
        root's logits (B, Vd) and, for drafters that feed states, the root state (B, H)."""
        count = self.pend_count
        h = self._run_block(self.cache, self.pend_ids, self.pending_feats())  # (B, D+1, H)
        self.cache.lens += count
        last = h.gather(1, (count - 1).clamp(min=0)[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0]
        self.root_h.copy_(torch.where((count > 0)[:, None], last, self.root_h))
        count.zero_()
        return self.root_logits(self.root_h), self.root_h if self.feeds_state else None

    def save_state(self):
        """Everything `propose` changes, to time it repeatedly from the same state (the profiler)."""
        return [t.clone() for t in (self.cache.lens, self.root_h, self.pend_count)]

    def load_state(self, saved) -> None:
        for t, s in zip((self.cache.lens, self.root_h, self.pend_count), saved):
            t.copy_(s)

    # ---- drafting ----
    def propose(self, roots: torch.Tensor, sampling: RowSampling) -> DraftProposal:
        logits, state = self.catch_up()
        if self.spec.is_chain:
            return self._chain(roots, logits, state, sampling)
        return self._tree(roots, logits, state, sampling)

    def _pick(self, logits: torch.Tensor, rs: RowSampling, depth: int) -> torch.Tensor:
        """The child of a chain node at `depth` (0: the root): the argmax, or for a sampled row its
        draw from the drafter's logits with the noise the target draws the same position with
        (RowSampling.pick), so that it proposes what the target will draw when the two agree."""
        if not rs.mode.sampled:
            return argmax(logits, self.kernels)
        return rs.pick(logits, depth + 1, self.kernels, self._target_ids(logits))

    def _guesses(self, logits: torch.Tensor, rs: RowSampling, depth: int) -> torch.Tensor:
        """What a tree level at `depth` ranks its children by: the logits, or for a sampled row its
        logits with the noise the target draws that position with (RowSampling.noised), so that the
        best child is the drafter's draw there and the next ones the runners-up."""
        if not rs.mode.sampled:
            return logits
        return rs.noised(logits, depth + 1, self.kernels, self._target_ids(logits))

    def _target_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's id of each of the drafter's logits (its vocabulary may be a subset)."""
        if self._vocab is None:
            self._vocab = self.to_target(torch.arange(logits.shape[-1], device=logits.device))
        return self._vocab

    def _chain(self, roots, logits, state, rs: RowSampling) -> DraftProposal:
        ids = self._pick(logits, rs, 0)  # (B,)
        picked = [ids]
        for d in range(1, self.spec.steps):  # mask None: a chain node sees every pending node
            logits, state = self.draft_step(ids[:, None], None if state is None else state[:, None], d, None,
                                            pending=d - 1)
            logits, state = logits[:, 0], None if state is None else state[:, 0]  # (B, Vd), (B, H)
            ids = self._pick(logits, rs, d)
            picked.append(ids)
        return chain(torch.cat([roots[:, None], self.to_target(torch.stack(picked, 1))], 1))  # (B, steps+1)

    def _tree(self, roots, logits, state, rs: RowSampling) -> DraftProposal:
        k, steps = self.spec.topk, self.spec.steps
        b, dev = roots.shape[0], roots.device
        fuse, kernel = self.kernels.fuse, self.kernels.topk
        score, ids = topk(self._guesses(logits, rs, 0), k, log_softmax=True, kernel=kernel)  # (B, K)
        c_tok, c_score, fronts = [ids], [score], []  # candidates level by level; each level's parents
        front_cand = torch.arange(k, device=dev).expand(b, k)  # candidate index of each frontier node
        front_state = None if state is None else state[:, None].expand(b, k, *state.shape[1:])
        mask = anc = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)  # the first level: itself
        par_fed = None  # each frontier node's parent among the nodes fed (from the second level on)
        for d in range(1, steps):
            p = (d - 1) * k  # nodes already in the drafter's uncommitted block
            if d > 1:
                mask, anc = fuse(level_mask)(anc, par_fed)
            logits, out_state = self.draft_step(ids, front_state, d, mask, pending=p)
            # each node's k best children, scored by cumulative log-probability
            child_score, child_ids = topk(self._guesses(logits, rs, d), k, log_softmax=True, offset=score,
                                          kernel=kernel)  # (B, K, K)
            c_tok.append(child_ids.flatten(1))
            c_score.append(child_score.flatten(1))
            fronts.append(front_cand)
            score, best = topk(child_score.flatten(1), k, kernel=kernel)  # the next frontier: (B, K)
            ids, front_cand, par_fed, front_state = fuse(next_frontier)(best, child_ids, out_state,
                                                                        k + (d - 1) * k * k, p)
        tokens, parents, scores = fuse(candidates)(c_tok, c_score, fronts)
        return select_tree(roots, self.to_target(tokens), parents, scores, self.spec.draft_tokens, max_depth=steps,
                           kernels=self.kernels)


@fusable
def level_mask(anc: torch.Tensor, par_fed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft tree level's mask over the uncommitted block (B, K, P + K): each new node sees its
    parent's ancestry among the P fed nodes (anc (B, P, P)) and itself; and the block's ancestry
    with the level appended (B, P + K, P + K). par_fed (B, K): each node's parent among the fed."""
    b, k = par_fed.shape
    p = anc.shape[1]
    rows = anc.gather(1, par_fed[..., None].expand(b, k, p))
    mask = torch.cat([rows, torch.eye(k, dtype=torch.bool, device=anc.device).expand(b, k, k)], 2)
    return mask, torch.cat([torch.cat([anc, anc.new_zeros(b, p, k)], 2), mask], 1)


@fusable
def next_frontier(best: torch.Tensor, child_ids: torch.Tensor, out_state: torch.Tensor | None, n_cand: int,
                  p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The next frontier from its picks `best` (B, K) among a level's K x K children: their ids,
    candidate indices, parents' offsets in the drafter's block, and parents' states (EAGLE-3)."""
    b, k = best.shape
    parent_slot = best // k  # which frontier node each comes from
    ids = child_ids.flatten(1).gather(1, best)
    state = None
    if out_state is not None:
        state = out_state.gather(1, parent_slot.view(b, k, *[1] * (out_state.dim() - 2)).expand(b, k, *out_state.shape[2:]))
    return ids, n_cand + best, p + parent_slot, state


@fusable
def candidates(c_tok: list[torch.Tensor], c_score: list[torch.Tensor],
               fronts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every level's candidates as (B, C) tokens, parents (candidate index, -1: the root) and
    scores: K at the first level, K x K at each next one (its K frontier nodes' children)."""
    b, k = c_tok[0].shape
    parents = [torch.full_like(c_tok[0], -1)] + [f[..., None].expand(b, k, k).flatten(1) for f in fronts]
    return torch.cat(c_tok, 1), torch.cat(parents, 1), torch.cat(c_score, 1)
