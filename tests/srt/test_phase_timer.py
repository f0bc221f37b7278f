"""Per-phase wall and thread-CPU timers of the event loops (srt/stats.py)."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from spexis_sglang.srt.stats import (
    SP_PHASES,
    STOCK_PP_PHASE_METHODS,
    PhaseTimer,
    StockPPPhaseTimers,
)

MS = 1e-3
# thread_time's reading of a sleep: nothing, give or take the interpreter's own work
IDLE_CPU = 5 * MS


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time (however contended the machine is)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_marks_split_an_iteration_and_cpu_time_leaves_out_waits():
    timer = PhaseTimer(SP_PHASES)
    timer.start()
    burn(20 * MS)
    timer.mark("schedule")
    time.sleep(0.05)
    timer.mark("wait_output")
    burn(10 * MS)
    timer.mark("process")
    timer.mark("process")  # marks accumulate; an empty span adds ~0
    timer.commit()
    d = timer.as_dict()
    assert d["cpu_schedule_s"] == pytest.approx(20 * MS, abs=IDLE_CPU)
    assert d["cpu_process_s"] == pytest.approx(10 * MS, abs=IDLE_CPU)
    assert d["cpu_wait_output_s"] < IDLE_CPU
    assert d["time_wait_output_s"] >= 0.05
    assert d["time_schedule_s"] >= d["cpu_schedule_s"] * 0.99
    phases = [f"cpu_{p}_s" for p in SP_PHASES]
    assert sum(d[k] for k in phases) <= d["cpu_busy_s"] + 1e-6
    assert sum(d[f"time_{p}_s"] for p in SP_PHASES) <= d["time_busy_s"] + 1e-6
    assert timer.iterations == 1
    assert set(d) == {"time_busy_s", "cpu_busy_s", "decode_time_busy_s"} | {
        f"{kind}_{p}_s" for kind in ("time", "cpu", "decode_time") for p in SP_PHASES
    } | {"decode_timed_iterations"}
    assert d["decode_timed_iterations"] == 0 and d["decode_time_busy_s"] == 0.0


def test_decode_only_iterations_also_go_to_the_decode_totals():
    timer = PhaseTimer(SP_PHASES)
    for decode_only, ms in ((False, 30), (True, 10), (True, 10)):
        timer.start()
        burn(ms * MS)
        timer.mark("launch")
        timer.commit(decode_only=decode_only)
    d = timer.as_dict()
    assert timer.iterations == 3 and d["decode_timed_iterations"] == 2
    # wall times: at least the CPU burnt (a busy machine only adds), the first iteration's
    # 30 ms left out of the decode totals
    assert d["decode_time_launch_s"] >= 0.99 * 20 * MS
    assert d["time_launch_s"] - d["decode_time_launch_s"] >= 0.99 * 30 * MS
    assert d["decode_time_busy_s"] >= d["decode_time_launch_s"]
    assert d["time_busy_s"] - d["decode_time_busy_s"] >= 0.99 * 30 * MS


def test_a_phase_span_is_taken_out_of_the_enclosing_mark_and_nested_spans_stay_outer():
    timer = PhaseTimer(SP_PHASES)
    timer.start()
    burn(10 * MS)
    with timer.phase("draft_sync"):
        burn(15 * MS)
        with timer.phase("process"):  # nested: stays draft_sync's
            burn(5 * MS)
    burn(10 * MS)
    timer.mark("schedule")
    timer.commit()
    d = timer.as_dict()
    assert d["cpu_draft_sync_s"] == pytest.approx(20 * MS, abs=IDLE_CPU)
    assert d["cpu_schedule_s"] == pytest.approx(20 * MS, abs=IDLE_CPU)
    assert d["cpu_process_s"] == 0.0
    assert d["cpu_busy_s"] == pytest.approx(40 * MS, abs=IDLE_CPU)


def test_discarded_and_restarted_iterations_count_nothing():
    timer = PhaseTimer(SP_PHASES)
    timer.start()
    burn(5 * MS)
    with timer.phase("draft_sync"):
        burn(5 * MS)
    timer.mark("schedule")
    timer.discard()
    timer.start()
    burn(5 * MS)
    timer.mark("launch")
    timer.start()  # the previous iteration was never committed: dropped
    timer.mark("process")
    timer.commit()
    timer.commit()  # not started: a no-op
    d = timer.as_dict()
    assert timer.iterations == 1
    assert d["cpu_schedule_s"] == d["cpu_launch_s"] == d["cpu_draft_sync_s"] == 0.0
    assert d["cpu_busy_s"] < IDLE_CPU


@dataclass(frozen=True, slots=True)
class FakeReceiver:
    """Frozen and slotted, like SGLang's SchedulerRequestReceiver (it cannot be patched)."""

    max_recv_per_poll: int = -1

    def recv_requests(self):
        burn(1 * MS)
        return []


