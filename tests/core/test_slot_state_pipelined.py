"""SlotState's pipelined launch against the plain protocol, on a simulated pipeline.

The SP loop launches iteration ``b`` before it processes the results of iteration ``b - N``,
whose true tokens travel to the device while ``b`` is being built: a row that depends on them
carries an alternative (``SlotState.conditional_alternatives``), the device runs it as the
normal row its request's rejection asks for, and ``on_result`` records that conversion.

Two drivers see the same requests, drafts and true tokens (each row's outcome is a function of
its request, position and epoch, and of what the request's KV holds):

* *plain*: ``SlotState(depth=N)``, results of ``b - N`` processed before ``b`` is built;
* *pipelined*: ``SlotState(depth=N + 1)``, ``b`` launched first, a simulated device applying
  the alternatives with the true tokens of ``b - N``, then those results processed.

With every row patchable they launch the same rows step by step (the pipelined one also runs
one more row of a request that ``b - N``'s result finishes; it comes back stale) and commit the
same tokens. Rows that are not patchable go stale on a rejection instead. A model of every
request's KV checks that each committed token is the request's target token.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from spexis_sglang.core.slot_state import Rows, SlotState, SlotStateError, Verdict

VOCAB = 5


def _hash(*parts: int) -> float:
    """A uniform number in [0, 1) from integers (the same in both drivers)."""
    return zlib.crc32(repr(parts).encode()) / 2**32


class World:
    """Each request's target tokens, and what its KV positions hold (one per driver)."""

    def __init__(self, targets: dict[int, list[int]], prompt: dict[int, int], theta: float):
        self.targets, self.prompt, self.theta = targets, prompt, theta
        self.kv: dict[int, dict[int, int]] = {}
        self.runs: dict[tuple[int, int], int] = {}

    def admit(self, rid: int) -> None:
        t = self.targets[rid]
        # the prefill wrote every prompt position but the last (the first decode row's input)
        self.kv[rid] = {q: t[q] for q in range(self.prompt[rid] - 1)}

    def execute(self, rid: int, pos: int, token: int) -> tuple[int, int]:
        """The last stage's true token for ``pos + 1`` and stage 0's draft for it (the k-th
        run of a position draws the k-th outcome: both drivers run the same rows)."""
        t, kv = self.targets[rid], self.kv[rid]
        good = token == t[pos] and all(kv.get(q) == t[q] for q in range(pos))
        kv[pos] = token
        k = self.runs[(rid, pos)] = self.runs.get((rid, pos), 0) + 1
        if good:
            y = t[pos + 1]
        else:  # garbage: a wrong prefix computes anything
            y = int(_hash(rid, pos, k, 7) * VOCAB)
        right = _hash(rid, pos, k, 1) < self.theta
        draft = y if right else (y + 1 + int(_hash(rid, pos, k, 2) * (VOCAB - 1))) % VOCAB
        return y, draft


class Scenario:
    """What happens at each step, decided per request id so both drivers see the same."""

    def __init__(self, seed: int, steps: int, n_req: int, max_live: int):
        rng = random.Random(seed)
        self.seed = seed
        self.admit_at: dict[int, list[int]] = {}
        self.targets: dict[int, list[int]] = {}
        self.prompt: dict[int, int] = {}
        self.limit: dict[int, int] = {}
        rid = 0
        for step in range(steps):
            if rid < n_req and rng.random() < 0.3:
                self.admit_at.setdefault(step, []).append(rid)
                p = rng.randrange(2, 6)
                self.prompt[rid] = p
                self.limit[rid] = p + rng.randrange(1, 25)
                self.targets[rid] = [rng.randrange(VOCAB) for _ in range(self.limit[rid] + 10)]
                rid += 1
        self.max_live = max_live

    def aborts(self, step: int, rid: int) -> bool:
        return _hash(self.seed, step, rid, 11) < 0.01

    def waits(self, step: int, rid: int) -> bool:
        """The row waits this step (memory)."""
        return _hash(self.seed, step, rid, 13) < 0.05

    def drops(self, step: int, rid: int, alpha: float) -> bool:
        """Selective speculation drops the request's pending draft this step."""
        return _hash(self.seed, step, rid, 17) < alpha

    def patchable(self, rid: int) -> bool:
        return _hash(self.seed, rid, 19) < 0.75


