"""What may watch a decoder's steps, passed to the decoder, never looked up by it: `StepObserver`,
whose base watches nothing. The phase timer (runtime/timer.py) times each phase of a step; the
profiler's draft trace (perf/profile.py) keeps what each collected speculation step proposed and
accepted. The decoder and its steps call the observer at fixed points and make one decision from
it: a step whose phases someone watches apart (`apart`) runs them as separate graphs, each inside
`phase(name)`; otherwise a speculation step is one graph.
"""
from __future__ import annotations

from contextlib import nullcontext


class StepObserver:
    apart = False  # run each phase of a step as its own graph inside phase(name) (a timer needs them apart)
    # on_collect reads the collected step's proposal: every step then covers the whole batch, and the
    # host collects it before the next is launched (no lookahead)
    needs_proposal = False

    def phase(self, name: str):
        """A context around one phase: prefill, decode (plain), draft, verify, accept (speculation)."""
        return nullcontext()

    def on_collect(self, step) -> None:
        """A speculation step as the host collected it (spec/loop.py's Collected)."""
