"""What a stage relays to the next one: the requests, and stage 0's plan unless it is empty."""

from __future__ import annotations

from spexis_sglang.srt.protocol import SpexisPlan, relay_payload


def test_an_empty_plan_is_left_out_so_a_steady_iteration_relays_nothing() -> None:
    assert SpexisPlan(iteration=7).is_empty()
    assert relay_payload([], SpexisPlan(iteration=7)) == []
    assert relay_payload(None, SpexisPlan(iteration=7)) == []
    reqs = ["req-a", "req-b"]
    assert relay_payload(reqs, SpexisPlan(iteration=7)) == reqs


def test_a_plan_that_decides_something_travels_after_the_requests() -> None:
    for plan in (
        SpexisPlan(iteration=3, dropped=[4, 9]),
        SpexisPlan(iteration=3, admit_cap=0),
        SpexisPlan(iteration=3, admit_cap=2),
    ):
        assert not plan.is_empty()
        assert relay_payload([], plan) == [plan]
        assert relay_payload(["r"], plan) == ["r", plan]
