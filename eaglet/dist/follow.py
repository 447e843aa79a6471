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
import pickle

from ..errors import EagletError

log = logging.getLogger("eaglet.server")

# Decoder methods that change what runs on the device (the rest only read host state)
MIRRORED = frozenset({"use", "set_rows", "advance", "drain", "step", "admit", "release", "free_all", "warmup"})
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a follower waits for the next call as long as the server idles


class Channel:
    """Rank 0 to the others: one pickled call at a time (its length, then its bytes) over its own
    gloo group (the model's collectives stay on theirs). A follower waits for the next call as long
    as the server idles; rank 0 waits for the followers to take it at most the collective timeout
    (workers.TIMEOUT_S), so a hung rank fails the call instead of hanging the server."""

    def __init__(self):
        import torch.distributed as dist

        from .workers import TIMEOUT_S

        self.dist, self.timeout = dist, datetime.timedelta(seconds=TIMEOUT_S)
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, msg) -> None:
        import torch

        data = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8)
        for t in (torch.tensor([len(data)]), data):
            try:
                self.dist.broadcast(t, src=0, group=self.group, async_op=True).wait(timeout=self.timeout)
            except RuntimeError as e:
                raise EagletError(f"the tensor-parallel ranks did not take rank 0's call: timed out after "
                                  f"{self.timeout.total_seconds():.0f} s (EAGLET_DIST_TIMEOUT): a rank hangs "
                                  f"({e})") from None

    def recv(self):
        import torch

        size = torch.zeros(1, dtype=torch.long)
        self.dist.broadcast(size, src=0, group=self.group)
        data = torch.empty(int(size), dtype=torch.uint8)
        self.dist.broadcast(data, src=0, group=self.group)
        return pickle.loads(data.numpy().tobytes())


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
