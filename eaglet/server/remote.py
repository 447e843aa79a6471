"""The engine in a process of its own (`eaglet serve --engine-process`): the HTTP side (FastAPI on
the event loop: parsing, tokenizing, SSE) and the engine (model, batcher, detokenizing) stop sharing
one GIL. On the replay-free probe (bench/cpu/engine_alone.py: every step's device work taken away)
the engine fed without HTTP ran 1.9-2.1x its throughput behind HTTP in one process, on a 2-core CPU
and on the GPU machine's 16 cores alike.

The child is spawned (CUDA cannot be forked, and a fork of a process with torch's threads died now
and then) and builds the engine itself: `factory(*args)` -> Engine, e.g. commands.serving_engine,
which loads the model. It sends back what the HTTP side needs (the tokenizer, the context, the
vocabulary), then serves on one pipe:

  parent -> child: warmup, start, open (a request's fields), cancel (its id), metrics, stop
  child -> parent: ready (EngineInfo) or error (a load failure's one line), warm (graphs captured),
                   chunks (one message an engine iteration: what Engine._flush hands an event loop
                   in one process), metrics (the Prometheus text: the registry lives with the
                   engine), stopped (the engine thread ended)

`EngineClient` is the engine as app.py uses it (open, chunks, cancel, alive, thread.is_alive,
warmup, start, stop, shutdown, metrics_text). The event loop reads the pipe (`add_reader`); the
child reads it on its main thread, beside the engine thread. Not with tensor parallelism (rank 0's
engine leads the other ranks from the process that joined them).
"""
from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import pickle
import signal
import struct
import threading
import time
from contextlib import suppress
from dataclasses import dataclass

from ..errors import EagletError
from .engine import Engine
from .protocol import APIError
from .request import Chunk, Request


@dataclass
class EngineInfo:
    """What the HTTP side needs of the engine's process."""
    tokenizer: object
    vocab: int
    max_len: int
    name: str
    slots: int
    max_queue: int
    describe: str


class EngineClient:
    def __init__(self, factory, *args):
        """Spawns the engine's process, which calls `factory(*args)` (a module-level function
        returning an Engine, not started), and waits until it is built; its load error comes back
        as an EagletError with the child's message."""
        ctx = mp.get_context("spawn")
        # a pipe each way: the event loop's reader makes its end non-blocking, where Connection.recv
        # fails on a message not yet whole (_readable parses the frames itself), and sends to the
        # child stay blocking
        down, self.conn = ctx.Pipe(duplex=False)
        self.up, up = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_child, args=(down, up, factory, args), name="eaglet-engine", daemon=True)
        self.proc.start()
        down.close(), up.close()  # the child's ends: when the child exits, reads here see EOF
        self.buf = bytearray()  # what _readable has read of the child's next frames
        kind, body = self._recv("building the engine")
        if kind == "error":
            self.proc.join(10)
            raise EagletError(body)
        self.info: EngineInfo = body
        self.tokenizer, self.vocab, self.max_len, self.name = body.tokenizer, body.vocab, body.max_len, body.name
        self.reqs: dict[str, Request] = {}  # opened, not yet finished
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pending_metrics: list[asyncio.Future] = []
        self.started = self.stopping = False
        self.thread = self  # app.py asks engine.thread.is_alive()

    chunks = Engine.chunks  # a request's chunks from its queue; leaving early cancels it

    def _recv(self, doing: str):
        try:
            return self.up.recv()
        except (EOFError, OSError):
            self.proc.join(10)
            raise EagletError(f"the engine process exited (code {self.proc.exitcode}) while {doing}") from None

    def describe(self) -> str:
        return self.info.describe

    def is_alive(self) -> bool:
        """Whether the engine runs (started, its process alive)."""
        return self.started and self.proc.is_alive()

    @property
    def alive(self) -> bool:
        return self.is_alive() and not self.stopping

    def warmup(self) -> int:
        """The child captures its CUDA graphs (Engine.warmup); blocks until it has."""
        self.conn.send(("warmup", None))
        kind, n = self._recv("warming up")
        return n

    def start(self) -> None:
        """Starts the engine thread in the child; chunks are read on the running event loop."""
        self.loop = asyncio.get_running_loop()
        self.conn.send(("start", None))
        self.started = True
        self.loop.add_reader(self.up.fileno(), self._readable)

    def stop(self) -> None:
        self.stopping = True
        with suppress(OSError, ValueError):
            self.conn.send(("stop", None))

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stop()
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
        if self.loop is not None:
            with suppress(Exception):
                self.loop.remove_reader(self.up.fileno())
        self._fail_open("the engine stopped")

    async def metrics_text(self) -> bytes:
        """The child's Prometheus text."""
        if not self.alive:
            raise APIError(503, "the engine process is not running", "server_error", code="engine_dead")
        fut = self.loop.create_future()
        self.pending_metrics.append(fut)
        self.conn.send(("metrics", None))
        return await fut

    def open(self, req: Request) -> None:
        """Queue `req` with the engine (APIError 503 when it is not running, 429 when as many
        requests are open as the engine's rows and queue hold); then read it with `chunks`."""
        if not self.alive:
            raise APIError(503, "the engine is not running", "server_error", code="engine_dead")
        if len(self.reqs) >= self.info.max_queue + self.info.slots:
            raise APIError(429, f"the server is busy: {len(self.reqs)} requests are open (--max-batch "
                                f"{self.info.slots} running, --max-queue {self.info.max_queue} waiting); retry later",
                           "rate_limit_error", code="queue_full")
        req.loop, req.queue, req.arrival = asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter()
        self.reqs[req.id] = req
        self.conn.send(("open", (req.id, req.prompt, req.max_tokens, req.sampling, req.stop, req.ignore_eos,
                                 req.arrival)))

    def cancel(self, req: Request) -> None:
        if req.done:
            return
        req.done = True
        self.reqs.pop(req.id, None)
        with suppress(OSError, ValueError):
            self.conn.send(("cancel", req.id))

    def _readable(self) -> None:
        """On the event loop: every whole message the child has sent."""
        gone = False
        try:
            while data := os.read(self.up.fileno(), 1 << 20):
                self.buf += data
            gone = True  # EOF: the child exited
        except BlockingIOError:
            pass
        except OSError:
            gone = True
        for msg in take_frames(self.buf):
            self._handle(*msg)
        if gone:  # fail what it held
            self.stopping = True
            self.loop.remove_reader(self.up.fileno())
            self._fail_open("the engine process exited")

    def _handle(self, kind: str, body) -> None:
        if kind == "chunks":
            for rid, final, *fields in body:
                req = self.reqs.pop(rid, None) if final else self.reqs.get(rid)
                if req is not None:
                    req.done = final
                    req.queue.put_nowait(Chunk(*fields))
        elif kind == "metrics" and self.pending_metrics:
            self.pending_metrics.pop(0).set_result(body)
        elif kind == "stopped":
            self.stopping = True

    def _fail_open(self, why: str) -> None:
        for req in self.reqs.values():
            req.done = True
            req.queue.put_nowait(Chunk("", 0, error=APIError(503, why, "server_error", code="engine_dead")))
        self.reqs.clear()
        for fut in self.pending_metrics:
            if not fut.done():
                fut.set_exception(APIError(503, why, "server_error", code="engine_dead"))
        self.pending_metrics.clear()