class Driver:
    def __init__(self, sc: Scenario, n: int, pipelined: bool, theta: float, all_patchable: bool):
        self.sc, self.n, self.pipelined = sc, n, pipelined
        self.all_patchable = all_patchable
        self.world = World(sc.targets, sc.prompt, theta)
        self.ss = SlotState(64, depth=n + 1 if pipelined else n, pipelined=pipelined)
        self.slot_of: dict[int, int] = {}
        self.rid_of: dict[int, int] = {}
        self.base: dict[int, int] = {}
        self.running: list[int] = []
        self.free = list(range(64))
        self.launched: dict[int, tuple[Rows, list[int], list[int], list[int]] | None] = {}
        self.last_launch: tuple[Rows, list[int], list[int], list[int]] | None = None
        self.committed: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        self.aborted: set[int] = set()
        self.late_rows: list[tuple[int, int, int]] = []  # rows of finished requests

    # ------------------------------------------------------------------ pieces
    def _release(self, rid: int) -> None:
        self.ss.release(self.slot_of[rid])
        self.running.remove(rid)

    def _drained(self) -> None:
        for s in self.ss.pop_drained().tolist():
            rid = self.rid_of.pop(s)
            del self.slot_of[rid]
            self.free.append(s)

    def _process(self, step: int) -> None:
        """Results of the batch launched ``n`` steps before ``step``."""
        item = self.launched.get(step - self.n)
        if item is None:
            return
        rows, rids, ys, ds = item
        res = self.ss.on_result(np.array(ys), launched_drafts=np.array(ds))
        for i, rid in enumerate(rids):
            if not res.committed[i]:
                continue
            pos = int(rows.position[i])
            out = self.committed.setdefault(rid, [])
            assert len(out) + self.sc.prompt[rid] == pos + 1
            assert ys[i] == self.sc.targets[rid][pos + 1], "committed a token off the target"
            out.append(ys[i])
            if res.at_limit[i]:
                self.finished.add(rid)
                self._release(rid)

    def _apply_drafts(self) -> None:
        if self.last_launch is None:
            return
        rows, rids, ys, ds = self.last_launch
        conf = np.array([0.5 + 0.5 * _hash(r, int(p)) for r, p in zip(rids, rows.position)])
        self.ss.on_draft(rows.slot, rows.position, rows.epoch, np.array(ds), conf)
        self.last_launch = None

    def _build(self, step: int, alpha: float) -> Rows:
        order = np.array([self.slot_of[r] for r in self.running], dtype=np.int64)
        patchable = None
        if self.pipelined and self.launched.get(step - self.n) is not None:
            patchable = np.zeros(64, dtype=bool)
            for r, slot in self.slot_of.items():
                patchable[slot] = self.all_patchable or self.sc.patchable(r)
        rows = self.ss.next_rows(order, patchable)
        rids = [self.rid_of[s] for s in rows.slot.tolist()]
        drop = [
            self.slot_of[r]
            for r, spec in zip(rids, rows.is_spec.tolist())
            if spec and self.sc.drops(step, r, alpha)
        ]
        if drop:
            self.ss.drop(np.array(drop, dtype=np.int64))
            rows = rows.without(np.array(drop, dtype=np.int64))
            rids = [self.rid_of[s] for s in rows.slot.tolist()]
        keep = np.array([not self.sc.waits(step, r) for r in rids], dtype=bool)
        return rows.take(keep)

    # ------------------------------------------------------------------ one step
    def step(self, step: int, alpha: float) -> list[tuple[int, int, int, bool, int]]:
        sc = self.sc
        if not self.pipelined:
            self._process(step)
            self._drained()
            self._apply_drafts()
        for rid in sc.admit_at.get(step, []):
            slot = self.free.pop(0)
            self.world.admit(rid)
            t = sc.targets[rid]
            self.ss.admit(slot, sc.prompt[rid], t[sc.prompt[rid] - 1], limit=sc.limit[rid])
            self.slot_of[rid], self.rid_of[slot] = rid, slot
            self.base[rid] = int(self.ss.epoch(slot)[0])
            self.running.append(rid)
        for rid in list(self.running):
            if sc.aborts(step, rid):
                self.aborted.add(rid)
                self._release(rid)
        self._drained()
        rows = self._build(step, alpha)
        rids = [self.rid_of[s] for s in rows.slot.tolist()]
        alt = None
        transit = self.launched.get(step - self.n) if self.pipelined else None
        if transit is not None:
            patchable = np.array([self.all_patchable or sc.patchable(r) for r in rids], dtype=bool)
            alt = self.ss.conditional_alternatives(rows, patchable)
        ran = self._device_rows(rows, rids, alt, transit)
        if len(rows):
            self.ss.on_launch(rows, alternatives=alt)
            ys, ds = [], []
            for rid, pos, _, _, tok in ran:
                y, d = self.world.execute(rid, pos, tok)
                ys.append(y)
                ds.append(d)
            self.launched[step] = self.last_launch = (rows, rids, ys, ds)
        else:
            self.launched[step] = None
        if self.pipelined:
            self._process(step)
            self._apply_drafts()
            self._drained()
        return ran

    def _device_rows(self, rows: Rows, rids: list[int], alt, transit):
        """What the device runs, per row: (request, position, epoch from admission, is it
        speculative, input token). A row whose chain the transit batch rejects runs at its
        alternative position with the true token, in the epoch the rejection starts."""
        out = []
        by_rid = {}
        if transit is not None:
            _, t_rids, t_ys, t_ds = transit
            by_rid = {r: (t_ys[i], t_ds[i]) for i, r in enumerate(t_rids)}
        for i, rid in enumerate(rids):
            row = (
                rid,
                int(rows.position[i]),
                int(rows.epoch[i]) - self.base[rid],
                bool(rows.is_spec[i]),
                int(rows.token[i]),
            )
            if alt is not None and alt[i] >= 0:
                y, d = by_rid[rid]
                if y != d:
                    row = (rid, int(alt[i]), row[2] + 1, False, y)
            out.append(row)
        return out


