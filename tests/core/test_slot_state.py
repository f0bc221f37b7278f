"""SlotState against its oracle SPState: lockstep on random event sequences, plus units.

The lockstep driver plays the scheduler's part for both (sp_scheduler.py): results of the
oldest batch, finishes (by length, at random) and aborts, drafts of the last batch, the next
rows with the useless-draft rule, selective speculation, memory drops and rows left waiting,
launch, drained slots. At every step it demands identical rows, verdicts, commits, drafts
recorded, drained requests, per-request queries and counters.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from spexis_sglang.core.selection import select_drops
from spexis_sglang.core.slot_state import Rows, SlotState, SlotStateError, SlotStatus, Verdict
from spexis_sglang.core.sp_state import SPState

VOCAB = 3  # small: drafts and true tokens agree often
CONFS = (0.25, 0.5, 0.5, 0.75, 1.0)  # ties for the selection


class Lockstep:
    """One scheduler driving SPState (keyed by request id) and SlotState (keyed by slot)."""

    def __init__(self, n: int, cap: int | None, capacity: int, placeholder: bool, seed: int):
        self.n = n
        self.capacity = capacity
        self.placeholder = placeholder  # a later PP rank: drafts arrive with the results
        self.rng = random.Random(seed)
        self.sp = SPState(max_unverified=cap)
        self.ss = SlotState(capacity, depth=n, max_unverified=cap)
        self.next_rid = 0
        self.slot_of: dict[int, int] = {}  # live and draining requests
        self.rid_of: dict[int, int] = {}
        self.limit: dict[int, int | None] = {}
        self.running: list[int] = []  # live request ids in admission order
        self.free = list(range(capacity))
        # launched batches (rows, request id per row), oldest first; None: nothing launched
        self.pipe: deque[tuple[Rows, list[int]] | None] = deque()
        self.undrafted: list[tuple[Rows, list[int]]] = []  # drafts not applied yet
        self.real_draft: dict[tuple[int, int, int], int] = {}  # (rid, pos, epoch) -> draft
        self.base: dict[int, int] = {}  # SlotState's epoch - SPState's, per request
        self.launched_tok: dict[tuple[int, int], int] = {}  # (rid, pos) -> input token
        self.results = 0

    # -------------------------------------------------------------- lifecycle
    def admit(self, verified: int, bound: int | None) -> None:
        if not self.free:
            return
        slot = self.free.pop(self.rng.randrange(len(self.free)))
        rid = self.next_rid
        self.next_rid += 1
        tok = self.rng.randrange(VOCAB)
        limit = None if bound is None else verified + bound
        self.sp.add(rid, verified, tok)
        self.ss.admit(slot, verified, tok, limit=limit)
        self.slot_of[rid], self.rid_of[slot], self.limit[rid] = slot, rid, limit
        self.base[rid] = int(self.ss.epoch(slot)[0])
        self.running.append(rid)

    def release(self, rid: int) -> None:
        self.sp.remove(rid)
        self.ss.release(self.slot_of[rid])
        self.running.remove(rid)

    def drained(self) -> None:
        got = [self.rid_of[int(s)] for s in self.ss.pop_drained()]
        assert got == self.sp.pop_drained()
        for rid in got:
            slot = self.slot_of.pop(rid)
            del self.rid_of[slot]
            self.free.append(slot)
            assert self.ss.status(slot)[0] == SlotStatus.FREE

    # -------------------------------------------------------------- one iteration
    def iteration(
        self, right: float, alpha: float, p_finish: float, p_mem: float, drafts_first: bool
    ) -> None:
        rng = self.rng
        delay_drafts = rng.random() < 0.1
        if drafts_first and not delay_drafts:
            self.apply_drafts()
        if len(self.pipe) >= self.n:
            self.results_of_oldest(right, p_finish)
        if not drafts_first and not delay_drafts:
            self.apply_drafts()
        self.drained()
        rows = self.build(alpha, p_mem)
        if len(rows):
            self.ss.on_launch(rows)
            rids = [self.rid_of[s] for s in rows.slot.tolist()]
            self.pipe.append((rows, rids))
            self.undrafted.append((rows, rids))
            for rid, p, t in zip(rids, rows.position.tolist(), rows.token.tolist()):
                self.launched_tok[(rid, p)] = t
        else:
            self.pipe.append(None)
        self.drained()

    def results_of_oldest(self, right: float, p_finish: float) -> None:
        item = self.pipe.popleft()
        if item is None:
            return
        rows, rids = item
        rng = self.rng
        y, real = [], []
        for rid, p, e in zip(rids, rows.position.tolist(), rows.epoch.tolist()):
            nxt = self.launched_tok.get((rid, p + 1))
            real.append(self.real_draft.get((rid, p, e), rng.randrange(VOCAB)))
            if self.placeholder and rng.random() < right:
                y.append(real[-1])
            elif nxt is not None and rng.random() < right:
                y.append(nxt)
            else:
                y.append(rng.randrange(VOCAB))
        ld = np.array(real) if self.placeholder else None
        check = rows.slot if rng.random() < 0.5 else None
        verifies = self.ss.verifies_draft(rows)
        res = self.ss.on_result(np.array(y), launched_drafts=ld, slots=check)
        assert res.rows is rows
        finish = []
        for i, (rid, p, e) in enumerate(zip(rids, rows.position.tolist(), rows.epoch.tolist())):
            assert self.rid_of[int(rows.slot[i])] == rid  # not reused before it drained
            d = real[i] if ld is not None else None
            out = self.sp.on_result(rid, p, e - self.base[rid], y[i], launched_draft=d)
            self.results += 1
            assert Verdict(int(res.verdict[i])).outcome is out, (i, rid, p, e)
            committed = out.name != "STALE"
            assert bool(res.committed[i]) == committed
            assert bool(verifies[i]) == (out.name in ("ACCEPTED", "REJECTED"))
            if not committed:
                assert not res.at_limit[i]
                continue
            assert res.true_token[i] == y[i]
            lim = self.limit[rid]
            at_limit = lim is not None and self.sp.verified_len(rid) >= lim
            assert bool(res.at_limit[i]) == at_limit
            if at_limit or rng.random() < p_finish:
                finish.append(rid)
        assert res.committed_tokens.tolist() == [y[i] for i in np.flatnonzero(res.committed)]
        for rid in finish:  # finished by length, EOS, stop string...
            self.release(rid)

    def apply_drafts(self) -> None:
        rng = self.rng
        for rows, rids in self.undrafted:
            toks, confs = [], []
            for rid, p, e in zip(rids, rows.position.tolist(), rows.epoch.tolist()):
                tok = rng.randrange(VOCAB)
                self.real_draft[(rid, p, e)] = tok
                toks.append(-1 if self.placeholder else tok)
                confs.append(rng.choice(CONFS) if rng.random() < 0.7 else rng.random())
            got = self.ss.on_draft(rows.slot, rows.position, rows.epoch, np.array(toks), confs)
            want = [
                self.sp.on_draft(rid, p, e - self.base[rid], t, c)
                for rid, p, e, t, c in zip(
                    rids, rows.position.tolist(), rows.epoch.tolist(), toks, confs
                )
            ]
            assert got.tolist() == want
        self.undrafted = []

    def build(self, alpha: float, p_mem: float) -> Rows:
        rng = self.rng
        # SPState the way sp_build_decode_batch drives it
        plans = []
        for rid in self.running:
            plan = self.sp.next_row(rid)
            if plan is None:
                continue
            lim = self.limit[rid]
            if plan.is_spec and lim is not None and plan.position + 1 >= lim:
                self.sp.drop_draft(rid)
                continue
            plans.append(plan)
        order = np.array([self.slot_of[r] for r in self.running], dtype=np.int64)
        if self.running and rng.random() < 0.2:
            # a draining request still in the caller's list is skipped
            draining = [s for s in self.rid_of if self.ss.status(s)[0] == SlotStatus.DRAINING]
            if draining:
                order = np.insert(order, rng.randrange(order.size + 1), rng.choice(draining))
        # the running order, or (default) all active slots ascending: compared as sets first
        rows = self.ss.next_rows(order if rng.random() < 0.9 or not self.running else None)
        want = {
            (
                self.slot_of[p.rid],
                p.position,
                p.epoch + self.base[p.rid],
                p.is_spec,
                p.token,
                p.confidence,
            )
            for p in plans
        }
        got_list = list(
            zip(
                rows.slot.tolist(),
                rows.position.tolist(),
                rows.epoch.tolist(),
                rows.is_spec.tolist(),
                rows.token.tolist(),
                rows.confidence.tolist(),
            )
        )
        assert set(got_list) == want and len(got_list) == len(want)
        # the batch in the running order (the oracle's order)
        pos_in = {self.slot_of[p.rid]: i for i, p in enumerate(plans)}
        rows = rows.take(np.argsort([pos_in[s] for s in rows.slot.tolist()], kind="stable"))
        assert rows.slot.tolist() == [self.slot_of[p.rid] for p in plans]

        # selective speculation (stage 0), or the drops stage 0 decided (later ranks)
        spec = [i for i, p in enumerate(plans) if p.is_spec]
        assert [bool(self.ss.has_pending_draft(s)[0]) for s in rows.slot.tolist()] == [
            self.sp.has_pending_draft(p.rid) for p in plans
        ]
        if spec:
            want_conf = [self.sp.candidate_confidence(plans[i].rid) for i in spec]
            got_conf = self.ss.candidate_confidence(rows.slot[spec]).tolist()
            assert got_conf == want_conf  # bit for bit
        if alpha > 0 and spec:
            drop = select_drops(want_conf, alpha)
            dropped = {plans[spec[i]].rid for i in drop}
            for rid in dropped:
                self.sp.drop_draft(rid, selective=True)
            plans = [p for p in plans if p.rid not in dropped]
            if self.placeholder:
                slots = np.array([self.slot_of[r] for r in sorted(dropped)], dtype=np.int64)
                self.ss.drop(slots, selective=True)
                rows = rows.without(slots)
            else:
                rows, got_dropped = self.ss.select(rows, alpha)
                assert sorted(self.rid_of[s] for s in got_dropped.tolist()) == sorted(dropped)
        assert rows.slot.tolist() == [self.slot_of[p.rid] for p in plans]

        # memory: sometimes speculative rows that need a new KV slot give way, and some
        # rows simply wait (nothing to undo)
        if rng.random() < p_mem:
            need = self.ss.needs_slot(rows)
            for i, p in enumerate(plans):
                assert bool(need[i]) == (p.position >= self._high_water(p.rid))
            gone = [i for i, p in enumerate(plans) if p.is_spec and need[i] and rng.random() < 0.5]
            for i in gone:
                self.sp.drop_draft(plans[i].rid)
            self.ss.drop(rows.slot[gone])
            keep = [i for i in range(len(plans)) if i not in gone and rng.random() < 0.8]
            plans = [plans[i] for i in keep]
            rows = rows.take(np.array(keep, dtype=np.int64))

        for p in plans:
            ep = self.sp.on_launch(p.rid, p.position, p.token, p.is_spec, p.confidence)
            assert ep == p.epoch
        return rows

    def _high_water(self, rid: int) -> int:
        req = self.sp._reqs[rid]  # noqa: SLF001 (the oracle's internals, test only)
        return req.high_water

    # -------------------------------------------------------------- invariants
    def check(self) -> None:
        live = list(self.running)
        if live:
            s = np.array([self.slot_of[r] for r in live], dtype=np.int64)
            assert self.ss.epoch(s).tolist() == [self.sp.epoch(r) + self.base[r] for r in live]
            assert self.ss.verified_len(s).tolist() == [self.sp.verified_len(r) for r in live]
            assert self.ss.num_unverified(s).tolist() == [self.sp.num_unverified(r) for r in live]
            assert self.ss.num_inflight_rows(s).tolist() == [
                self.sp.num_inflight_rows(r) for r in live
            ]
            assert self.ss.num_inflight_positions(s).tolist() == [
                self.sp.num_inflight_positions(r) for r in live
            ]
            assert self.ss.kv_len(s).tolist() == [self.sp.kv_len(r) for r in live]
            assert self.ss.chain_confidence(s).tolist() == [
                self.sp.chain_confidence(r) for r in live
            ]
            assert self.ss.has_pending_draft(s).tolist() == [
                self.sp.has_pending_draft(r) for r in live
            ]
            assert [self.ss.draft_tokens(int(x)) for x in s] == [
                self.sp.draft_tokens(r) for r in live
            ]
            assert self.ss.allocated_len(s).tolist() == [self._high_water(r) for r in live]
            assert (self.ss.status(s) == SlotStatus.ACTIVE).all()
        assert sorted(self.ss.active_slots().tolist()) == sorted(self.slot_of[r] for r in live)
        for slot, rid in self.rid_of.items():
            if rid not in self.sp:
                assert self.sp.is_draining(rid)
                assert self.ss.status(slot)[0] == SlotStatus.DRAINING
                assert self.ss.num_inflight_rows(slot)[0] == self.sp.num_inflight_rows(rid)
        assert self.ss.stats == self.sp.stats
        assert self.ss.num_batches_in_flight == sum(b is not None for b in self.pipe)


class SlotLockstepMachine(RuleBasedStateMachine):
    @initialize(
        n=st.integers(1, 4),
        cap=st.sampled_from([None, None, 1, 2]),
        capacity=st.integers(3, 12),
        placeholder=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def setup(self, n: int, cap, capacity: int, placeholder: bool, seed: int) -> None:
        self.m = Lockstep(n, cap, capacity, placeholder, seed)
        for _ in range(3):
            self.m.admit(self.m.rng.randint(1, 6), self.m.rng.choice([None, 2, 5]))

    @rule(verified=st.integers(1, 6), bound=st.sampled_from([None, None, 1, 2, 4, 8]))
    def admit(self, verified: int, bound) -> None:
        self.m.admit(verified, bound)

    @precondition(lambda self: self.m.running)
    @rule(pick=st.integers(0, 2**10))
    def abort(self, pick: int) -> None:
        self.m.release(self.m.running[pick % len(self.m.running)])
        self.m.drained()

    @rule(
        iters=st.integers(1, 6),
        right=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
        alpha=st.sampled_from([0.0, 0.0, 0.3, 0.5, 1.0]),  # 1.0: every draft dropped
        p_finish=st.sampled_from([0.0, 0.05]),
        p_mem=st.sampled_from([0.0, 0.3]),
        drafts_first=st.booleans(),
    )
    def step(self, iters, right, alpha, p_finish, p_mem, drafts_first) -> None:
        for _ in range(iters):
            self.m.iteration(right, alpha, p_finish, p_mem, drafts_first)

    @invariant()
    def agree(self) -> None:
        if hasattr(self, "m"):
            self.m.check()

    def teardown(self) -> None:
        if hasattr(self, "m"):
            s = self.m.sp.stats
            for name in ("accepted", "rejected", "rows_stale", "drafts_dropped", "drafts_withheld"):
                try:
                    event(f"{name} > 0: {getattr(s, name) > 0}")
                except Exception:  # outside a hypothesis run
                    pass


TestSlotLockstep = SlotLockstepMachine.TestCase
TestSlotLockstep.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("seed", range(8))
def test_long_lockstep_runs_with_many_requests(seed: int) -> None:
    """Long seeded runs, 64 slots, requests arriving, finishing and aborting throughout."""
    rng = random.Random(seed)
    m = Lockstep(
        n=2 + seed % 3,
        cap=[None, None, 2][seed % 3],
        capacity=64,
        placeholder=seed % 4 == 3,
        seed=seed,
    )
    for _ in range(40):
        m.admit(rng.randint(1, 6), rng.choice([None, 3, 10, 30]))
    for _ in range(200):
        u = rng.random()
        if u < 0.15:
            for _ in range(rng.randint(1, 8)):
                m.admit(rng.randint(1, 6), rng.choice([None, 3, 10, 30]))
        elif u < 0.2 and m.running:
            m.release(rng.choice(m.running))
            m.drained()
        m.iteration(
            rng.choice([0.5, 0.8, 1.0]), rng.choice([0.0, 0.2]), 0.01, 0.2, rng.random() < 0.5
        )
        m.check()
    s = m.sp.stats
    assert s.accepted and s.rejected and s.rows_stale and s.drafts_dropped


# ----------------------------------------------------------------------------- units


def test_accept_reject_and_drain() -> None:
    ss = SlotState(capacity=4, depth=3)
    ss.admit(2, verified_len=5, last_token=50)
    r0 = ss.next_rows()
    assert (r0.slot.tolist(), r0.position.tolist(), r0.is_spec.tolist()) == ([2], [4], [False])
    ss.on_launch(r0)
    assert len(ss.next_rows()) == 0  # waiting for the draft
    assert ss.on_draft(r0.slot, r0.position, r0.epoch, [61], [0.9]).tolist() == [True]
    r1 = ss.next_rows()
    assert (r1.position.tolist(), r1.token.tolist(), r1.is_spec.tolist()) == ([5], [61], [True])
    ss.on_launch(r1)
    ss.on_draft(r1.slot, r1.position, r1.epoch, [72], [0.5])
    assert ss.candidate_confidence(2).tolist() == [0.9 * 0.5]
    r2 = ss.next_rows()
    ss.on_launch(r2)
    res = ss.on_result([61])
    assert res.verdict.tolist() == [Verdict.ACCEPTED] and res.committed_tokens.tolist() == [61]
    res = ss.on_result([99], slots=[2])  # x_7 is 99, not 72: reject
    assert res.verdict.tolist() == [Verdict.REJECTED]
    assert ss.epoch(2).tolist() == [1] and ss.verified_len(2).tolist() == [7]
    r3 = ss.next_rows()
    assert (r3.position.tolist(), r3.token.tolist(), r3.epoch.tolist()) == ([6], [99], [1])
    ss.on_launch(r3)
    ss.release(2)
    assert ss.pop_drained().size == 0 and ss.status(2).tolist() == [SlotStatus.DRAINING]
    with pytest.raises(SlotStateError, match="in flight"):
        ss.admit(2, 3, 7)
    assert ss.on_result([1]).verdict.tolist() == [Verdict.STALE]  # row 6 of epoch 0
    assert ss.on_result([1]).verdict.tolist() == [Verdict.STALE]  # row 6 of epoch 1
    assert ss.pop_drained().tolist() == [2]
    ss.admit(2, 3, 7)  # reusable once drained
    assert ss.stats.accepted == 1 and ss.stats.rejected == 1 and ss.stats.rows_stale == 2


def test_results_with_and_without_stale_rows_agree() -> None:
    """``on_result``'s all-valid path and its path with stale rows give the same verdicts,
    limits and state for the rows both batches share."""

    def run(release_one: bool):
        ss = SlotState(capacity=4, depth=2)
        ss.admit([0, 1, 2], verified_len=[5, 6, 7], last_token=[1, 2, 3], limit=[8, 100, 100])
        r0 = ss.next_rows()
        ss.on_launch(r0)
        ss.on_draft(r0.slot, r0.position, r0.epoch, [10, 11, 12], [0.5, 0.6, 0.7])
        r1 = ss.next_rows()
        assert r1.is_spec.all()
        ss.on_launch(r1)
        if release_one:
            ss.release(1)
        res = ss.on_result([10, 99, 13])  # slot 0 accepts, slot 2 rejects
        keep = [0, 2]
        return (
            res.verdict.dtype,
            res.verdict[keep].tolist(),
            res.at_limit[keep].tolist(),
            res.committed.tolist(),
            ss.verified_len(keep).tolist(),
            ss.epoch(keep).tolist(),
            [ss.draft_tokens(s) for s in keep],
        )

    full, stale = run(False), run(True)
    assert full[0] == stale[0] == np.int8
    assert full[1] == stale[1] == [Verdict.ACCEPTED, Verdict.REJECTED]
    assert full[2] == stale[2] == [False, False]
    assert full[3] == [True, True, True] and stale[3] == [True, False, True]
    assert full[4:] == stale[4:]
    assert full[4] == [6, 8] and full[5] == [0, 1] and full[6] == [[], []]


def test_useless_drafts_are_dropped_at_the_limit() -> None:
    ss = SlotState(capacity=2, depth=2)
    ss.admit(0, verified_len=4, last_token=1, limit=5)  # one token left to generate
    r = ss.next_rows()
    ss.on_launch(r)
    ss.on_draft(r.slot, r.position, r.epoch, [2], [0.9])
    assert len(ss.next_rows()) == 0  # the row at 4 could only produce x_5: useless
    assert ss.stats.drafts_withheld == 1 and not ss.has_pending_draft(0)[0]
    res = ss.on_result([3])
    assert res.at_limit.tolist() == [True] and res.verdict.tolist() == [Verdict.APPENDED]


@pytest.mark.parametrize(
    "bad",
    [
        lambda ss, r: ss.on_launch(
            Rows(r.slot, r.position + 1, r.epoch, r.is_spec, r.token, r.confidence)
        ),
        lambda ss, r: ss.on_launch(
            Rows(r.slot, r.position, r.epoch, r.is_spec, r.token + 1, r.confidence)
        ),
        lambda ss, r: ss.on_launch(
            Rows(r.slot, r.position, r.epoch + 1, r.is_spec, r.token, r.confidence)
        ),
        lambda ss, r: ss.on_launch(
            Rows(r.slot, r.position, r.epoch, ~r.is_spec, r.token, r.confidence)
        ),
        lambda ss, r: ss.on_launch(r.take(np.array([0, 0]))),  # a slot twice
        lambda ss, r: ss.on_result([1]),  # nothing in flight
        lambda ss, r: ss.admit(1, 3, 7),  # already active
        lambda ss, r: ss.next_rows(np.array([0])),  # never admitted
        lambda ss, r: ss.epoch(5),  # out of range
    ],
)
def test_protocol_errors_change_nothing(bad) -> None:
    ss = SlotState(capacity=4, depth=2)
    ss.admit(1, 3, 7)
    r = ss.next_rows()
    with pytest.raises(SlotStateError):
        bad(ss, r)
    again = ss.next_rows()
    for name in ("slot", "position", "epoch", "is_spec", "token", "confidence"):
        assert getattr(again, name).tolist() == getattr(r, name).tolist()
    ss.on_launch(r)  # still the planned row


def test_depth_and_order_checks() -> None:
    ss = SlotState(capacity=2, depth=1)
    ss.admit(0, 3, 7)
    r = ss.next_rows()
    ss.on_launch(r)
    ss.on_draft(r.slot, r.position, r.epoch, [8], [0.5])
    with pytest.raises(SlotStateError, match="depth"):
        ss.on_launch(ss.next_rows())
    with pytest.raises(SlotStateError, match="launch order"):
        ss.on_result([8], slots=[1])
    assert ss.on_result([8], slots=[0]).verdict.tolist() == [Verdict.APPENDED]


def test_late_draft_of_a_previous_occupant_is_stale() -> None:
    """A slot's next occupant starts at a higher epoch, so a draft applied late for the last
    occupant's row cannot pass for the new occupant's (SPState tells them apart by id)."""
    ss = SlotState(capacity=1, depth=2)
    ss.admit(0, verified_len=5, last_token=1)
    old = ss.next_rows()
    ss.on_launch(old)  # row at 4, epoch 0
    ss.release(0)
    assert ss.on_result([2]).verdict.tolist() == [Verdict.STALE]
    assert ss.pop_drained().tolist() == [0]
    ss.admit(0, verified_len=5, last_token=3)  # the same positions as the last occupant
    new = ss.next_rows()
    assert new.epoch.tolist() == [1]
    ss.on_launch(new)
    assert ss.on_draft(old.slot, old.position, old.epoch, [9], [1.0]).tolist() == [False]
    assert not ss.has_pending_draft(0)[0] and len(ss.next_rows()) == 0


def test_backfilled_confidences_are_the_ones_recorded_at_once() -> None:
    """Drafts recorded with placeholder confidences (1) take their real ones later: a pending
    draft its own, a launched one its place in the chain of the rows built on it. The keys
    then equal those of a twin that recorded the real confidences at once; drafts of another
    epoch or already verified are passed over."""
    twins = [SlotState(capacity=3, depth=3) for _ in range(2)]
    real, late = twins
    for ss in twins:
        ss.admit([0, 1, 2], verified_len=[3, 4, 5], last_token=[7, 8, 9])
    rows = []
    for ss in twins:
        r = ss.next_rows()
        ss.on_launch(r)
        rows.append(r)
    conf1 = np.array([0.9, 0.5, 0.2])
    real.on_draft(rows[0].slot, rows[0].position, rows[0].epoch, [4, 5, 6], conf1)
    late.on_draft(rows[1].slot, rows[1].position, rows[1].epoch, [4, 5, 6], np.ones(3))
    spec = []
    for ss in twins:  # the drafts launched: speculative rows in flight
        r = ss.next_rows()
        assert r.is_spec.all()
        ss.on_launch(r)
        spec.append(r)
    conf2 = np.array([0.3, 0.8, 0.6])
    real.on_draft(spec[0].slot, spec[0].position, spec[0].epoch, [1, 2, 3], conf2)
    late.on_draft(spec[1].slot, spec[1].position, spec[1].epoch, [1, 2, 3], np.ones(3))
    assert not np.allclose(late.candidate_confidence([0, 1, 2]), conf1 * conf2)
    # the first drafts are in flight (chain), the second ones pending (own)
    n = late.backfill_confidences(rows[1].slot, rows[1].position, rows[1].epoch, conf1)
    n += late.backfill_confidences(spec[1].slot, spec[1].position, spec[1].epoch, conf2)
    assert n == 6
    want = real.candidate_confidence([0, 1, 2])
    assert np.allclose(want, conf1 * conf2)
    assert np.array_equal(late.candidate_confidence([0, 1, 2]), want)
    # another epoch, or a draft no longer in flight (verified): nothing changes
    stale = rows[1].epoch - 1
    assert late.backfill_confidences(rows[1].slot, rows[1].position, stale, np.zeros(3)) == 0
    late.on_result([4, 5, 6])  # the first batch's true tokens verify the first drafts
    assert late.backfill_confidences(rows[1].slot, rows[1].position, rows[1].epoch, [0.0] * 3) == 0
    assert np.array_equal(late.candidate_confidence([0, 1, 2]), conf2)


def test_drop_counts_only_pending_drafts() -> None:
    ss = SlotState(capacity=3, depth=2)
    ss.admit([0, 1], verified_len=[3, 4], last_token=[7, 8])
    r = ss.next_rows()
    ss.on_launch(r)
    ss.on_draft(r.slot[:1], r.position[:1], r.epoch[:1], [5], [0.5])  # slot 0 only
    ss.drop([0, 1])
    assert ss.stats.drafts_withheld == 1
    ss.drop([0], selective=True)
    assert ss.stats.drafts_withheld == 1 and ss.stats.drafts_dropped == 0
    ss.on_draft(r.slot[1:], r.position[1:], r.epoch[1:], [6], [0.5])
    ss.drop([0, 1], selective=True)
    assert ss.stats.drafts_withheld == 1 and ss.stats.drafts_dropped == 1
    with pytest.raises(SlotStateError):
        ss.drop([2])  # not admitted


def test_a_plan_made_stale_by_an_event_is_checked_row_by_row() -> None:
    """Launching the rows of next_rows skips the per-row checks only while nothing has
    changed since they were planned (Rows.plan); any event in between brings them back."""
    ss = SlotState(capacity=4, depth=2)
    ss.admit([0, 1], verified_len=[3, 4], last_token=[7, 8])
    r = ss.next_rows()
    assert r.plan >= 0 and r.take(r.slot == 1).plan == r.plan  # a masked subset: still a plan
    assert r.take(np.array([1, 0])).plan == -1  # reordered: not the state's plan
    ss.release(1)  # after planning: slot 1's row is no longer launchable
    with pytest.raises(SlotStateError, match="not active"):
        ss.on_launch(r)
    ss.on_launch(r.take(r.slot == 0))  # the checks pass for what is still valid
    ss.on_draft(np.array([0]), np.array([2]), r.epoch[:1], [5], [0.5])
    spec = ss.next_rows()
    assert spec.is_spec.tolist() == [True]
    ss.drop(0)  # the draft is declined after planning: its row must not launch
    with pytest.raises(SlotStateError, match="not the planned one"):
        ss.on_launch(spec)