class FakeStockScheduler:
    """The methods stock event_loop_pp calls, each burning a known CPU time."""

    def __init__(self):
        self.request_receiver = FakeReceiver()

    def process_input_requests(self, reqs):
        burn(1 * MS)

    def _pp_send_pyobj_to_next_stage(self, data, async_send=False):
        return []

    def get_next_batch_to_run(self, running_batch=None, last_batch=None):
        burn(2 * MS)
        return "plan"

    def _pp_recv_proxy_tensors(self):
        return None

    def _pp_launch_batch(self, mb_id, batch, proxy, metadata, queue):
        burn(4 * MS)
        return "result", "event"

    def _pp_commit_send_output_work_and_preprocess_output_tensors(self, a, b):
        time.sleep(0.01)
        return None, None, None

    def _pp_process_batch_result(self, batch, result):
        burn(3 * MS)

    def _pp_send_dict_to_next_stage(self, tensors, async_send=False, msg_type=""):
        return []


def _batch(rows: int, decode: bool = True):
    mode = SimpleNamespace(is_decode=lambda: decode)
    return SimpleNamespace(forward_mode=mode, batch_size=lambda: rows)


def _step(s: FakeStockScheduler, batch) -> None:
    """One micro-batch step in stock event_loop_pp's order (no batch: an idle step)."""
    reqs = s.request_receiver.recv_requests()
    s.process_input_requests(reqs)
    s._pp_send_pyobj_to_next_stage(reqs, async_send=True)
    assert s.get_next_batch_to_run(running_batch=None, last_batch=None) == "plan"
    if batch is not None:
        s._pp_recv_proxy_tensors()
        assert s._pp_launch_batch(0, batch, None, None, None) == ("result", "event")
    s._pp_commit_send_output_work_and_preprocess_output_tensors(0, 1)
    if batch is not None:
        s._pp_process_batch_result(batch, "result")
        s._pp_send_dict_to_next_stage({}, async_send=True, msg_type="proxy")


def test_stock_pp_timers_wrap_the_loops_calls_and_count_busy_steps_and_decode_rows():
    s = FakeStockScheduler()
    timers = StockPPPhaseTimers(s)
    for batch in (_batch(5, decode=False), _batch(4), _batch(4), None, _batch(4)):
        _step(s, batch)
    _step(s, None)  # a step is counted when the next one begins
    assert s.request_receiver.max_recv_per_poll == -1  # the rest is the receiver's own
    d = timers.as_dict()
    assert d["iterations"] == 4  # the idle step is not counted
    assert d["decode_iterations"] == 3 and d["decode_rows"] == 12
    assert d["decode_timed_iterations"] == 3  # the prefill's step is not decode-only
    assert d["decode_time_launch_s"] >= 0.99 * 3 * 4 * MS  # wall: at least the CPU burnt
    assert d["time_launch_s"] - d["decode_time_launch_s"] >= 0.99 * 4 * MS  # the prefill's
    assert d["cpu_schedule_s"] == pytest.approx(4 * 4 * MS, abs=4 * IDLE_CPU)
    assert d["cpu_launch_s"] == pytest.approx(4 * 4 * MS, abs=4 * IDLE_CPU)
    assert d["cpu_process_s"] == pytest.approx(4 * 3 * MS, abs=4 * IDLE_CPU)
    assert d["cpu_wait_output_s"] < 4 * IDLE_CPU
    assert d["time_wait_output_s"] >= 4 * 0.01
    assert d["cpu_busy_s"] >= d["cpu_schedule_s"] + d["cpu_launch_s"] + d["cpu_process_s"]


