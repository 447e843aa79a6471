"""What travels between the HTTP side (asyncio) and the engine thread: a request, and the chunks of
text the engine sends back through the request's asyncio.Queue."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from ..spec.metrics import SpecMetrics
from .protocol import APIError


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int  # already within the context (the app checks)
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # set by Engine.generate (event loop side)
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    arrival: float = 0.0
    # engine thread side
    row: int | None = None
    done: bool = False
    first_at: float | None = None
    last_at: float | None = None


@dataclass
class Chunk:
    """Engine -> HTTP: new text of one request; the last one has finish_reason (or error)."""
    text: str
    tokens: int
    finish_reason: str | None = None
    completion_tokens: int = 0  # set on the last chunk
    spec: SpecMetrics | None = None  # the request's draft counters, on the last chunk
    error: APIError | None = None

    def then(self, nxt: "Chunk") -> "Chunk":
        """This chunk and the next one (not an error) as one."""
        return Chunk(self.text + nxt.text, self.tokens + nxt.tokens, nxt.finish_reason, nxt.completion_tokens,
                     nxt.spec)


def put_all(items: list[tuple[asyncio.Queue, "Chunk"]]) -> None:
    """On the event loop: each chunk into its request's queue."""
    for queue, chunk in items:
        queue.put_nowait(chunk)
