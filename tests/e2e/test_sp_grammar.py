"""Constrained decoding under SP: greedy outputs equal plain SGLang's for regex, JSON schema,
EBNF, structural tags and OpenAI ``response_format``, and they satisfy their grammars.

Every row is masked with its grammar's state after the verified output plus the drafts the row
was built on (``srt/sp_grammar.py``): a mask taken from the committed state alone, a draft fed to
the grammar for good, or a grammar that finished a token early or late would change these greedy
outputs within a few tokens. ``ignore_eos`` runs the grammar past its stop token (SGLang then
emits one unconstrained token and finishes on the terminated grammar), the other requests stop
at the grammar's end.

The baseline is plain SGLang PP=1 without the overlap scheduler, the server of
``test_sp_penalties`` (on these requests its overlap scheduler gives the same tokens: SGLang
delays sampling a grammar batch until the previous result is in).
"""

from __future__ import annotations

import json
import re
from typing import Dict

import jsonschema
import pytest
import requests

from .compare import compare_outputs
from .prompts import templated
from .test_sp_lossless import sp_args, spexis_stats, trained_head  # noqa: F401
from .test_sp_penalties import BASELINE

pytestmark = pytest.mark.e2e

NEW_TOKENS = 40
TEXTS = [
    "Is the sky blue? Answer yes or no and say why.",
    "Describe a fictional person: their name and age.",
    "Give me a character for a story.",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), because [a-z ,]{8,60}\."
EBNF = 'root ::= "The answer is " ("yes" | "no") ". " [a-zA-Z ,]+ "."'
EBNF_AS_REGEX = r"The answer is (yes|no)\. [a-zA-Z ,]+\."
STRUCTURAL_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<person>"],
        "tags": [
            {
                "begin": "<person>",
                "content": {"type": "json_schema", "json_schema": PERSON},
                "end": "</person>",
            }
        ],
        "at_least_one": True,
    },
}
CASES: Dict[str, dict] = {
    "regex": {"regex": REGEX},
    "regex_ignore_eos": {"regex": REGEX, "ignore_eos": True},
    "json_schema": {"json_schema": json.dumps(PERSON)},
    "ebnf": {"ebnf": EBNF},
    "structural_tag": {"structural_tag": json.dumps(STRUCTURAL_TAG)},
    # grammars beside other requests and penalties in one batch
    "plain": {},
    "regex_penalized": {"regex": REGEX, "frequency_penalty": 0.6, "repetition_penalty": 1.2},
}


@pytest.fixture(scope="module")
def servers(server_factory, trained_head):  # noqa: F811
    """The two servers, each fetched when used: starting one may stop the other to make room
    (conftest ``make_room``), and the factory restarts a stopped one."""
    return lambda: server_factory(BASELINE), lambda: server_factory(sp_args(2, trained_head))


def _requests(model_dir: str):
    prompts = templated(model_dir, TEXTS)
    ids, sampling, names = [], [], []
    for name, params in CASES.items():
        for p in prompts:
            ids.append(p)
            names.append(name)
            sampling.append(
                {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": False, **params}
            )
    return ids, sampling, names


def _check_grammar(name: str, text: str, finish: dict) -> None:
    """The output satisfies its grammar (those that stopped at the grammar's end, fully)."""
    if name == "plain":
        return
    stopped = finish["type"] == "stop"
    if name.startswith("regex"):
        if not stopped:
            assert re.match(r"(yes|no)\b", text), text
        elif name == "regex_ignore_eos":  # one free token follows the grammar's stop token
            assert re.match(REGEX, text), text
        else:
            assert re.fullmatch(REGEX, text), text
    elif name == "json_schema":
        if stopped:
            jsonschema.validate(json.loads(text), PERSON)
        else:
            assert text.lstrip().startswith("{"), text
    elif name == "ebnf":
        if stopped:
            assert re.fullmatch(EBNF_AS_REGEX, text), text
        else:
            assert text.startswith("The answer is "), text
    elif name == "structural_tag":
        assert "<person>" in text, text
        for body in re.findall(r"<person>(.*?)</person>", text, flags=re.S):
            jsonschema.validate(json.loads(body), PERSON)


def test_greedy_grammar_outputs_equal_plain_sglang(servers, model_dir):
    baseline, sp = servers
    ids, sampling, names = _requests(model_dir)
    payload = {"input_ids": ids, "sampling_params": sampling}
    expected = baseline().generate(payload)
    sp_server = sp()
    before = spexis_stats(sp_server)
    got = sp_server.generate(payload)
    after = spexis_stats(sp_server)
    cmp = compare_outputs(
        model_dir, ids, [o["output_ids"] for o in expected], [o["output_ids"] for o in got]
    )
    for name in CASES:
        rows = [i for i, n in enumerate(names) if n == name]
        same = sum(expected[i]["output_ids"] == got[i]["output_ids"] for i in rows)
        print(f"{name}: {same}/{len(rows)} identical to plain SGLang")
    acc = after["accepted"] - before["accepted"]
    rej = after["rejected"] - before["rejected"]
    print(f"acceptance over this run: {acc / max(1, acc + rej):.3f} ({acc} / {acc + rej})")
    assert cmp.all_identical, cmp.summary()
    for e, g in zip(expected, got):
        assert g["meta_info"]["finish_reason"] == e["meta_info"]["finish_reason"]
    for name, out in zip(names, got):
        _check_grammar(name, out["text"], out["meta_info"]["finish_reason"])
    finished_by_grammar = [
        n
        for n, o in zip(names, got)
        if n != "plain" and o["meta_info"]["finish_reason"]["type"] == "stop"
    ]
    assert len(finished_by_grammar) >= len(CASES)  # the grammars' ends were reached
    # the grammar changed the outputs, and SP speculated on them
    plain = [o["output_ids"] for n, o in zip(names, got) if n == "plain"]
    regex = [o["output_ids"] for n, o in zip(names, got) if n == "regex"]
    assert all(a != b for a, b in zip(plain, regex))
    assert after["rows_spec"] > before["rows_spec"] and acc > 0 and rej > 0


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        {"type": "json_object"},
    ],
    ids=["json_schema", "json_object"],
)
def test_openai_response_format_equals_plain_sglang(servers, response_format):
    chat = {
        "model": "default",
        "messages": [{"role": "user", "content": "Describe a fictional person as JSON."}],
        "temperature": 0,
        "max_tokens": NEW_TOKENS,
        "response_format": response_format,
    }
    answers = []
    for server_getter in servers:
        r = requests.post(server_getter().base_url + "/v1/chat/completions", json=chat, timeout=600)
        assert r.status_code == 200, r.text[:500]
        answers.append(r.json()["choices"][0])
    plain, sp = answers
    print("response_format", response_format["type"], repr(sp["message"]["content"]))
    assert sp["message"]["content"] == plain["message"]["content"]
    assert sp["finish_reason"] == plain["finish_reason"]
    if sp["finish_reason"] == "stop":
        value = json.loads(sp["message"]["content"])
        assert isinstance(value, dict)
        if response_format["type"] == "json_schema":
            jsonschema.validate(value, PERSON)
