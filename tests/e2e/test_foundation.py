"""Foundation: the bundled model served through ``spexis_sglang.launch_server`` on CPU.

A PP=1 and a PP=2 server (session-wide); both must give HF transformers' greedy tokens.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import requests

from .reference import CHAT_PROMPTS, chat_prompt_ids, hf_greedy, load_tokenizer

pytestmark = pytest.mark.e2e

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def servers(server_factory):
    """Plain SGLang through our entry point with PP=1 and PP=2 (shared with other modules)."""
    return {pp: server_factory(["--pp-size", str(pp)]) for pp in (1, 2)}


@pytest.fixture(scope="module")
def prompt_ids(model_dir):
    return chat_prompt_ids(model_dir)


@pytest.fixture(scope="module")
def greedy_outputs(servers, prompt_ids):
    return {pp: s.greedy_ids(prompt_ids, NEW_TOKENS) for pp, s in servers.items()}


def test_pp1_and_pp2_give_identical_greedy_ids(greedy_outputs, prompt_ids):
    assert len(greedy_outputs[1]) == len(prompt_ids) >= 8
    for i, (a, b) in enumerate(zip(greedy_outputs[1], greedy_outputs[2])):
        assert len(a) == len(b) == NEW_TOKENS
        assert a == b, f"prompt {i}: PP=1 and PP=2 differ"


def test_plain_pp_keeps_sglangs_transport(servers):
    """Spexis' packed PP link is an SP server's default; a plain PP server, asking for nothing,
    sends its PP messages SGLang's way."""
    info = requests.get(servers[2].base_url + "/server_info", timeout=60).json()
    assert info["internal_states"][0]["spexis_pp_link"] == "sglang"


def test_greedy_ids_equal_hf_transformers(greedy_outputs, prompt_ids, model_dir):
    for i, expected in enumerate(hf_greedy(model_dir, prompt_ids, NEW_TOKENS)):
        assert len(expected) == NEW_TOKENS
        assert greedy_outputs[1][i] == expected, f"prompt {i} ({CHAT_PROMPTS[i]!r}): PP=1 != HF"
        assert greedy_outputs[2][i] == expected, f"prompt {i} ({CHAT_PROMPTS[i]!r}): PP=2 != HF"


def test_chat_completions_applies_the_chat_template(servers, model_dir, prompt_ids):
    server = servers[2]
    r = requests.post(
        server.base_url + "/v1/chat/completions",
        json={
            "model": "default",
            "messages": [{"role": "user", "content": CHAT_PROMPTS[0]}],
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=300,
    )
    r.raise_for_status()
    body = r.json()
    # The prompt the server built is exactly the model's ChatML template.
    assert body["usage"]["prompt_tokens"] == len(prompt_ids[0])
    assert load_tokenizer(model_dir).decode(prompt_ids[0]).startswith("<|im_start|>")
    # ... and the answer is the greedy continuation of that templated prompt.
    raw = server.generate(
        {"input_ids": prompt_ids[0], "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    )
    assert body["choices"][0]["message"]["content"] == raw["text"].strip()
    assert "Paris" in body["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "model_path, message",
    [
        ("/nonexistent/model-dir", "no such model directory"),
        (__file__, "is a file, not a model directory"),
        ("/tmp", "holds no config.json"),
    ],
)
def test_bad_model_path_fails_fast_with_a_clear_message(model_path, message):
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "spexis_sglang.launch_server", "--model-path", model_path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert model_path in proc.stderr
    assert time.time() - t0 < 60
