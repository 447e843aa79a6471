"""FastAPI routes of `eaglet serve`: /v1/chat/completions and /v1/completions (streamed as SSE
`data: {...}` lines closed by `data: [DONE]`, or whole), /v1/models, /health, /metrics.

The handlers tokenize, check what needs the model (context, vocabulary), queue the request with
the engine and await its chunks; they never wait on the model thread. A client that disconnects
cancels its request. Every error is answered in the OpenAI shape; bad input is always a 4xx
(FastAPI's 422 for validation becomes 400).
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager, suppress

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InvalidInput
from ..generate import Generator
from ..sampling import SamplingParams
from ..spec.metrics import SpecMetrics
from .engine import Chunk, Engine, Request
from . import MAX_BODY
from .guard import Guard
from .metrics import ServerMetrics
from .policy import SpecPolicy
from .protocol import (
    APIError,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletion,
    ChatMessageOut,
    ChatRequest,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    SamplingRequest,
    SpecUsage,
    TextChoice,
    TextCompletion,
    Usage,
    new_id,
    now,
    validation_error,
)

log = logging.getLogger("eaglet.server")


class ClientGone(Exception):
    pass


def usage(prompt_tokens: int, completion_tokens: int, spec: SpecMetrics | None) -> Usage:
    u = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
              total_tokens=prompt_tokens + completion_tokens)
    if spec is not None:
        u.accept_length = spec.accept_length
        u.spec_decode = SpecUsage(num_drafts=spec.drafts, num_draft_tokens=spec.draft_tokens,
                                  num_accepted_tokens=spec.accepted_tokens)
    return u


def sse(obj) -> str:
    text = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {text}\n\n"


async def wait_disconnect(request: HTTPRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(generator: Generator, model_name: str, max_batch: int = 8, max_queue: int = 256,
              max_len: int | None = None, policy: SpecPolicy | None = None, api_key: str | None = None,
              max_body: int = MAX_BODY, multi_step: int | None = None, spec_multi_step: int = 1,
              channel=None) -> FastAPI:
    """The app and its engine in this process (started and stopped with the app's lifespan);
    `max_len` is each row's context (prompt + generated), at most the model's; `policy` chooses
    plain or a speculation setting per batch (default: always the generator's own); `api_key` and
    `max_body` are what guard.py checks before any route; `multi_step` and `spec_multi_step`: the
    decoder steps a host round trip, plain and speculating (Engine); `channel`: the engine leads
    tensor-parallel ranks (dist/follow.py)."""
    return serve_app(make_engine(generator, model_name, max_batch, max_queue, max_len, policy, multi_step,
                                 spec_multi_step, channel), api_key, max_body)


def make_engine(generator: Generator, model_name: str, max_batch: int = 8, max_queue: int = 256,
                max_len: int | None = None, policy: SpecPolicy | None = None, multi_step: int | None = None,
                spec_multi_step: int = 1, channel=None) -> Engine:
    """A server's engine, not started (build_app's arguments), with its own Prometheus metrics."""
    if generator.tokenizer is None:
        raise InvalidInput("serving needs a tokenizer; the model directory has none")
    max_len = min(max_len or generator.context, generator.context)
    return Engine(generator, max_batch, max_queue, max_len, ServerMetrics(model_name), policy, multi_step,
                  spec_multi_step, channel)


def serve_app(engine, api_key: str | None = None, max_body: int = MAX_BODY) -> FastAPI:
    """The routes around an engine: an Engine (its thread in this process) or a remote.EngineClient
    (the engine in a process of its own), which offer the same calls."""
    tok, vocab, max_len, model_name = engine.tokenizer, engine.vocab, engine.max_len, engine.name

    @asynccontextmanager
    async def lifespan(app):
        if not engine.thread.is_alive():
            t0 = time.perf_counter()
            if n := engine.warmup():
                print(f"[eaglet] warm-up: {n} CUDA graphs captured in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr)
            # what the process holds now (model, tokenizer, libraries, graphs) lives as long as the
            # server: out of the collector's sight, so a full collection under load stops every
            # thread for milliseconds, not hundreds of them (metrics.py, gc_pause_seconds)
            gc.collect()
            gc.freeze()
            engine.start()
        yield
        engine.shutdown()
        gc.unfreeze()  # collectable again at exit (extensions report frozen objects as leaked)

    app = FastAPI(title="eaglet", lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(Guard, api_key=api_key, max_body=max_body)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), e.status_code)

    @app.exception_handler(Exception)
    async def internal(_, e: Exception):
        log.exception("internal error")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", "internal_error").body(), 500)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def make_request(body: SamplingRequest, prompt: list[int], max_tokens: int | None, explicit: bool) -> Request:
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        room = max_len - len(prompt)
        if room < 1:
            raise APIError(400, f"the prompt is {len(prompt)} tokens but the context is {max_len} (at least one "
                                "token must remain to generate)", param="messages" if hasattr(body, "messages")
                           else "prompt", code="context_length_exceeded")
        if max_tokens is None or (not explicit and max_tokens > room):
            max_tokens = room
        if max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens} + the prompt's {len(prompt)} tokens exceed the context "
                                f"of {max_len}", param="max_tokens", code="context_length_exceeded")
        t = 1.0 if body.temperature is None else body.temperature
        sampling = (SamplingParams(0.0) if t == 0 else  # greedy: top-k, top-p and seed change nothing
                    SamplingParams(t, max(body.top_k, 0), 1.0 if body.top_p is None else body.top_p, body.seed))
        return Request(prompt, max_tokens, sampling, body.stop_strings, body.ignore_eos)

    async def run(req: Request, request: HTTPRequest) -> tuple[str, Chunk]:
        """Whole completion: (text, last chunk); a disconnect cancels it."""
        async def collect():
            text = []
            async with aclosing(engine.chunks(req)) as chunks:
                async for c in chunks:
                    if c.error:
                        raise c.error
                    text.append(c.text)
            return "".join(text), c

        task, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(wait_disconnect(request))
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if task not in done:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            raise ClientGone
        return task.result()

    async def stream(req: Request, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()

        def chunk(text: str | None, finish: str | None = None, role: bool = False):
            if chat:
                return ChatChunk(id=rid, created=created, model=model_name, choices=[ChatChunkChoice(
                    delta=Delta(role="assistant" if role else None, content=text), finish_reason=finish)])
            return TextCompletion(id=rid, created=created, model=model_name,
                                  choices=[TextChoice(text=text or "", finish_reason=finish)])

        # a text chunk's JSON is rendered once with a marker and each event splices its text in:
        # pydantic per chunk is a visible share of the event loop's time at 64 streams
        head, tail = sse(chunk("\0")).split('"\\u0000"')
        if chat:
            yield sse(chunk("", role=True))
        async with aclosing(engine.chunks(req)) as chunks:
            async for c in chunks:
                if c.error:
                    yield sse(c.error.body())
                    break
                if c.text:
                    yield head + json.dumps(c.text, ensure_ascii=False) + tail
                if c.finish_reason:
                    yield sse(chunk(None if chat else "", c.finish_reason))
                    if include_usage:
                        u = usage(len(req.prompt), c.completion_tokens, c.spec)
                        final = (ChatChunk if chat else TextCompletion)(id=rid, created=created, model=model_name,
                                                                        choices=[], usage=u)
                        yield sse(final)
        yield "data: [DONE]\n\n"

    async def respond(req: Request, request: HTTPRequest, chat: bool, body: SamplingRequest):
        engine.open(req)
        if body.stream:
            return StreamingResponse(stream(req, chat, body.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            text, last = await run(req, request)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        u = usage(len(req.prompt), last.completion_tokens, last.spec)
        if chat:
            return ChatCompletion(id=new_id("chatcmpl"), created=now(), model=model_name, usage=u, choices=[
                ChatChoice(message=ChatMessageOut(content=text), finish_reason=last.finish_reason)])
        return TextCompletion(id=new_id("cmpl"), created=now(), model=model_name, usage=u,
                              choices=[TextChoice(text=text, finish_reason=last.finish_reason)])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: HTTPRequest):
        check_model(body.model)
        try:
            prompt = tok.apply_chat([m.as_template_dict() for m in body.messages])
        except (InvalidInput, TemplateError, ValueError) as e:
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await respond(make_request(body, prompt, max_tokens, max_tokens is not None), request, True, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        check_model(body.model)
        prompt = tok.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        req = make_request(body, prompt, body.max_tokens, "max_tokens" in body.model_fields_set)
        return await respond(req, request, False, body)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=model_name, created=now(), max_model_len=max_len)])

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, "the engine is not running", "server_error", code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(await engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app
