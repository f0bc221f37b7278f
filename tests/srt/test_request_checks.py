"""What one request may ask of the server, and what an error body may show (pure functions)."""

from __future__ import annotations

import pytest

from spexis_sglang.srt.request_checks import (
    DEFAULT_MAX_N,
    RequestLimits,
    accepted_model_names,
    generate_fanout_error,
    hidden_states_error,
    input_embeds_error,
    model_error,
    openai_request_error,
    scrub_error_text,
    validation_message,
)

LIMITS = RequestLimits(max_n=128, max_sequences=1024)
NAMES = accepted_model_names("smollm2-135m-instruct", "/models/smollm2-135m-instruct")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(**fields) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_openais_limit_on_n_is_the_default():
    assert DEFAULT_MAX_N == 128 == RequestLimits().max_n


@pytest.mark.parametrize(
    "n, message",
    [
        (100000, "n must be between 1 and 128, got 100000"),
        (129, "n must be between 1 and 128, got 129"),
        (0, "n must be between 1 and 128, got 0"),
        (-1, "n must be between 1 and 128, got -1"),
        ("3", "n must be an integer, got '3'"),
        (True, "n must be an integer, got True"),
        (2.5, "n must be an integer, got 2.5"),
    ],
)
def test_n_outside_the_limit_is_refused_on_every_route(n, message):
    for route, body in ((CHAT, chat(n=n)), (COMPLETIONS, {"prompt": "Hi", "n": n})):
        error = openai_request_error(route, body, LIMITS, NAMES)
        assert (error.status, error.message, error.param) == (400, message, "n")
    assert generate_fanout_error("Hi", None, {"n": n}, LIMITS) == message


@pytest.mark.parametrize("n", [None, 1, 2, 128])
def test_n_within_the_limit_passes(n):
    assert openai_request_error(CHAT, chat(n=n), LIMITS, NAMES) is None
    assert generate_fanout_error("Hi", None, {"n": n}, LIMITS) is None


def test_a_request_may_not_fan_out_beyond_the_sequence_limit():
    limits = RequestLimits(max_n=128, max_sequences=256)
    over = "this request asks for 300 sequences (3 prompts x n=100); the server takes at most 256"
    assert generate_fanout_error(["a", "b", "c"], None, {"n": 100}, limits).startswith(over)
    ids = [[1, 2]] * 3
    assert generate_fanout_error(None, ids, [{"n": 100}] * 3, limits).startswith(over)
    error = openai_request_error(COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 100}, limits, None)
    assert error.message.startswith(over)
    # a prompt of token ids is one prompt; 257 prompts without n are too many as well
    assert generate_fanout_error(None, [1] * 300, {"n": 2}, limits) is None
    assert "257 sequences (257 prompts x n=1)" in generate_fanout_error(
        ["x"] * 257, None, None, limits
    )


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -5])
def test_max_tokens_below_one_is_refused_alike_on_chat_and_completions(route, key, value):
    body = chat(**{key: value}) if route == CHAT else {"prompt": "Hi", key: value}
    error = openai_request_error(route, body, LIMITS, NAMES)
    assert (error.status, error.message, error.param) == (
        400,
        f"{key} must be at least 1, got {value}",
        key,
    )
    assert openai_request_error(route, {**body, key: 1}, LIMITS, NAMES) is None


@pytest.mark.parametrize(
    "model",
    ["default", "smollm2-135m-instruct", "/models/smollm2-135m-instruct", "default:my-adapter"],
)
def test_the_served_names_are_accepted(model):
    assert model_error(model, NAMES) is None
    assert openai_request_error(CHAT, chat(model=model), LIMITS, NAMES) is None


def test_an_unknown_model_answers_404_like_openai():
    error = openai_request_error(CHAT, chat(model="gpt-4o"), LIMITS, NAMES)
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    # the served name, never the model's path
    assert (
        error.message
        == "The model 'gpt-4o' does not exist; this server serves 'smollm2-135m-instruct'"
    )
    # the check comes first: a request for another model is not judged by this one's limits
    assert openai_request_error(CHAT, chat(model="gpt-4o", n=10**5), LIMITS, NAMES).status == 404
    # accepted_models None: any name (--spexis-accept-any-model)
    assert openai_request_error(CHAT, chat(model="gpt-4o"), LIMITS, None) is None


