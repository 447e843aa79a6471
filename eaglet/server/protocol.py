"""The OpenAI API as pydantic models: chat and text completion requests (strictly typed, so a string
where a number belongs is a 400, not a coercion), their responses and stream chunks, and the
OpenAI error shape {"error": {"message", "type", "param", "code"}}.

Extensions, as vLLM names them: `top_k`, `ignore_eos` in requests; in `usage`, `accept_length`
(τ: tokens per verify step, bonus counted) and `spec_decode` (the request's draft counters) when
the server speculates. Checks that need the model (context length, vocabulary) are the app's.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class APIError(Exception):
    """An error answered in the OpenAI shape with its HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self):  # whole through a pickle (an engine process's chunks: remote.py)
        return APIError, (self.status, self.message, self.type, self.param, self.code)


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "literal"}


def param_of(loc: tuple) -> str | None:
    """'messages.[0].content' from pydantic's ('body', 'messages', 0, 'content', 'str')."""
    parts = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p.isidentifier() and p not in TYPE_TAGS:
            parts.append(p)
        else:
            break
    return ".".join(parts) or None


def validation_error(errors: list[dict]) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors, as a 400."""
    e = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if e.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})")
    param = param_of(tuple(e.get("loc", ())))
    msg = e["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


# ---- requests -----------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as vLLM does."""
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)  # None: OpenAI's default, 1
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**64)  # what torch.Generator.manual_seed takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @field_validator("n")
    @classmethod
    def one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported (use 0)")
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in stop if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False

    @field_validator("logprobs")
    @classmethod
    def no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported")
        return v


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, p):
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("one prompt per request (a list of prompts is not supported)")
            p = p[0]
        if len(p) == 0:
            raise ValueError("the prompt is empty")
        return p

    @field_validator("echo", "logprobs", "best_of")
    @classmethod
    def unsupported(cls, v, info):
        if v is True or (info.field_name == "logprobs" and v is not None) or (info.field_name == "best_of"
                                                                              and v not in (None, 1)):
            raise ValueError(f"{info.field_name} is not supported")
        return v


# ---- responses ----------------------------------------------------------------------------------

class SpecUsage(BaseModel):
    num_drafts: int  # verify steps
    num_draft_tokens: int
    num_accepted_tokens: int  # drafted tokens accepted (bonus not counted)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    accept_length: float | None = None  # τ = 1 + accepted / drafts; None without speculation
    spec_decode: SpecUsage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class TextCompletion(BaseModel):
    """A whole completion and, streamed, each chunk (OpenAI uses one object type for both)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "eaglet"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
