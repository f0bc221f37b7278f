"""Requests SP cannot serve exactly are refused on arrival, naming what they used."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spexis_sglang.srt.sp_scheduler import SpexisScheduler

DEFAULTS = dict(
    frequency_penalty=0.0,
    presence_penalty=0.0,
    repetition_penalty=1.0,
    min_new_tokens=0,
    regex=None,
    json_schema=None,
    ebnf=None,
    structural_tag=None,
)


def _error(sp_enabled: bool = True, force_accept=None, **params):
    scheduler = SimpleNamespace(
        sp_enabled=sp_enabled, spexis_config=SimpleNamespace(force_accept=force_accept)
    )
    req = SimpleNamespace(sampling_params=SimpleNamespace(**{**DEFAULTS, **params}), grammar=None)
    return SpexisScheduler._sp_unsupported_error(scheduler, req)


def test_plain_sampling_is_accepted():
    assert _error() is None
    assert _error(temperature=0.7) is None


@pytest.mark.parametrize(
    "params",
    [
        dict(frequency_penalty=0.1),
        dict(presence_penalty=-0.5),
        dict(repetition_penalty=1.1),
        dict(min_new_tokens=3),
        dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.3, min_new_tokens=8),
    ],
)
def test_penalties_and_min_new_tokens_are_served(params):
    """SP sets the penalizers from each row's verified output + drafts (sp_penalties)."""
    assert _error(**params) is None


GRAMMAR_CASES = [
    (dict(regex="[ab]+"), "regex"),
    (dict(json_schema="{}"), "json_schema"),
    (dict(ebnf="root ::= 'a'"), "ebnf"),
    (dict(structural_tag="{}"), "structural_tag"),
    (dict(regex="a", presence_penalty=1.0), "regex"),
    (dict(regex="a", ebnf="root ::= 'a'"), "regex, ebnf"),
]


@pytest.mark.parametrize("params, named", GRAMMAR_CASES)
def test_grammars_are_served(params, named):
    """SP masks each row with its grammar after the row's own drafts (sp_grammar)."""
    assert _error(**params) is None


@pytest.mark.parametrize("params, named", GRAMMAR_CASES)
def test_grammars_are_refused_by_name_in_the_forced_acceptance_mode(params, named):
    err = _error(force_accept=0.7, **params)
    assert err == (
        f"Spexis --spexis-benchmark-force-accept does not support {named} (a forced "
        "acceptance can commit a token the grammar forbids); send this request to a server "
        "without it"
    )
    assert _error(force_accept=0.7) is None


def test_a_server_without_sp_serves_everything():
    assert _error(sp_enabled=False, frequency_penalty=1.0, regex="a") is None
