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


def _error(sp_enabled: bool = True, **params):
    scheduler = SimpleNamespace(sp_enabled=sp_enabled)
    req = SimpleNamespace(sampling_params=SimpleNamespace(**{**DEFAULTS, **params}))
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


@pytest.mark.parametrize(
    "params, named",
    [
        (dict(regex="[ab]+"), "regex"),
        (dict(json_schema="{}"), "json_schema"),
        (dict(ebnf="root ::= 'a'"), "ebnf"),
        (dict(structural_tag="{}"), "structural_tag"),
        (dict(regex="a", presence_penalty=1.0), "regex"),
        (dict(regex="a", ebnf="root ::= 'a'"), "regex, ebnf"),
    ],
)
def test_each_unsupported_feature_is_named(params, named):
    err = _error(**params)
    assert err == (
        f"Spexis speculative parallelism does not support {named} yet; "
        "send this request to a server without --spexis-draft-head"
    )


def test_a_server_without_sp_serves_everything():
    assert _error(sp_enabled=False, frequency_penalty=1.0, regex="a") is None
