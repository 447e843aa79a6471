"""What a request must pass before a route sees it (an ASGI middleware around the app):

- an API key (`eaglet serve --api-key KEY`, or EAGLET_API_KEY): every /v1 route asks for
  `Authorization: Bearer KEY` and answers 401 in the OpenAI error shape without it; /health and
  /metrics stay open for probes and scrapers, as in vLLM;
- a body size limit: a declared Content-Length over it gets 413 at once, before the body is read;
  a body without one (chunked) gets 413 as soon as what has arrived passes the limit.
"""
from __future__ import annotations

import hmac
import json

from fastapi import HTTPException

from . import MAX_BODY
from .protocol import APIError


async def reply(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app, api_key: str | None = None, max_body: int = MAX_BODY):
        self.app, self.api_key, self.max_body = app, api_key or None, max_body

    def denied(self, headers: dict[bytes, bytes]) -> APIError | None:
        auth = headers.get(b"authorization")
        if auth is None:
            return APIError(401, "no API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
        scheme, _, key = auth.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return APIError(401, "malformed Authorization header: expected 'Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            return APIError(401, "incorrect API key", code="invalid_api_key")
        return None

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is over {self.max_body} bytes", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1"):
            if (err := self.denied(headers)) is not None:
                return await reply(send, err)
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await reply(send, APIError(400, "Content-Length is not a number"))
            if int(declared) > self.max_body:
                return await reply(send, self.too_large())
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:  # FastAPI passes HTTPException through its body parsing
                    raise HTTPException(413, self.too_large().message)
            return msg

        await self.app(scope, limited, send)
