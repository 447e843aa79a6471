"""The step of each speculation setting over the engine's one decoder (Engine.step).

By default each setting gets a drafter of its own, made the first time the setting is chosen. With
--spec-switch (SpecPolicy.switch) one drafter, made with room for the widest setting the policy can
choose (`widest`: the deepest chain or tree, the most children, the most verified nodes), serves
them all: each setting's step drafts with its own shape over the same drafter caches, pending block
and draft counters (drafters.base.with_spec), so a running batch can move between settings with no
prefill (Batcher.use)."""
from __future__ import annotations

import dataclasses

from ..config import SpecConfig
from ..models.llama import CausalLM
from ..runtime.decoder import Slots
from ..spec.drafters.base import with_spec
from ..spec.loop import SpecStep
from ..spec.metrics import RowCounters
from .policy import SpecPolicy


def widest(policy: SpecPolicy, settings: list[str | None]) -> SpecConfig:
    """A setting as deep, as wide and with as many verified nodes as any of `settings`."""
    specs = [policy.speculator(s).spec for s in settings if s is not None]
    topk = max(s.topk for s in specs)
    return dataclasses.replace(specs[0], steps=max(s.steps for s in specs), topk=topk,
                               draft_tokens=max(s.draft_tokens for s in specs) if topk > 1 else None)


def setting_step(policy: SpecPolicy, model: CausalLM, slots: Slots, max_len: int, setting: str, name: str,
                 made: dict[str, SpecStep], settings: list[str | None], shared: bool) -> SpecStep:
    """The step of `setting` over `slots` (rows of up to max_len tokens); `made`: the settings' steps
    so far, whose drafter (and counters) the new one shares when `shared`."""
    sp = policy.speculator(setting)
    if not shared:
        return SpecStep(model, slots, sp.make(model, slots.batch, max_len), sp.spec, name)
    first = next(iter(made.values()), None)
    if first is None:
        wide = dataclasses.replace(sp, spec=widest(policy, settings))
        drafter, counters = wide.make(model, slots.batch, max_len), RowCounters(slots.batch, wide.spec.steps)
    else:
        drafter, counters = first.drafter, first.counters
    return SpecStep(model, slots, with_spec(drafter, sp.spec), sp.spec, name, counters)