def test_malformed_bodies_are_left_to_sglangs_validation():
    assert openai_request_error(CHAT, [1, 2], LIMITS, NAMES) is None
    assert openai_request_error(CHAT, chat(model=5), LIMITS, NAMES) is None
    assert openai_request_error(CHAT, chat(max_tokens="x"), LIMITS, NAMES) is None


def test_hidden_states_are_refused_under_pipeline_parallelism_only():
    assert hidden_states_error(True, 1) is None
    assert hidden_states_error(False, 2) is None
    assert hidden_states_error(True, 2) == (
        "return_hidden_states is not supported with pipeline parallelism (this server runs "
        "--pp-size 2); serve with --pp-size 1 to get hidden states"
    )


def test_validation_errors_name_the_field_and_never_the_source_frame():
    json_error = [
        {
            "type": "json_invalid",
            "loc": ("body", 34),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": "unexpected end of data"},
        }
    ]
    assert validation_message(json_error) == (
        "the request body is not valid JSON at character 34: unexpected end of data"
    )
    errors = [
        {"type": "list_type", "loc": ("body", "messages"), "msg": "Input should be a valid list"},
        {
            "type": "value_error",
            "loc": ("body", "max_tokens"),
            "msg": "Value error, max_tokens must be positive",
            "input": 0,
        },
    ]
    assert validation_message(errors) == (
        "messages: Input should be a valid list; max_tokens: max_tokens must be positive"
    )


def test_scrubbing_removes_tracebacks_frames_and_server_paths():
    sglang_validation_error = (
        "1 validation error:\n  {'type': 'json_invalid', 'loc': ('body', 34)}\n\n"
        '  File "/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/http_server.py", '
        "line 1702, in openai_v1_chat_completions\n    POST /v1/chat/completions [...]"
    )
    assert scrub_error_text(sglang_validation_error) == (
        "1 validation error:\n  {'type': 'json_invalid', 'loc': ('body', 34)}"
    )
    trace = 'boom\nTraceback (most recent call last):\n  File "/x.py", line 1, in f\nValueError'
    assert scrub_error_text(trace) == "boom"
    assert (
        scrub_error_text("No such file: '/venv/lib/python3.11/a.py'", ["/venv"])
        == "No such file: '<server>/lib/python3.11/a.py'"
    )
    # a client's own text is echoed as sent
    assert scrub_error_text("The model 'my/model' does not exist", ["/venv"]) == (
        "The model 'my/model' does not exist"
    )


def test_input_embeds_need_a_bfloat16_model_the_hidden_width_and_room_in_the_context():
    row = [0.0] * 4
    assert input_embeds_error(None, 4, "float16", 100) is None
    assert input_embeds_error([row, row], 4, "bfloat16", 100) is None
    assert input_embeds_error([row], 4, "float16", 100) == (
        "input_embeds needs a bfloat16 model (SGLang casts them to bfloat16); this server "
        "runs float16: serve with --dtype bfloat16 to send input_embeds"
    )
    assert input_embeds_error([row], 4, "float64", 100).endswith(
        "runs float64: serve with --dtype bfloat16 and without --spexis-float64 to send "
        "input_embeds"
    )
    assert "non-empty" in input_embeds_error([], 4, "bfloat16", 100)
    assert input_embeds_error([row, [0.0] * 3], 4, "bfloat16", 100) == (
        "input_embeds[1] must be a list of 4 floats (the model's hidden size), got 3 values"
    )
    assert "got 1.5" in input_embeds_error([1.5], 4, "bfloat16", 100)
    assert "longer than the model's context length (3 tokens)" in input_embeds_error(
        [row] * 3, 4, "bfloat16", 3
    )
