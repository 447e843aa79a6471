"""runtime/timer.py: totals are cumulative across asks, asking folds the entries away (a long
training run keeps no pile of events), and reset starts over."""
import torch

from eaglet.runtime.timer import PhaseTimer


def test_totals_fold_and_accumulate():
    t = PhaseTimer(torch.device("cpu"))
    for _ in range(3):
        with t.phase("a"):
            pass
    first = t.totals()
    assert first["a"]["count"] == 3 and not t.entries
    with t.phase("a"):
        pass
    with t.phase("b"):
        pass
    second = t.totals()
    assert second["a"]["count"] == 4 and second["a"]["ms"] >= first["a"]["ms"] and second["b"]["count"] == 1
    assert t.totals() == second  # asking again changes nothing
    t.reset()
    assert t.totals() == {}
