"""The HTTP guard on a FastAPI app shaped like SGLang's: checks before the route runs, error
bodies without tracebacks or server paths, ``Retry-After`` on 503."""

from __future__ import annotations

from typing import List

import pytest
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel

from spexis_sglang.srt import http_guard
from spexis_sglang.srt.request_checks import RETRY_AFTER_S, RequestLimits

SERVER_DIR = "/opt/server/site-packages"


class Chat(BaseModel):
    model: str = "default"
    messages: List[dict]
    max_tokens: int = 16


@pytest.fixture
def client():
    app = FastAPI()
    seen = []

    @app.post("/v1/chat/completions")
    async def chat(request: Chat, raw: Request):
        seen.append(request)
        return {"ok": True, "disconnected": await raw.is_disconnected()}

    @app.post("/generate")
    async def generate(raw: Request):
        kind = (await raw.json())["kind"]
        if kind == "full":
            raise HTTPException(status_code=503, detail="The request queue is full.")
        if kind == "crash":
            raise RuntimeError(f"cannot open {SERVER_DIR}/sglang/srt/x.py")
        if kind == "leaky":
            return JSONResponse(
                status_code=400,
                content={
                    "error": {
                        "message": (
                            "bad\nTraceback (most recent call last):\n"
                            f'  File "{SERVER_DIR}/a.py", line 3, in f'
                        )
                    }
                },
            )
        if kind == "stream":
            return StreamingResponse(iter([b"data: 1\n\n", b"data: 2\n\n"]))
        return {"ok": True}

    limits = RequestLimits(max_n=4, max_sequences=8)
    http_guard.install(app, lambda: limits, lambda: ["m", "default"], paths=[SERVER_DIR])
    client = TestClient(app, raise_server_exceptions=False)
    client.seen = seen
    return client


def test_requests_within_the_limits_reach_the_route_with_their_body(client):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"a": 1}], "n": 4})
    assert r.status_code == 200 and r.json() == {"ok": True, "disconnected": False}
    assert client.seen[0].messages == [{"a": 1}]


def test_refused_requests_never_reach_the_route(client):
    r = client.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": []})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/chat/completions", json={"messages": [], "n": 5})
    assert r.status_code == 400
    assert r.json() == {
        "object": "error",
        "message": "n must be between 1 and 4, got 5",
        "type": "BadRequest",
        "param": "n",
        "code": 400,
    }
    r = client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 0})
    assert (r.status_code, r.json()["message"]) == (400, "max_tokens must be at least 1, got 0")
    assert client.seen == []


def test_invalid_json_names_the_position_not_the_source_frame(client):
    r = client.post(
        "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    message = r.json()["message"]
    assert message.startswith("the request body is not valid JSON at character 14")
    assert "File" not in r.text and ".py" not in r.text
    r = client.post("/v1/chat/completions", json={"messages": "hi"})
    assert (r.status_code, r.json()["message"]) == (400, "messages: Input should be a valid list")


def test_a_full_queue_answers_503_with_retry_after(client):
    r = client.post("/generate", json={"kind": "full"})
    assert r.status_code == 503
    assert r.headers["retry-after"] == str(RETRY_AFTER_S)
    assert "The request queue is full." in r.text


def test_error_bodies_carry_no_traceback_or_server_path(client):
    r = client.post("/generate", json={"kind": "crash"})
    assert r.status_code == 500
    assert r.json()["message"] == "Internal server error (the server log has the details)"
    r = client.post("/generate", json={"kind": "leaky"})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "bad"}}
    assert int(r.headers["content-length"]) == len(r.content)


def test_successful_and_streamed_responses_pass_unchanged(client):
    assert client.post("/generate", json={"kind": "ok"}).json() == {"ok": True}
    assert client.post("/generate", json={"kind": "stream"}).content == b"data: 1\n\ndata: 2\n\n"