def _plain_view(driver: Driver, step: int):
    rows = driver.launched.get(step)
    if rows is None:
        return []
    r, rids, _, _ = rows
    return list(
        zip(
            rids,
            r.position.tolist(),
            [int(e) - driver.base[x] for e, x in zip(r.epoch.tolist(), rids)],
            r.is_spec.tolist(),
            r.token.tolist(),
        )
    )


def run(seed: int, n: int, theta: float, alpha: float, all_patchable: bool, steps: int = 260):
    sc = Scenario(seed, steps, n_req=40, max_live=12)
    plain = Driver(sc, n, pipelined=False, theta=theta, all_patchable=True)
    piped = Driver(sc, n, pipelined=True, theta=theta, all_patchable=all_patchable)
    for step in range(steps + 3 * n):
        plain.step(step, alpha)
        ran = piped.step(step, alpha)
        if all_patchable:
            # what the device runs: (request, position, input token); epochs and kinds are
            # the loops' own bookkeeping (a draft launched on a row whose verdict the plain
            # loop already knows counts as accepted or rejected there, as appended here)
            want = [(r, p, t) for r, p, _, _, t in _plain_view(plain, step)]
            got = [(r, p, t) for r, p, _, _, t in ran]
            extra = [row for row in got if row not in want]
            assert sorted(set(got) - set(extra)) == sorted(want), f"step {step}"
            assert len(got) == len(want) + len(extra)
            # the pipelined loop runs more rows only for requests about to end: one the
            # transit batch finishes rides once more, and a row at the limit launched for its
            # alternative runs uselessly when the transit batch accepts; both drain stale
            piped.late_rows.extend(extra)
    for rid, pos, _ in piped.late_rows:
        assert rid in piped.finished | piped.aborted
        assert pos + 1 >= sc.limit[rid] - 1
    return sc, plain, piped


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("theta", [0.0, 0.6, 0.9])
def test_pipelined_launch_runs_the_plain_protocol_rows(n: int, theta: float) -> None:
    for seed in range(4):
        sc, plain, piped = run(seed, n, theta, alpha=0.0, all_patchable=True)
        # every request reached its limit (or was aborted) with the target's tokens; an abort
        # comes before the pipelined loop processes the transit batch, so its tokens are lost
        assert piped.finished <= plain.finished and piped.finished
        assert plain.finished - piped.finished <= piped.aborted
        lost = 0  # tokens of aborted requests' last results
        for rid, toks in plain.committed.items():
            got = piped.committed.get(rid, [])
            if rid in piped.finished:
                assert got == toks
            else:
                assert toks[: len(got)] == got
                lost += len(toks) - len(got)
        for rid in plain.finished:
            assert len(plain.committed[rid]) == sc.limit[rid] - sc.prompt[rid]
        st_plain, st_piped = plain.ss.stats, piped.ss.stats
        verdicts = ("accepted", "rejected", "appended")
        assert sum(getattr(st_piped, v) for v in verdicts) + lost == sum(
            getattr(st_plain, v) for v in verdicts
        )
        # a row launched on a draft whose verdict the plain loop already knew is verified
        # here instead of appended there: never the other way round
        assert st_piped.appended <= st_plain.appended
        # the pipelined loop converts every rejection a later row was launched on
        if theta < 1 and n >= 2:
            assert st_piped.rows_redone > 0
        assert st_piped.rows == st_plain.rows + len(piped.late_rows)
        assert st_piped.rows_stale == st_plain.rows_stale + len(piped.late_rows) + lost


