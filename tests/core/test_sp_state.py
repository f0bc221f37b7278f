"""SPState: unit sequences, a model-based hypothesis state machine, and Eq. 2 in the loop."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from spexis_sglang.core.cost_model import b_eff_star
from spexis_sglang.core.selection import select_drops
from spexis_sglang.core.sp_state import Outcome, SPProtocolError, SPState

# ----------------------------------------------------------------------------- units


def launch(st_: SPState, rid) -> tuple[int, int, int, bool]:
    plan = st_.next_row(rid)
    assert plan is not None
    ep = st_.on_launch(rid, plan.position, plan.token, plan.is_spec, plan.confidence)
    assert ep == plan.epoch
    return plan.position, ep, plan.token, plan.is_spec


def test_accept_path() -> None:
    s = SPState()
    s.add("a", verified_len=5, last_token=50)  # x_0..x_4 known, x_4 = 50
    assert launch(s, "a") == (4, 0, 50, False)  # normal row at V-1
    assert s.next_row("a") is None  # no draft yet: wait
    assert s.on_draft("a", 4, 0, token=61, confidence=0.9)
    assert s.has_pending_draft("a") and s.candidate_confidence("a") == pytest.approx(0.9)
    assert launch(s, "a") == (5, 0, 61, True)
    assert s.on_draft("a", 5, 0, token=72, confidence=0.5)
    assert s.candidate_confidence("a") == pytest.approx(0.45)
    assert launch(s, "a") == (6, 0, 72, True)
    assert s.num_unverified("a") == 2 and s.chain_confidence("a") == pytest.approx(0.45)
    assert s.num_inflight_rows("a") == 3 and s.num_inflight_positions("a") == 2
    assert s.kv_len("a") == 7
    assert s.on_result("a", 4, 0, 61) is Outcome.ACCEPTED
    assert s.verified_len("a") == 6 and s.num_unverified("a") == 1
    assert s.on_result("a", 5, 0, 72) is Outcome.ACCEPTED
    assert s.on_result("a", 6, 0, 83) is Outcome.APPENDED  # nothing was built on x_7
    assert s.verified_len("a") == 8
    assert s.next_row("a").position == 7 and not s.next_row("a").is_spec
    assert s.stats.accepted == 2 and s.stats.appended == 1


def test_reject_bumps_epoch_and_stales_in_flight_rows() -> None:
    s = SPState()
    s.add("a", 5, 50)
    launch(s, "a")
    s.on_draft("a", 4, 0, 61, 0.9)
    launch(s, "a")  # row 5 on draft 61
    s.on_draft("a", 5, 0, 72, 0.9)
    launch(s, "a")  # row 6 on draft 72
    assert s.on_result("a", 4, 0, 99) is Outcome.REJECTED  # x_5 is 99, not 61
    assert s.epoch("a") == 1 and s.verified_len("a") == 6 and s.num_unverified("a") == 0
    plan = s.next_row("a")
    assert (plan.position, plan.token, plan.is_spec, plan.epoch) == (5, 99, False, 1)
    assert not s.on_draft("a", 6, 0, 11, 0.9)  # draft of a stale row: useless
    s.on_launch("a", 5, 99, False)
    assert s.on_result("a", 5, 0, 1234) is Outcome.STALE
    assert s.on_result("a", 6, 0, 1234) is Outcome.STALE
    assert s.verified_len("a") == 6
    assert s.num_inflight_positions("a") == 1  # slot 6 stays allocated (overwritten later)
    assert s.on_result("a", 5, 1, 100) is Outcome.APPENDED
    assert s.verified_len("a") == 7 and s.stats.rows_stale == 2 and s.stats.rejected == 1


def test_ranks_with_placeholder_drafts_agree_through_launched_draft() -> None:
    """Stage 0 knows the drafts; other PP ranks record placeholders. Passing the real draft
    with the result makes every rank reach stage 0's verdict."""
    ranks = [SPState(), SPState()]
    for r, s in enumerate(ranks):
        s.add("a", 3, 7)
        launch(s, "a")
        s.on_draft("a", 2, 0, 8 if r == 0 else -1, 0.9)  # -1: placeholder
        launch(s, "a")
        s.on_draft("a", 3, 0, 9 if r == 0 else -1, 0.9)
        launch(s, "a")
    # row 2 made draft 8 (right), row 3 made draft 9 (wrong: x_4 = 5)
    for s in ranks:
        assert s.on_result("a", 2, 0, 8, launched_draft=8) is Outcome.ACCEPTED
        assert s.on_result("a", 3, 0, 5, launched_draft=9) is Outcome.REJECTED
        assert s.epoch("a") == 1 and s.verified_len("a") == 5
    assert ranks[1].on_result("a", 4, 0, 0) is Outcome.STALE
    # without the real draft the placeholder rank would have rejected a right draft
    s = SPState()
    s.add("a", 3, 7)
    launch(s, "a")
    s.on_draft("a", 2, 0, -1, 0.9)
    launch(s, "a")
    assert s.on_result("a", 2, 0, 8) is Outcome.REJECTED