def take_frames(buf: bytearray) -> list:
    """The whole messages at the start of `buf` (multiprocessing.Connection's frames: a 4-byte
    big-endian length, or -1 and an 8-byte one, then the pickle), removed from it; a partial frame
    stays for the next read."""
    out, at = [], 0
    try:
        while len(buf) - at >= 4:
            (n,), head = struct.unpack_from("!i", buf, at), 4
            if n == -1:
                if len(buf) - at < 12:
                    break
                (n,), head = struct.unpack_from("!Q", buf, at + 4), 12
            if len(buf) - at < head + n:
                break
            at += head + n
            out.append(pickle.loads(buf[at - n:at]))
    finally:  # a frame that cannot be read is dropped with those before it, not read again
        del buf[:at]
    return out


def _child(conn, up, factory, args) -> None:
    """The engine's process: builds the engine, then reads the pipe on this thread while the
    engine thread runs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the parent stops us
    lock = threading.Lock()

    def send(msg) -> None:
        with lock, suppress(OSError, ValueError):
            up.send(msg)

    try:
        engine: Engine = factory(*args)
    except EagletError as e:
        send(("error", str(e)))
        return
    except Exception as e:  # noqa: BLE001 -- one line to the parent, whatever the load raised
        send(("error", f"building the engine failed: {type(e).__name__}: {e}"))
        return
    send(("ready", EngineInfo(engine.tokenizer, engine.vocab, engine.max_len, engine.name, engine.slots,
                              engine.max_queue, engine.describe())))
    reqs: dict[str, Request] = {}

    def flush() -> None:  # Engine._flush, onto the pipe
        items = []
        for req, chunk, final in engine.take_outbox():
            # a tuple, not the dataclass: a fraction of the pickling (every chunk of every step)
            items.append((req.id, final, chunk.text, chunk.tokens, chunk.finish_reason, chunk.completion_tokens,
                          chunk.spec, chunk.error))
            if final:
                reqs.pop(req.id, None)
        if items:
            send(("chunks", items))

    def run() -> None:
        engine._run()
        send(("stopped", None))

    engine._flush = flush
    engine.thread = threading.Thread(target=run, name="eaglet-engine", daemon=True)
    while True:
        try:
            kind, body = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        if kind == "open":
            rid, prompt, max_tokens, sampling, stop, ignore_eos, arrival = body
            req = Request(prompt, max_tokens, sampling, stop, ignore_eos, id=rid)
            req.arrival = arrival  # perf_counter is the system's monotonic clock: the same in both processes
            reqs[rid] = req
            try:
                engine.submit(req)
            except APIError as e:
                reqs.pop(rid, None)
                send(("chunks", [(rid, True, "", 0, None, 0, None, e)]))
        elif kind == "cancel":
            if (req := reqs.pop(body, None)) is not None:
                engine.cancel(req)
        elif kind == "metrics":
            send(("metrics", engine.metrics_text_now()))
        elif kind == "warmup":
            n = engine.warmup()
            gc.collect()  # as app.py's lifespan does for an engine in its process
            gc.freeze()
            send(("warm", n))
        elif kind == "start":
            engine.start()
        elif kind == "stop":
            break
    if engine.thread.is_alive():
        engine.shutdown()
    gc.unfreeze()  # collectable at exit (extensions report frozen objects as leaked)
