"""Spexis' guard on SGLang's HTTP app: limits before a request is parsed, errors that leak
nothing, and ``Retry-After`` on 503.

Installed by the launcher on SGLang's module-level FastAPI ``app`` (its own extension points:
an ASGI middleware and exception handlers) before uvicorn starts; SGLang's files are not
changed. What it does (decisions in :mod:`.request_checks`):

* the OpenAI generation routes' JSON body is checked before SGLang parses it: an unknown
  ``model`` answers 404 like OpenAI's API (unless ``--spexis-accept-any-model``), ``n`` beyond
  the limit and ``max_tokens`` / ``max_completion_tokens`` below 1 answer 400;
* request validation errors (invalid JSON, wrong field types) answer 400 with the fields and
  the problem only: FastAPI's ``str(exc)`` quotes SGLang's source frame
  (``File ".../http_server.py", line 1702``);
* every error body (status >= 400, not streamed) is scrubbed of tracebacks, source frames and
  the server's own file paths; an unhandled exception answers a JSON 500 without details;
* every 503 (SGLang's "The request queue is full." under ``--max-queued-requests``) carries
  ``Retry-After``.
"""

from __future__ import annotations

import logging
import os
import site
import sys
from http import HTTPStatus
from typing import Callable, Iterable, List, Optional

import orjson

from spexis_sglang.srt.request_checks import (
    OPENAI_GENERATION_ROUTES,
    RETRY_AFTER_S,
    RequestError,
    RequestLimits,
    openai_request_error,
    scrub_error_text,
    validation_message,
)

logger = logging.getLogger(__name__)

# bodies larger than this are passed to SGLang unchecked (its own limits apply)
_MAX_CHECKED_BODY = 64 * 2**20


def server_paths() -> List[str]:
    """Directories whose paths an error body must not show: the Python installation (SGLang's
    and our sources), the working directory and the home directory."""
    import spexis_sglang

    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.getcwd(), os.path.expanduser("~")]
    paths += site.getsitepackages() + [site.getusersitepackages()]
    paths.append(os.path.dirname(os.path.dirname(os.path.abspath(spexis_sglang.__file__))))
    return sorted({p for p in paths if p and p != os.sep}, key=len, reverse=True)


def error_body(path: str, error: RequestError) -> dict:
    """The body of a refused request, in the shape the route's other errors have: OpenAI's
    ``{"error": {...}}`` for a 404 (as ``/v1/models/{model}`` answers), SGLang's
    ``ErrorResponse`` on its OpenAI routes, ``{"error": {"message"}}`` on ``/generate``."""
    if error.status == HTTPStatus.NOT_FOUND:
        return {
            "error": {
                "message": error.message,
                "type": "invalid_request_error",
                "param": error.param,
                "code": error.code,
            }
        }
    if path.startswith("/v1/"):
        return {
            "object": "error",
            "message": error.message,
            "type": "BadRequest",
            "param": error.param,
            "code": error.status,
        }
    return {"error": {"message": error.message}}