def test_dropped_draft_waits_for_verification() -> None:
    s = SPState()
    s.add("a", 3, 7)
    launch(s, "a")
    s.on_draft("a", 2, 0, 8, 0.1)
    s.drop_draft("a", selective=True)
    assert s.next_row("a") is None and not s.has_pending_draft("a")
    assert s.on_result("a", 2, 0, 8) is Outcome.APPENDED
    assert launch(s, "a") == (3, 0, 8, False)
    assert s.stats.drafts_dropped == 1


def test_result_before_draft_makes_the_draft_obsolete() -> None:
    s = SPState()
    s.add("a", 3, 7)
    launch(s, "a")
    s.on_draft("a", 2, 0, 8, 0.9)
    assert s.on_result("a", 2, 0, 8) is Outcome.APPENDED  # the draft was never launched
    assert not s.has_pending_draft("a")
    assert s.next_row("a").is_spec is False
    assert not s.on_draft("a", 2, 0, 8, 0.9)  # late draft for a verified position


def test_remove_drains_in_flight_rows() -> None:
    s = SPState()
    s.add("a", 3, 7)
    launch(s, "a")
    s.on_draft("a", 2, 0, 8, 0.9)
    launch(s, "a")
    s.remove("a")
    assert "a" not in s and s.is_draining("a") and s.pop_drained() == []
    assert s.num_inflight_rows("a") == 2
    assert s.on_result("a", 2, 0, 8) is Outcome.STALE
    assert s.pop_drained() == []
    with pytest.raises(SPProtocolError, match="in-flight"):
        s.add("a", 3, 7)
    assert s.on_result("a", 3, 0, 9) is Outcome.STALE
    assert s.pop_drained() == ["a"] and s.pop_drained() == []
    s.add("a", 10, 1)  # the id may be reused once drained
    s.remove("a")
    assert s.pop_drained() == ["a"]  # nothing in flight: drained at once
    s.remove("zzz")  # unknown: no-op
    assert s.on_result("zzz", 1, 0, 1) is Outcome.STALE  # late row of a forgotten request


@pytest.mark.parametrize(
    "bad",
    [
        lambda s: s.on_launch("a", 5, 7, False),  # wrong position
        lambda s: s.on_launch("a", 2, 8, False),  # wrong token
        lambda s: s.on_launch("a", 2, 7, True),  # no draft to speculate on
        lambda s: s.on_result("a", 2, 0, 1),  # nothing in flight
        lambda s: s.add("a", 3, 7),  # already tracked
    ],
)
def test_protocol_errors(bad) -> None:
    s = SPState()
    s.add("a", 3, 7)
    with pytest.raises(SPProtocolError):
        bad(s)


def test_out_of_order_result_is_a_protocol_error() -> None:
    s = SPState()
    s.add("a", 3, 7)
    launch(s, "a")
    s.on_draft("a", 2, 0, 8, 0.9)
    launch(s, "a")
    with pytest.raises(SPProtocolError, match="launch order"):
        s.on_result("a", 3, 0, 9)
    with pytest.raises(SPProtocolError):
        s.on_launch("a", 4, 5, True)  # no pending draft at 4
    with pytest.raises(KeyError):
        s.next_row("nope")
    with pytest.raises(ValueError):
        s.add("b", 0, 1)


def test_launch_next_is_next_row_plus_on_launch() -> None:
    s = SPState()
    s.add("a", 3, 7)
    row = s.launch_next("a")
    assert (row.position, row.token, row.is_spec, row.epoch) == (2, 7, False, 0)
    assert s.launch_next("a") is None  # waiting for a draft
    s.on_draft("a", 2, 0, 8, 0.6)
    row = s.launch_next("a")
    assert (row.position, row.token, row.is_spec, row.confidence) == (3, 8, True, 0.6)
    assert s.num_inflight_rows("a") == 2 and s.stats.rows_spec == 1


def test_max_unverified_caps_speculation_depth() -> None:
    s = SPState(max_unverified=1)
    s.add("a", 3, 7)
    launch(s, "a")
    s.on_draft("a", 2, 0, 8, 0.9)
    launch(s, "a")
    s.on_draft("a", 3, 0, 9, 0.9)
    assert s.next_row("a") is None  # one unverified draft in flight already
    assert s.on_result("a", 2, 0, 8) is Outcome.ACCEPTED
    assert s.next_row("a").is_spec and s.next_row("a").position == 4


# ----------------------------------------------------------------------------- model


