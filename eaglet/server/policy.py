"""Which decoding a batch uses: plain, or speculation with one setting ("chain:S" / "tree:S,K,N"),
chosen from how many requests the batch holds when it starts.

The engine asks when it starts a batch, and for a speculating batch whenever requests wait to
join it: if the grown batch is one the policy decodes plain, or past the batch's setting's `reach`,
the batch turns plain where it stands (a speculative decoder decodes plain on its own cache; the
way back needs a new batch, since the drafter has missed the plain steps, and moving requests to a
batch of another setting, each prefilled again, lost: docs/notebook.md). A setting reaches the
largest batch it is chosen for and, with a profile, on past it while the profile predicts it still
beats plain decoding by KEEP_OVER_PLAIN (--spec-keep-over; 0: never) at every measured size:
settings chosen for neighbouring sizes are often within a few percent of each other (the H200
ShareGPT profile: 1.25-1.64x plain for each of its four settings at 16-64 requests), so a batch
that started small under a steady load keeps speculating instead of turning plain for as long as
the load lasts. With --spec-switch (one drafter for every setting: steps.py) a growing batch moves
instead to the setting chosen for its size where the profile predicts that MOVE_OVER times as fast
as its own (`move`), and keeps its own where it does not (`keeps`).

- With a profile (`eaglet serve --spec-policy RECORD`): the planner's batch_policy, per measured
  batch size; a batch of n requests follows the largest measured size <= n (the smallest measured
  one below all of them).
- Without: the configured drafter's setting up to `max_batch` requests (`--spec-max-batch`),
  plain decoding above it. A `max_batch` given with a profile caps the profile's choices too.
- No drafter: always plain.
"""
from __future__ import annotations

import bisect
import dataclasses

from ..config import SpecConfig
from ..errors import InvalidInput
from ..spec.speculator import Speculator
from . import KEEP_OVER_PLAIN, MOVE_OVER

PLAIN = "plain"  # the name shown for plain decoding (a setting of None)


def setting_name(spec: SpecConfig) -> str:
    """The planner's name of a SpecConfig: chain:S or tree:S,K,N."""
    if spec.topk == 1:
        return f"chain:{spec.steps}"
    return f"tree:{spec.steps},{spec.topk},{spec.draft_tokens}"


def setting_spec(name: str, base: SpecConfig) -> SpecConfig:
    """`base` (method, drafter, n-gram sizes) with the shape a setting name gives."""
    from ..perf.eval_draft import parse_setting

    s = parse_setting(name, base.method, base.draft)
    return dataclasses.replace(base, steps=s.steps, topk=s.topk, draft_tokens=s.draft_tokens)


def load_profile_policy(path: str) -> tuple[dict[int, str | None], dict[int, dict[str, float]], dict]:
    """The per-batch-size policy of an `eaglet profile` record, every setting's predicted speedup
    per batch size, and the record; InvalidInput when the file is not such a record."""
    from ..perf.compare import load_record
    from ..perf.planner import batch_policy, batch_speedups

    rec = load_record(path)
    if rec.get("kind") != "profile":
        raise InvalidInput(f"{path}: not a profile record (kind {rec.get('kind')!r}); --spec-policy takes the "
                           "record `eaglet profile` writes")
    try:
        speedups = batch_speedups(rec["results"])
        table = batch_policy(rec["results"], speedups)
        for name in table.values():
            if name is not None:
                setting_spec(name, SpecConfig("ngram"))
    except (KeyError, TypeError, ValueError, IndexError, StopIteration, AttributeError, InvalidInput) as e:
        raise InvalidInput(f"{path}: a profile record without the costs and acceptance the planner needs "
                           f"({type(e).__name__}: {e})") from None
    if not table:
        raise InvalidInput(f"{path}: the profile measured no batch sizes")
    return table, speedups, rec