def _route(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _send_json(send, status: int, body: dict, headers: Iterable = ()) -> None:
    payload = orjson.dumps(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def _scrub_json(value, paths: List[str]):
    if isinstance(value, str):
        return scrub_error_text(value, paths)
    if isinstance(value, list):
        return [_scrub_json(v, paths) for v in value]
    if isinstance(value, dict):
        return {k: _scrub_json(v, paths) for k, v in value.items()}
    return value


def scrub_error_body(body: bytes, content_type: str, paths: List[str]) -> bytes:
    """An error response's body without tracebacks or server paths (JSON stays JSON)."""
    if "json" in content_type:
        try:
            return orjson.dumps(_scrub_json(orjson.loads(body), paths))
        except orjson.JSONDecodeError:
            pass
    return scrub_error_text(body.decode("utf-8", "replace"), paths).encode()


class RequestGuard:
    """ASGI middleware: request checks on the OpenAI generation routes, scrubbed error bodies,
    ``Retry-After`` on 503."""

    def __init__(
        self,
        app,
        limits: Callable[[], RequestLimits],
        accepted_models: Callable[[], Optional[Iterable[str]]],
        paths: Optional[List[str]] = None,
    ):
        self.app = app
        self.limits = limits
        self.accepted_models = accepted_models
        self.paths = server_paths() if paths is None else paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = _route(scope)
        if scope.get("method") == "POST" and route in OPENAI_GENERATION_ROUTES:
            messages, body = await _read_body(receive)
            error = self._check(route, body)
            if error is not None:
                return await _send_json(send, error.status, error_body(route, error))
            receive = _replay(messages, receive)
        await self.app(scope, receive, self._guarded_send(send))

    def _check(self, route: str, body: Optional[bytes]) -> Optional[RequestError]:
        if body is None:
            return None
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None  # SGLang's request validation answers (scrubbed) 400
        return openai_request_error(route, parsed, self.limits(), self.accepted_models())

    def _guarded_send(self, send):
        held = {}

        async def guarded(message):
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers") or [])
                if status == HTTPStatus.SERVICE_UNAVAILABLE:
                    headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
                message = {**message, "headers": headers}
                if status >= 400:
                    held["start"], held["body"] = message, []
                    return
                return await send(message)
            if message["type"] == "http.response.body" and "start" in held:
                held["body"].append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await self._send_scrubbed(send, held.pop("start"), b"".join(held.pop("body")))
                return
            return await send(message)

        return guarded

    async def _send_scrubbed(self, send, start: dict, body: bytes) -> None:
        headers = dict(start["headers"])
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        body = scrub_error_body(body, content_type, self.paths)
        headers[b"content-length"] = str(len(body)).encode()
        await send({**start, "headers": list(headers.items())})
        await send({"type": "http.response.body", "body": body})


async def _read_body(receive):
    """The request's messages (to replay) and its body (None when too large to check)."""
    messages, size, chunks = [], 0, []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, None
        chunk = message.get("body", b"")
        size += len(chunk)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
        if size > _MAX_CHECKED_BODY:
            return messages, None
    return messages, b"".join(chunks)


def _replay(messages: list, receive):
    """``receive`` that hands out the messages read already, then the client's own (which
    also reports a disconnect while a response streams)."""
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def install(
    app,
    limits: Callable[[], RequestLimits],
    accepted_models: Callable[[], Optional[Iterable[str]]],
    paths: Optional[List[str]] = None,
) -> None:
    """Add the guard and the error handlers to SGLang's ``app`` (before it starts).
    ``paths``: what error bodies must not show (default :func:`server_paths`)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    sglang_validation_handler = app.exception_handlers.get(RequestValidationError)

    async def on_validation_error(request, exc):
        route = request.url.path
        if route.startswith("/v1/messages") and sglang_validation_handler is not None:
            return await sglang_validation_handler(request, exc)  # already scrubbed upstream
        message = validation_message(exc.errors())
        if route.startswith("/v1/responses"):
            body = {
                "error": {
                    "message": message,
                    "type": HTTPStatus.BAD_REQUEST.phrase,
                    "param": None,
                    "code": HTTPStatus.BAD_REQUEST.value,
                }
            }
        else:
            body = {
                "object": "error",
                "message": message,
                "type": HTTPStatus.BAD_REQUEST.phrase,
                "param": None,
                "code": HTTPStatus.BAD_REQUEST.value,
            }
        return JSONResponse(status_code=HTTPStatus.BAD_REQUEST, content=body)

    async def on_unhandled_error(request, exc):
        # Starlette re-raises the exception after this response: the log gets the traceback
        return JSONResponse(
            status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
            content={
                "object": "error",
                "message": "Internal server error (the server log has the details)",
                "type": "InternalServerError",
                "param": None,
                "code": HTTPStatus.INTERNAL_SERVER_ERROR.value,
            },
        )

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unhandled_error)
    app.add_middleware(RequestGuard, limits=limits, accepted_models=accepted_models, paths=paths)
