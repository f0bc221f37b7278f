"""What one request may ask of the server, and what an error body may say (pure Python).

A single request must not take the server down: SGLang 0.5.17 fans ``n`` out into ``n``
requests before anything bounds it (a chat request with ``n=100000`` queued ~98,000 requests,
blocked the HTTP process and tripped the scheduler watchdog), and its OpenAI routes accept any
model name and treat ``max_tokens: 0`` differently on chat and completions. These functions
decide; :mod:`.http_guard` and :mod:`.tokenizer_manager` apply them. The limits are documented
in ``docs/limits-and-errors.md``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Optional, Tuple

#: OpenAI's own limit on ``n``
DEFAULT_MAX_N = 128
#: prompts x ``n`` of one request; a GPU decode benchmark sends 512 prompts in one /generate
DEFAULT_MAX_REQUEST_SEQUENCES = 1024
#: SGLang's ``--max-queued-requests`` unless given: beyond it a request answers 503
DEFAULT_MAX_QUEUED_REQUESTS = 1024
#: seconds a client is told to wait (``Retry-After``) after a 503
RETRY_AFTER_S = 5
#: the model name every OpenAI route accepts for the one model served (SGLang's default for an
#: omitted ``model`` field)
DEFAULT_MODEL_ALIAS = "default"
#: the OpenAI generation routes whose JSON body is checked before SGLang parses it
OPENAI_GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
_MAX_ECHO = 40


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The server's limits on one request."""

    #: the largest ``n`` (parallel samples of one prompt)
    max_n: int = DEFAULT_MAX_N
    #: the most sequences one request may fan out to (prompts x ``n``)
    max_sequences: int = DEFAULT_MAX_REQUEST_SEQUENCES


@dataclasses.dataclass(frozen=True)
class RequestError:
    """A refused request: HTTP status, message, and OpenAI's ``param`` / ``code`` fields."""

    status: int
    message: str
    param: Optional[str] = None
    code: Optional[str] = None