@pytest.mark.parametrize("n", [2, 3])
def test_rows_the_device_cannot_redo_go_stale_and_stay_lossless(n: int) -> None:
    for seed in range(4):
        sc, plain, piped = run(seed, n, 0.6, alpha=0.2, all_patchable=False)
        assert piped.finished <= plain.finished and piped.finished
        assert plain.finished - piped.finished <= piped.aborted
        for rid in piped.finished:
            assert piped.committed[rid] == plain.committed[rid]
        assert piped.ss.stats.rows_redone > 0
        # unpatched rejections cost one more stale row each
        assert piped.ss.stats.rows_stale > plain.ss.stats.rows_stale


def test_conditional_alternatives_and_conversion_units() -> None:
    st = SlotState(4, depth=3)
    st.admit(0, 5, 7)
    st.admit(1, 3, 2)
    a = st.next_rows()  # normal rows at 4 and 2
    st.on_launch(a)
    st.on_draft(a.slot, a.position, a.epoch, np.array([11, 12]), np.array([0.9, 0.8]))
    b = st.next_rows()  # speculative rows at 5 and 3 on drafts 11, 12
    assert b.is_spec.all()
    # the head (a) is valid for both: b depends on it, alternatives are V (5 and 3)
    alt = st.conditional_alternatives(b)
    assert alt.tolist() == [5, 3]
    assert st.conditional_alternatives(b, patchable=np.array([True, False])).tolist() == [5, -1]
    st.on_launch(b, alternatives=alt)
    epochs = st.epoch(np.array([0, 1])).tolist()
    # slot 0 accepts (true 11), slot 1 rejects (true 9 != draft 12)
    res = st.on_result(np.array([11, 9]), launched_drafts=np.array([11, 12]))
    assert res.verdict.tolist() == [2, 3]
    assert st.stats.rows_redone == 1
    # b's row of slot 1 was run as the normal row at 3 with token 9, in the new epoch
    assert b.position.tolist() == [5, 3]
    assert b.is_spec.tolist() == [True, False]
    assert b.token.tolist() == [11, 9]
    assert b.epoch.tolist() == [epochs[0], epochs[1] + 1]
    assert st.verified_len(1)[0] == 4 and st.num_unverified(1)[0] == 0
    # its result commits normally; slot 0's row at 5 verifies nothing yet (no draft launched)
    res = st.on_result(np.array([3, 4]), launched_drafts=np.array([1, 1]))
    assert res.committed.all()
    assert st.verified_len(np.array([0, 1])).tolist() == [7, 5]
    # one alternative per row, or the launch is refused before anything changes
    c = st.next_rows()
    st.on_launch(c)
    st.on_draft(c.slot, c.position, c.epoch, np.array([5, 6]), np.array([0.5, 0.5]))
    d = st.next_rows()
    with pytest.raises(SlotStateError):
        st.on_launch(d, alternatives=np.array([1]))
    st.on_launch(d, alternatives=st.conditional_alternatives(d))


def test_verdicts_on_drafts_never_made_act_but_are_not_counted() -> None:
    """A batch whose drafts stage 0 did not make launched its speculative successors on
    placeholders: their verdicts convert and commit as any other, and are counted apart from
    the accepted and rejected drafts."""
    st = SlotState(4, depth=3)
    st.admit(0, 5, 7)
    st.admit(1, 3, 2)
    a = st.next_rows()
    st.on_launch(a)
    placeholder = np.zeros(2, dtype=np.int64)
    st.on_draft(a.slot, a.position, a.epoch, placeholder, np.zeros(2))
    b = st.next_rows()
    st.on_launch(b, alternatives=st.conditional_alternatives(b))
    # slot 0's true token happens to be the placeholder: accepted; slot 1's is not: redone
    res = st.on_result(np.array([0, 9]), launched_drafts=placeholder, count_verdicts=False)
    assert res.verdict.tolist() == [int(Verdict.ACCEPTED), int(Verdict.REJECTED)]
    assert st.stats.accepted == st.stats.rejected == 0
    assert st.stats.unmade_drafts_verified == 2 and st.stats.rows_redone == 1
    assert b.token.tolist() == [0, 9] and st.verified_len(np.array([0, 1])).tolist() == [6, 4]
    st.on_result(np.array([4, 5]), launched_drafts=np.array([1, 1]))
    assert st.stats.appended == st.stats.tokens_committed == 4
