"""What a request must pass before a route sees it (server/guard.py): the API key on /v1 routes,
not on /health and /metrics; the body size limit, declared or chunked."""
import json

import httpx
import openai
import pytest

from eaglet.generate import Generator

from .serving import LiveServer


def test_api_key_guards_the_api_not_health_or_metrics(tiny):
    """--api-key: no key, a wrong key, another scheme and a bare token each get 401 in the OpenAI
    shape; /health and /metrics stay open; the openai client with the key works."""
    with LiveServer(Generator(tiny.model, tiny.tokenizer), api_key="s3cret") as srv:
        body = {"model": "tiny", "prompt": "the", "max_tokens": 2, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                        {"Authorization": "s3cret"}, {"Authorization": "Bearer"}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                r = httpx.request(method, srv.url + path, json=body if method == "POST" else None, headers=headers)
                assert r.status_code == 401, (headers, path)
                assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["message"]
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            srv.client().completions.create(**body)
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(**body).usage.completion_tokens == 2
        assert [m.id for m in ok.models.list()] == ["tiny"]


def test_bodies_over_the_limit_get_413(tiny):
    """A declared Content-Length over the limit is refused before the body is read; a chunked body
    that passes it is refused too; the server goes on serving."""
    with LiveServer(Generator(tiny.model, tiny.tokenizer), max_body=4096) as srv:
        big = json.dumps({"model": "tiny", "prompt": "x " * 5000, "max_tokens": 2}).encode()
        r = httpx.post(srv.url + "/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]

        def chunks():
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]
        r = httpx.post(srv.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 2})
        assert r.status_code == 200
