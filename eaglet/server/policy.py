"""Which decoding a batch uses: plain, or speculation with one setting ("chain:S" / "tree:S,K,N"),
chosen from how many requests the batch holds when it starts.

The engine asks when it starts a batch, and for a speculating batch whenever requests wait to
join it: if the grown batch is one the policy decodes plain, or larger than any it chooses the
batch's setting for (`reach`), the batch turns plain where it stands (a speculative decoder decodes
plain on its own cache; the way back needs a new batch, since the drafter has missed the plain
steps).

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


def load_profile_policy(path: str) -> tuple[dict[int, str | None], dict]:
    """The per-batch-size policy of an `eaglet profile` record, and the record; InvalidInput when
    the file is not such a record."""
    from ..perf.compare import load_record
    from ..perf.planner import batch_policy

    rec = load_record(path)
    if rec.get("kind") != "profile":
        raise InvalidInput(f"{path}: not a profile record (kind {rec.get('kind')!r}); --spec-policy takes the "
                           "record `eaglet profile` writes")
    try:
        table = batch_policy(rec["results"])
        for name in table.values():
            if name is not None:
                setting_spec(name, SpecConfig("ngram"))
    except (KeyError, TypeError, ValueError, IndexError, StopIteration, AttributeError, InvalidInput) as e:
        raise InvalidInput(f"{path}: a profile record without the costs and acceptance the planner needs "
                           f"({type(e).__name__}: {e})") from None
    if not table:
        raise InvalidInput(f"{path}: the profile measured no batch sizes")
    return table, rec


class SpecPolicy:
    def __init__(self, base: Speculator | None, table: dict[int, str | None] | None = None,
                 max_batch: int | None = None, source: str | None = None):
        if max_batch is not None and max_batch < 0:
            raise InvalidInput(f"--spec-max-batch must be >= 0, got {max_batch}")
        self.base, self.max_batch, self.source = base, max_batch, source
        self.table = dict(sorted(table.items())) if table else None
        self._sizes = list(self.table) if self.table else []
        self._reach: dict[tuple[str, int], int] = {}

    def choose(self, n: int) -> str | None:
        """The setting for a batch of `n` requests, or None for plain decoding."""
        if self.base is None or (self.max_batch is not None and n > self.max_batch):
            return None
        if self.table is None:
            return setting_name(self.base.spec)
        i = bisect.bisect_right(self._sizes, n) - 1
        return self.table[self._sizes[max(i, 0)]]

    def reach(self, setting: str, slots: int) -> int:
        """The largest batch (of at most `slots` requests) the policy chooses `setting` for: how far a
        batch that speculates with it may grow (the engine warms its graphs that far; past it, the
        batch turns plain: running a setting at a size the policy chose another for loses to
        `--spec none`, docs/notebook.md, "a growing batch's setting")."""
        key = (setting, slots)
        if key not in self._reach:
            self._reach[key] = max((n for n in range(1, slots + 1) if self.choose(n) == setting), default=0)
        return self._reach[key]

    def speculator(self, name: str | None) -> Speculator | None:
        """The Speculator of a setting (the base one when the shape is its own)."""
        if name is None:
            return None
        spec = setting_spec(name, self.base.spec)
        return self.base if spec == self.base.spec else dataclasses.replace(self.base, spec=spec)

    def describe(self) -> str:
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
        return f"{method} speculation per batch size from {self.source or 'a profile'} ({per}{cap})"