def test_a_stock_step_that_processes_a_prefill_is_not_decode_only():
    s = FakeStockScheduler()
    timers = StockPPPhaseTimers(s)
    prefill, decode = _batch(5, decode=False), _batch(4)
    reqs = s.request_receiver.recv_requests()
    s.process_input_requests(reqs)
    s._pp_launch_batch(0, decode, None, None, None)
    s._pp_process_batch_result(prefill, "result")  # an older micro-batch's prefill comes back
    _step(s, decode)
    _step(s, None)
    d = timers.as_dict()
    assert d["iterations"] == 2 and d["decode_timed_iterations"] == 1


def test_the_wrapped_methods_are_the_ones_sglangs_event_loop_pp_calls():
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_pp_mixin import SchedulerPPMixin

    loop = inspect.getsource(SchedulerPPMixin.event_loop_pp)
    assert "self.request_receiver.recv_requests()" in loop
    for names in STOCK_PP_PHASE_METHODS.values():
        for name in names:
            assert f"self.{name}(" in loop, name
            assert callable(getattr(Scheduler, name)), name


def test_stat_deltas_count_every_counter_and_no_gauge():
    from spexis_sglang.core.sp_stats import SPStats
    from spexis_sglang.srt.stats import STAT_GAUGES, spexis_state, stat_deltas

    stats, phases = SPStats(), PhaseTimer(SP_PHASES)
    before = spexis_state(stats, phases)
    for name in stats.__dataclass_fields__:
        setattr(stats, name, getattr(stats, name) + 2)
    phases.start()
    phases.mark("schedule")
    phases.commit()
    delta = stat_deltas(before, spexis_state(stats, phases))
    assert set(STAT_GAUGES) == {"alpha", "new_token_ratio", "running_requests"} and not set(
        STAT_GAUGES
    ) & set(delta)
    ints = {k: v for k, v in delta.items() if not k.endswith("_s")}
    assert ints.pop("decode_timed_iterations") == 0  # the iteration was not marked decode-only
    assert ints == {k: 2 for k in stats.__dataclass_fields__ if k not in STAT_GAUGES}
    assert delta["cpu_busy_s"] >= 0 and "time_schedule_s" in delta
    # derived ratios are not counters
    assert "acceptance_rate" not in delta and "effective_batch_ratio" not in delta


class _FakeEvent:
    """A CUDA event that records the stream it was recorded on; done at once."""

    def __init__(self, clock: list) -> None:
        self.clock, self.stream, self.at = clock, "unrecorded", None

    def record(self, stream=None) -> None:
        self.stream, self.at = stream, self.clock[0]

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return end.at - self.at


def test_gpu_timer_spans_a_forward_on_the_stream_it_runs_on():
    """Under SGLang's overlap scheduler (PP=1) a forward runs on the scheduler's forward
    stream: both events of its span go there (on the current stream they bracketed ~1.1 ms
    of a 10-25 ms forward); without overlap (every PP server) on the current stream."""
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler
    from spexis_sglang.srt.stats import GpuForwardTimer

    timer = GpuForwardTimer("pp rank 0", log_every_s=1e9)
    clock = [0.0]
    timer._torch = SimpleNamespace(cuda=SimpleNamespace(Event=lambda **_: _FakeEvent(clock)))
    forward = object()
    overlap = SimpleNamespace(enable_overlap=True, forward_stream=forward)
    plain = SimpleNamespace(enable_overlap=False, forward_stream=object())
    assert SpexisScheduler.sp_forward_stream(overlap) is forward
    assert SpexisScheduler.sp_forward_stream(plain) is None
    for scheduler, ms in ((overlap, 12.5), (plain, 4.0)):
        stream = SpexisScheduler.sp_forward_stream(scheduler)
        start = timer.start(stream)
        clock[0] += ms
        timer.stop(start, 16, 16 * 100, stream)
        assert [e.stream for e in timer._pending[-1][1:]] == [stream, stream]
        timer.poll()
    assert timer.as_dict() == {"16@64": [2, pytest.approx((12.5 + 4.0) / 2)]}
