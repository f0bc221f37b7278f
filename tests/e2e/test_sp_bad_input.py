"""Requests that used to crash a rank (and so the whole server) answer 400 with a clear message,
and the server keeps serving: on plain SGLang through our launcher and on SP."""

from __future__ import annotations

import pytest
import requests

from .prompts import lossless_prompts
from .test_sp_lossless import BASELINE, sp_args, trained_head  # noqa: F401

pytestmark = pytest.mark.e2e

VOCAB = 49152  # SmolLM2-135M-Instruct
OOV = f"valid ids are 0 to {VOCAB - 1} (vocab size {VOCAB})"

BAD_GENERATE = [
    ({"input_ids": [999999999]}, f"out-of-vocabulary token id 999999999 at position 0; {OOV}"),
    ({"input_ids": [5, -3]}, "out-of-vocabulary token id -3 at position 1"),
    ({"input_ids": [[1, 2], [3, VOCAB]]}, f"out-of-vocabulary token id {VOCAB} at position 1"),
    (
        {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 10**6},
        f"top_logprobs_num must be in [0, {VOCAB}]",
    ),
]


def _error_message(r: requests.Response) -> str:
    body = r.json()
    err = body.get("error", body)
    return err["message"] if isinstance(err, dict) else str(body)


@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sp"])
def test_out_of_vocabulary_ids_answer_400_and_the_server_keeps_serving(
    server_factory, model_dir, trained_head, sp
):
    server = server_factory(sp_args(2, trained_head) if sp else BASELINE)
    prompt = lossless_prompts(model_dir, 1)
    before = server.greedy_ids(prompt, 8)
    for payload, message in BAD_GENERATE:
        payload = {**payload, "sampling_params": {"max_new_tokens": 4}}
        r = requests.post(server.base_url + "/generate", json=payload, timeout=120)
        assert r.status_code == 400, (payload, r.status_code, r.text[:500])
        assert message in _error_message(r), (payload, r.text[:500])
    # OpenAI completions with a token-id prompt
    r = requests.post(
        server.base_url + "/v1/completions",
        json={"model": "default", "prompt": [999999999], "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 400, r.text[:500]
    assert "out-of-vocabulary token id 999999999" in r.text
    assert server.alive()
    assert server.greedy_ids(prompt, 8) == before