def true_token(rid: int, pos: int) -> int:
    """The target model's (greedy) token at ``pos``: a fixed function, 3-token vocabulary."""
    return (rid * 7 + pos * pos * 3 + pos) % 3


class SPMachine(RuleBasedStateMachine):
    """Drive SPState through an N-stage pipeline against an oracle of true tokens.

    Invariant checked on every result: a non-stale outcome commits exactly the next true
    token, and only rows whose whole input chain was right ever commit (losslessness).
    """

    @initialize(n=st.integers(1, 4), cap=st.sampled_from([None, 1, 2]))
    def setup(self, n: int, cap) -> None:
        self.n = n
        self.s = SPState(max_unverified=cap)
        self.t = 0
        self.next_rid = 0
        self.pipe: deque[list] = deque([[] for _ in range(n)])  # rows by launch iteration
        self.pending_drafts: list = []  # drafts from rows launched last iteration
        self.live: dict[int, dict] = {}
        self.removed_inflight: dict[int, int] = {}
        self.results = 0
        for prompt in (1, 3, 5):
            self.add(prompt)

    # -- helpers
    def _row_correct(self, rid: int, pos: int, token: int, is_spec: bool) -> bool:
        rec = self.live[rid]
        if not is_spec:
            return token == true_token(rid, pos)
        return rec["last_correct"] and token == true_token(rid, pos)

    # -- rules
    @rule(prompt=st.integers(1, 6))
    def add(self, prompt: int) -> None:
        rid = self.next_rid
        self.next_rid += 1
        self.s.add(rid, prompt, true_token(rid, prompt - 1))
        self.live[rid] = {"v": prompt, "last_correct": True, "inflight": 0, "confs": []}

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 2**10))
    def remove(self, pick: int) -> None:
        rid = sorted(self.live)[pick % len(self.live)]
        rec = self.live.pop(rid)
        self.s.remove(rid)
        self.removed_inflight[rid] = rec["inflight"]
        drained = self.s.pop_drained()
        if rec["inflight"] == 0:
            assert drained == [rid]
            del self.removed_inflight[rid]
        else:
            assert drained == [] and self.s.is_draining(rid)

    @rule(
        seed=st.integers(0, 2**16),
        iters=st.integers(1, 8),
        draft_right=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
        drop_share=st.sampled_from([0, 0.3, 0.5]),
    )
    def step(self, seed: int, iters: int, draft_right: float, drop_share: float) -> None:
        rng = random.Random(seed)
        for _ in range(iters):
            self._iteration(rng, draft_right, drop_share)

    def _iteration(self, rng: random.Random, draft_right: float, drop_share: float) -> None:
        # 1. rows launched N iterations ago return from the last stage
        for rid, pos, epoch, correct in self.pipe.popleft():
            tok = true_token(rid, pos + 1) if correct else rng.randrange(3)
            v_before = self.live[rid]["v"] if rid in self.live else None
            out = self.s.on_result(rid, pos, epoch, tok)
            self.results += 1
            if rid in self.live:
                self.live[rid]["inflight"] -= 1
            else:
                self.removed_inflight[rid] -= 1
                assert out is Outcome.STALE
                if self.removed_inflight[rid] == 0:
                    assert self.s.pop_drained() == [rid]
                    del self.removed_inflight[rid]
                continue
            rec = self.live[rid]
            if out is Outcome.STALE:
                assert self.s.verified_len(rid) == v_before
                continue
            assert correct, "a row built on a wrong token committed a token"
            assert pos == v_before - 1 and tok == true_token(rid, v_before)
            rec["v"] += 1
            assert self.s.verified_len(rid) == rec["v"]
            if out is Outcome.REJECTED:
                rec["last_correct"] = True  # the corrected normal row comes next
                rec["confs"] = []
            elif out is Outcome.ACCEPTED:
                rec["confs"].pop(0)
        # 2. stage 0 made drafts for the rows launched last iteration
        for rid, pos, epoch, correct in self.pending_drafts:
            if correct and rng.random() < draft_right:
                tok = true_token(rid, pos + 1)
            else:
                tok = rng.randrange(3)
            self.s.on_draft(rid, pos, epoch, tok, rng.uniform(0.05, 1.0))
        # 3. selective speculation
        cands = [r for r in sorted(self.live) if self.s.has_pending_draft(r)]
        if cands and drop_share:
            conf = self.s.candidate_confidences(cands)
            for i in select_drops(conf, drop_share):
                self.s.drop_draft(cands[i], selective=True)
        # 4. launch
        launched = []
        for rid in sorted(self.live):
            plan = self.s.next_row(rid)
            if plan is None:
                continue
            rec = self.live[rid]
            if not plan.is_spec:
                assert plan.position == rec["v"] - 1
                assert plan.token == true_token(rid, plan.position)
            correct = self._row_correct(rid, plan.position, plan.token, plan.is_spec)
            ep = self.s.on_launch(rid, plan.position, plan.token, plan.is_spec, plan.confidence)
            rec["last_correct"] = correct
            rec["inflight"] += 1
            if plan.is_spec:
                rec["confs"].append(plan.confidence)
            launched.append((rid, plan.position, ep, correct))
        self.pipe.append(launched)
        self.pending_drafts = launched
        self.t += 1

    # -- invariants
    def teardown(self) -> None:
        if hasattr(self, "s"):
            st_ = self.s.stats
            for name in ("accepted", "rejected", "rows_stale", "drafts_dropped"):
                try:
                    event(f"{name} > 0: {getattr(st_, name) > 0}")
                except Exception:  # outside a hypothesis run
                    pass

    @invariant()
    def bookkeeping(self) -> None:
        if not hasattr(self, "s"):
            return
        for rid, rec in self.live.items():
            assert self.s.verified_len(rid) == rec["v"]
            assert self.s.num_inflight_rows(rid) == rec["inflight"] <= self.n
            assert self.s.num_unverified(rid) == len(rec["confs"]) <= rec["inflight"]
            assert self.s.chain_confidence(rid) == pytest.approx(float(np.prod(rec["confs"])))
            assert 0 <= self.s.num_inflight_positions(rid) <= max(self.n - 1, 0)
            assert self.s.kv_len(rid) == rec["v"] + self.s.num_inflight_positions(rid)
        for rid, left in self.removed_inflight.items():
            assert self.s.is_draining(rid) and self.s.num_inflight_rows(rid) == left
        st_ = self.s.stats
        assert st_.tokens_committed + st_.rows_stale == self.results
        assert st_.accepted + st_.rejected + st_.appended == st_.tokens_committed
        assert st_.rows_normal + st_.rows_spec == self.results + sum(len(x) for x in self.pipe)