def _echo(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_ECHO else text[: _MAX_ECHO - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def n_error(n: Any, limits: RequestLimits) -> Optional[str]:
    """``n`` must be an integer in [1, max_n] (None: the default, 1)."""
    if n is None:
        return None
    if not _is_int(n):
        return f"n must be an integer, got {_echo(n)}"
    if not 1 <= n <= limits.max_n:
        return f"n must be between 1 and {limits.max_n}, got {n}"
    return None


def fanout_error(prompts: int, n: int, limits: RequestLimits) -> Optional[str]:
    """One request may not fan out to more than ``max_sequences`` sequences."""
    total = prompts * n
    if total <= limits.max_sequences:
        return None
    return (
        f"this request asks for {total} sequences ({prompts} prompts x n={n}); the server "
        f"takes at most {limits.max_sequences} per request"
    )


def batch_size(prompt: Any) -> int:
    """Prompts in a ``text`` / ``input_ids`` / OpenAI ``prompt`` value: a string or a list of
    token ids is one prompt, a list of strings or of id lists is several."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def generate_fanout_error(text: Any, input_ids: Any, sampling_params: Any, limits) -> Optional[str]:
    """``n`` and the fan-out of a native ``/generate`` request, before SGLang expands it."""
    params = sampling_params
    if isinstance(params, list):
        params = params[0] if params else None
    n = params.get("n") if isinstance(params, dict) else None
    error = n_error(n, limits)
    if error is not None:
        return error
    prompts = batch_size(text if text is not None else input_ids)
    return fanout_error(prompts, n or 1, limits)


def accepted_model_names(served_model_name: str, model_path: str) -> Tuple[str, ...]:
    """The names the OpenAI routes accept: the served name, the model path it is loaded from
    (SGLang's served name when none is given), and :data:`DEFAULT_MODEL_ALIAS`."""
    names = [served_model_name, model_path, DEFAULT_MODEL_ALIAS]
    return tuple(dict.fromkeys(n for n in names if n))


def model_error(model: Any, accepted: Iterable[str]) -> Optional[RequestError]:
    """An unknown model name answers 404, as OpenAI's API does; the message names the first
    accepted name (the served one: never the model's path). ``name:adapter`` (SGLang's LoRA
    syntax) is judged by its base name."""
    if not isinstance(model, str):
        return None  # absent (SGLang's default applies) or mistyped (request validation says so)
    accepted = list(accepted)
    if model in accepted or model.split(":", 1)[0] in accepted:
        return None
    served = f"; this server serves {accepted[0]!r}" if accepted else ""
    return RequestError(
        404,
        f"The model {_echo(model)} does not exist{served}",
        param="model",
        code="model_not_found",
    )


def openai_request_error(
    path: str, body: Any, limits: RequestLimits, accepted_models: Optional[Iterable[str]]
) -> Optional[RequestError]:
    """The checks SGLang's OpenAI routes lack, on the request's JSON body (``accepted_models``
    None: any model name is accepted). Malformed bodies are left to SGLang's validation."""
    if not isinstance(body, dict):
        return None
    if accepted_models is not None:
        error = model_error(body.get("model"), accepted_models)
        if error is not None:
            return error
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        # SGLang's chat route reads 0 as "no limit", its completions route refuses it
        if _is_int(value) and value < 1:
            return RequestError(400, f"{key} must be at least 1, got {value}", param=key)
    n = body.get("n")
    message = n_error(n, limits)
    if message is None:
        prompts = batch_size(body.get("prompt")) if path == "/v1/completions" else 1
        message = fanout_error(prompts, n if _is_int(n) else 1, limits)
    if message is not None:
        return RequestError(400, message, param="n")
    return None


def hidden_states_error(requested: bool, pp_size: int) -> Optional[str]:
    """``return_hidden_states`` under pipeline parallelism: SGLang 0.5.17's result processing
    reads hidden states that only the last stage has, and the failure kills every rank."""
    if requested and pp_size > 1:
        return (
            "return_hidden_states is not supported with pipeline parallelism (this server runs "
            f"--pp-size {pp_size}); serve with --pp-size 1 to get hidden states"
        )
    return None


def input_embeds_error(
    embeds: Any, hidden_size: int, dtype_name: str, context_len: int
) -> Optional[str]:
    """``input_embeds`` of one request. SGLang 0.5.17 casts them to bfloat16 before the forward
    (``ModelRunner``), so a model in another dtype fails its first layer, and an embedding of
    the wrong width fails it too: either takes every rank down. Their count is not checked
    against the context length either."""
    if embeds is None:
        return None
    if dtype_name != "bfloat16":
        without = " and without --spexis-float64" if dtype_name == "float64" else ""
        return (
            "input_embeds needs a bfloat16 model (SGLang casts them to bfloat16); this server "
            f"runs {dtype_name}: serve with --dtype bfloat16{without} to send input_embeds"
        )
    if not isinstance(embeds, list) or not embeds:
        return "input_embeds must be a non-empty list of embeddings (lists of floats)"
    for i, row in enumerate(embeds):
        if not isinstance(row, list) or len(row) != hidden_size:
            got = f"{len(row)} values" if isinstance(row, list) else _echo(row)
            return (
                f"input_embeds[{i}] must be a list of {hidden_size} floats (the model's hidden "
                f"size), got {got}"
            )
    if len(embeds) >= context_len:
        return (
            f"The input ({len(embeds)} embeddings) is longer than the model's context length "
            f"({context_len} tokens)."
        )
    return None


_TRACEBACK = re.compile(r"Traceback \(most recent call last\):.*", re.DOTALL)
_FRAME = re.compile(r'\s*File "[^"\n]*", line \d+(?:, in [^\n]*)?(?:\n[ \t]+[^\n]*)?')


def scrub_error_text(text: str, server_paths: Iterable[str] = ()) -> str:
    """An error message without tracebacks, source frames or the server's own file paths.

    FastAPI's validation errors quote the endpoint's source frame (``File ".../http_server.py",
    line 1702``); SGLang's 500s carry ``str(exception)``. Whatever a client sent is echoed as
    it was.
    """
    text = _TRACEBACK.sub("", text)
    text = _FRAME.sub("", text)
    for path in sorted((p for p in server_paths if p and len(p) > 1), key=len, reverse=True):
        text = text.replace(path, "<server>")
    return text.strip()


def validation_message(errors: Iterable[dict]) -> str:
    """FastAPI / pydantic validation errors as one line: ``field: problem; ...`` (never the
    input echoed whole, nor the source frame ``str(exc)`` carries)."""
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc") or () if p != "body"]
        msg = str(err.get("msg") or "invalid value").strip()
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error")
            where = f" at character {loc[-1]}" if loc else ""
            parts.append(
                f"the request body is not valid JSON{where}" + (f": {reason}" if reason else "")
            )
            continue
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    text = "; ".join(parts) or "invalid request"
    return text if len(text) <= 500 else text[:497] + "..."
