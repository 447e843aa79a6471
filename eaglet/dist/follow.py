"""Serving over tensor-parallel ranks: rank 0 decides, the others follow.

Rank 0 runs the HTTP server and the engine; every decision that reaches the device (admit these
prompts with these settings and random streams, set these rows' limits, advance a trip, release,
switch the step) is a call on its Decoder. `Leader` wraps that decoder: each such call (and each
attribute set on it) is first broadcast to the other ranks over a gloo group, then run. `follow`
is the other ranks' loop: the same calls, in the same order, on their own decoder of their own
slice of the model, so every rank launches the same steps and meets rank 0 in every all-reduce.
The decoder's other choices follow from the calls (the tokens collected, its trip and rate), so
no rank decides anything on its own. Objects that are not values (a speculation step) travel by
the name of their setting.
"""
from __future__ import annotations

import datetime
import logging

log = logging.getLogger("eaglet.server")

# Decoder methods that change what runs on the device (the rest only read host state)
MIRRORED = frozenset({"use", "set_rows", "advance", "drain", "step", "admit", "release", "free_all", "warmup"})
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a follower waits for the next call as long as the server idles


class Channel:
    """Rank 0 to the others: one pickled call at a time over its own gloo group (the model's
    collectives stay on theirs)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, msg) -> None:
        self.dist.broadcast_object_list([msg], src=0, group=self.group)

    def recv(self):
        box = [None]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class Leader:
    """Rank 0's decoder: a call that reaches the device goes to the followers first."""

    def __init__(self, dec, steps: dict, channel: Channel):
        object.__setattr__(self, "_dec", dec)
        object.__setattr__(self, "_steps", steps)  # the engine's setting -> speculation step
        object.__setattr__(self, "_channel", channel)

    def _setting(self, step) -> str | None:
        if step is self._dec.plain:
            return None
        return next(name for name, s in self._steps.items() if s is step)

    def __getattr__(self, name):
        value = getattr(self._dec, name)
        if name not in MIRRORED:
            return value

        def call(*args, **kw):
            sent = (self._setting(args[0]),) if name == "use" else args
            self._channel.send((name, sent, kw))
            return value(*args, **kw)
        return call

    def __setattr__(self, name, value):
        self._channel.send(("__setattr__", (name, value), {}))
        setattr(self._dec, name, value)

    def stop(self) -> None:
        self._channel.send(None)


def follow(engine, channel: Channel) -> None:
    """A follower's serving loop: rank 0's decoder calls on this rank's engine's decoder, until
    rank 0 says stop (None)."""
    import torch

    with torch.inference_mode():
        while (msg := channel.recv()) is not None:
            name, args, kw = msg
            dec = engine.decoder()
            if name == "__setattr__":
                setattr(dec, *args)
            else:
                if name == "use":
                    args = (engine.step(args[0]),)
                getattr(dec, name)(*args, **kw)