TestSPMachine = SPMachine.TestCase
TestSPMachine.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("seed", range(12))
def test_long_random_runs(seed: int) -> None:
    """The same machine driven by long seeded random runs (hypothesis favours short ones)."""
    rng = random.Random(seed)
    m = SPMachine()
    m.setup(n=1 + seed % 4, cap=[None, 1, 2][seed % 3])
    for _ in range(120):
        u = rng.random()
        if u < 0.08:
            m.add(rng.randint(1, 6))
        elif u < 0.13 and m.live:
            m.remove(rng.randrange(1024))
        else:
            m.step(rng.randrange(2**16), rng.randint(1, 4), rng.choice([0.5, 0.9]), 0.5)
        m.bookkeeping()
    st_ = m.s.stats
    assert st_.accepted and st_.rejected and st_.rows_stale and st_.drafts_dropped or m.n == 1
    m.teardown()


# ------------------------------------------------------------------- Eq. 2 in the loop


@pytest.mark.parametrize("n,theta", [(2, 0.75), (3, 0.6), (4, 0.5)])
def test_state_machine_reproduces_eq2(n: int, theta: float) -> None:
    """Drive SPState like the scheduler with drafts right with probability theta: the
    committed tokens per iteration match B / (N - theta (N-1))."""
    rng = np.random.default_rng(n)
    r_n, iters, warm = 150, 350, 80
    s = SPState()
    for rid in range(r_n):
        s.add(rid, 4, true_token(rid, 3))
    pipe: deque[list] = deque([[] for _ in range(n)])
    last: list = []
    committed = np.zeros(iters + n)
    for t in range(iters + n):
        for rid, pos, ep, correct, t0 in pipe.popleft():
            tok = true_token(rid, pos + 1) if correct else -1
            if s.on_result(rid, pos, ep, tok) is not Outcome.STALE:
                committed[t0] += 1
        if t >= iters:
            pipe.append([])
            continue
        chain_ok: dict[int, bool] = {}
        for rid, pos, ep, correct, _ in last:
            right = correct and rng.random() < theta
            tok = true_token(rid, pos + 1) if right else -2
            s.on_draft(rid, pos, ep, tok, 0.5)
            chain_ok[rid] = correct
        launched = []
        for rid in range(r_n):
            plan = s.next_row(rid)
            if plan is None:
                continue
            ep = s.on_launch(rid, plan.position, plan.token, plan.is_spec, plan.confidence)
            ok = (not plan.is_spec or chain_ok[rid]) and plan.token == true_token(
                rid, plan.position
            )
            launched.append((rid, plan.position, ep, ok, t))
        pipe.append(launched)
        last = launched
    got = committed[warm:iters].mean()
    assert got == pytest.approx(b_eff_star(r_n, n, theta), rel=0.03)
    assert s.stats.accepted / (s.stats.accepted + s.stats.rejected) == pytest.approx(
        theta, abs=0.03
    )