class SpecPolicy:
    def __init__(self, base: Speculator | None, table: dict[int, str | None] | None = None,
                 max_batch: int | None = None, source: str | None = None,
                 speedups: dict[int, dict[str, float]] | None = None, keep_over: float = KEEP_OVER_PLAIN,
                 switch: bool = False):
        """table: per measured batch size, its setting (None: plain); speedups: per measured size,
        each setting's predicted speedup over plain (load_profile_policy), which lets a setting
        keep a batch grown past the sizes it is chosen for while at least `keep_over` (--spec-keep-over).
        switch (--spec-switch): a speculating batch that grows into a size the policy gives another
        setting moves to it in place where predicted MOVE_OVER times as fast (`move`; keep_over unused)."""
        if max_batch is not None and max_batch < 0:
            raise InvalidInput(f"--spec-max-batch must be >= 0, got {max_batch}")
        self.base, self.max_batch, self.source = base, max_batch, source
        self.table = dict(sorted(table.items())) if table else None
        self._sizes = list(self.table) if self.table else []
        self.speedups, self.keep_over, self.switch = speedups or {}, keep_over, switch
        self._reach: dict[tuple[str, int], int] = {}

    def choose(self, n: int) -> str | None:
        """The setting for a batch of `n` requests, or None for plain decoding."""
        if self.base is None or (self.max_batch is not None and n > self.max_batch):
            return None
        if self.table is None:
            return setting_name(self.base.spec)
        return self.table[self.measured(n)]

    def measured(self, n: int) -> int:
        """The measured batch size a batch of `n` requests follows: the largest <= n (the smallest one
        when all are larger)."""
        return self._sizes[max(bisect.bisect_right(self._sizes, n) - 1, 0)]

    def keeps(self, setting: str, n: int) -> bool:
        """Whether a batch speculating with `setting` may hold `n` requests: the policy speculates at
        n and chooses this setting there, or the profile predicts it `keep_over` times as fast as plain."""
        choice = self.choose(n)
        if choice is None:
            return False
        if self.switch:
            return self.move(setting, n) is None
        return choice == setting or (self.keep_over > 0 and
                                     self.speedups.get(self.measured(n), {}).get(setting, 0.0) >= self.keep_over)

    def move(self, setting: str, n: int) -> str | None:
        """With `switch`: the setting a batch speculating with `setting` moves to at `n` requests (the
        one chosen there, if the profile predicts it MOVE_OVER times as fast as `setting` at n), or
        None to keep its own."""
        choice = self.choose(n)
        if not self.switch or choice is None or choice == setting:
            return None
        there = self.speedups.get(self.measured(n), {})
        return choice if there.get(choice, 0.0) >= MOVE_OVER * there.get(setting, 0.0) else None

    def reach(self, setting: str, slots: int) -> int:
        """How far (at most `slots` requests) a batch that speculates with `setting` may grow: the
        largest batch the policy chooses it for, then on while it `keeps` each larger size. The
        engine warms its graphs that far; past it, the batch turns plain."""
        key = (setting, slots)
        if key not in self._reach:
            n = max((n for n in range(1, slots + 1) if self.choose(n) == setting), default=0)
            while 0 < n < slots and self.keeps(setting, n + 1):
                n += 1
            self._reach[key] = n
        return self._reach[key]

    def speculator(self, name: str | None) -> Speculator | None:
        """The Speculator of a setting (the base one when the shape is its own)."""
        if name is None:
            return None
        spec = setting_spec(name, self.base.spec)
        return self.base if spec == self.base.spec else dataclasses.replace(self.base, spec=spec)

    def describe(self, slots: int | None = None) -> str:
        """One line for the server's start: what it decodes with, and with a profile and `slots` rows
        how far each setting keeps a growing batch."""
        if self.base is None:
            return "plain decoding"
        method = self.base.spec.method
        if self.table is None:
            if self.max_batch == 0:
                return f"plain decoding ({method} drafter loaded, --spec-max-batch 0)"
            cap = "" if self.max_batch is None else f" for batches of up to {self.max_batch}, plain above"
            return f"{method} speculation, {setting_name(self.base.spec)}{cap}"
        per = ", ".join(f"{b}: {s or PLAIN}" for b, s in self.table.items())
        cap = "" if self.max_batch is None else f", plain above {self.max_batch}"
        kept = "" if slots is None else "; a batch keeps its setting up to " + ", ".join(
            f"{s} {self.reach(s, slots)}" for s in dict.fromkeys(self.table.values()) if s and self.reach(s, slots))
        moves = f"; a growing batch moves to its size's setting where predicted {MOVE_OVER}x its own" if self.switch else ""
        return f"{method} speculation per batch size from {self.source or 'a profile'} ({per}{cap}{kept}{moves})"
