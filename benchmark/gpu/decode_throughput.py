#!/usr/bin/env python3
"""Decode throughput of SGLang PP=1 / PP=N / TP=N and Spexis SP (N stages) on the GPU machine.

For every model and every configuration the machine can hold, this starts one
``python3 -m spexis_sglang.launch_server`` after another (dummy weights, token-id prompts,
``--skip-tokenizer-init``), and measures decode at fixed batch sizes:

* each batch size B is sent twice through the ``/generate`` batch API, B fresh random
  prompts of ``--input-len`` tokens each time, ``ignore_eos``, once with ``--short-output-len``
  and once with ``--output-len`` new tokens; the difference of the two wall times divided by
  the difference of the lengths is the time of one decode step of the whole batch
  (``T_step``; prefill, admission and HTTP costs cancel). Decode throughput is ``B / T_step``;
  the end-to-end rate ``B * output_len / t_long`` is recorded too. A short run at B goes
  first, unmeasured (``--spexis-alpha auto``: its warm-up): the first run at a batch size has
  been seen to take 0.5 s longer than the next (B = 512), which read as 1.27x the rate;
* with ``SPEXIS_PHASE_TIMERS=1``, the same rate from stage 0's decode iterations
  (``counter_tok_s``: tokens per decode iteration over its loop's time per iteration; stock
  PP: B/N per iteration) and ``wall_over_counters``, the two rates' ratio: a point whose runs
  paid different one-time costs shows there as a ratio away from 1, and ``short_run_stalled``
  where a phase's difference came out negative (a short run that stalled 0.3-0.9 s inside
  its decode iterations, which inflates both rates: ``--repeats 3`` takes the median pair;
  with one pair, a point whose two rates differ by more than 10 % is measured once more and
  the pair whose rates agree best stands);
* where stage 0 reports its counters (SP; stock PP under ``SPEXIS_PHASE_TIMERS=1``), the
  steady-state rate ``steady_tok_s``: stage 0's tokens over the wall time between two of its
  ``/server_info`` polls (every ``--steady-poll-s``) during the long run, from the first after
  the short run's length to the last while every request still ran, so neither run's end
  counts (under forced acceptance SP's requests finish over several iterations, stock's on
  one step; the wall-clock difference charges SP for that spread);
* per-iteration latency in the planner's profile format (``benchmark/profiles/README.md``):
  PP=1 and TP=N: ``[B, T_step]`` (one forward pass); stock PP=N: ``[B/N, T_step/N]`` (a
  decode step of a request is N stage intervals of micro-batches of B/N; where SGLang's cap
  put all B into one micro-batch, the stages taking turns, ``[B, T_step/N]``: the rows come
  from the point's own GPU timers where it has them); Spexis SP:
  ``latency_sp`` ``[B, dt / d(decode_iterations)]`` from the server's Spexis counters
  (every running request rides every iteration), and the measured acceptance as ``theta``.

Configurations needing more GPUs than present are skipped and listed as "not run"; so are
those that do not fit in ``--time-budget``. Output under ``--out`` (default ``$OUT``):
``decode_throughput.json`` (everything), ``profile_<model>_<G>gpu.json`` (planner input, one
per GPU count with measurements), ``server_logs.tar.gz``; a short table is printed last.

Run it on the GPU machine after the site prefix (``benchmark/gpu/run_single_gpu.sh`` does
that); ``--dry-run`` prints the plan without starting anything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "python"))
CONFIGS = os.path.join(HERE, "configs")

from pipeline_ratio import (  # noqa: E402
    STAGE0,
    async_depth,
    counter_tok_s,
    forward_rows,
    wall_agrees,
)

from spexis_sglang.srt.config import ENV_PROFILE_RANGES  # noqa: E402
from spexis_sglang.testing import ServerProcess  # noqa: E402

# Required on the offline H200 machines (docs/gpu.md, offline-site appendix), the line common.sh
# reads too. NVLink-multicast flags are refused (README §4).
with open(os.path.join(HERE, "gpu_flags.txt")) as _f:
    GPU_FLAGS = _f.read().split()
FORBIDDEN = ("nvls", "symm-mem", "symm_mem", "mnnvl")

# the custom_params key of a request's own forced acceptance (srt/sp_scheduler.py)
FORCE_ACCEPT_PARAM = "spexis_force_accept"

MODELS = {
    "llama-3.1-8b": os.path.join(CONFIGS, "llama-3.1-8b"),
    "qwen3-8b": os.path.join(CONFIGS, "qwen3-8b"),
    "qwen3-32b": os.path.join(CONFIGS, "qwen3-32b"),
    # mixture of experts, 128 experts, 8 per token (3.3B active of 30.5B)
    "qwen3-30b-a3b": os.path.join(CONFIGS, "qwen3-30b-a3b"),
    "smollm2-135m": os.path.join(CONFIGS, "smollm2-135m"),
    "tiny-llama": os.path.join(CONFIGS, "tiny-llama"),
    "tiny-qwen3": os.path.join(CONFIGS, "tiny-qwen3"),
}


# ----------------------------------------------------------------------------- the plan
#: the configurations --kinds may name (plan_configs)
KINDS = ("pp1", "pp", "tp", "sp", "ppa", "spauto", "spalpha1", "spold", "spautoold")


def _config(name: str, kind: str, n: int, args: List[str], **extra: Any) -> Dict[str, Any]:
    return {"name": name, "kind": kind, "n": n, "gpus": n, "args": args, **extra}


def _sp_args(n: int, theta: float) -> List[str]:
    return [
        "--pp-size",
        str(n),
        "--spexis-draft-head",
        "random:0",
        "--spexis-benchmark-force-accept",
        f"{theta:g}",
        "--spexis-log-interval",
        "30",
    ]


def _pp_variants(name: str) -> List[Dict[str, Any]]:
    return [
        {"name": name, "theta": None, "micro": "sglang"},
        {"name": f"{name}_balanced", "theta": None, "micro": "balanced"},
    ]


def plan_configs(
    stages: List[int],
    thetas: List[float],
    kinds: List[str],
    measured_theta: Optional[float] = None,
    old_python: Optional[str] = None,
    draft_vocab: Optional[int] = None,
) -> List[Dict[str, Any]]:
    """Every configuration: name, GPUs needed, launch args, how to read its latency.

    One SP server serves every theta: each request carries its own forced acceptance in
    ``custom_params`` (a server start costs more than a whole batch sweep). The variants of a
    configuration are measured one after the other on the same server.
    """
    out: List[Dict[str, Any]] = []
    if "pp1" in kinds:
        out.append(_config("sglang_pp1", "pp1", 1, []))
    for n in stages:
        # stock PP=N: SGLang's own micro-batch cap (max running / N: a small batch can land
        # in one micro-batch) and balanced micro-batches (B/N each), on one server
        if "pp" in kinds:
            out.append(
                _config(
                    f"sglang_pp{n}",
                    "pp",
                    n,
                    ["--pp-size", str(n)],
                    variants=_pp_variants(f"sglang_pp{n}"),
                )
            )
        if "tp" in kinds:
            out.append(_config(f"sglang_tp{n}", "tp", n, ["--tp-size", str(n)]))
        if "sp" in kinds and (thetas or measured_theta is not None):
            variants = [{"name": f"spexis_sp{n}_theta{th:g}", "theta": th} for th in thetas]
            if measured_theta is not None:
                variants.append(
                    {
                        "name": f"spexis_sp{n}_theta{measured_theta:g}_measured_head",
                        "theta": measured_theta,
                        "measured_head": True,
                    }
                )
            out.append(
                _config(
                    f"spexis_sp{n}", "sp", n, _sp_args(n, variants[0]["theta"]), variants=variants
                )
            )
    for n in stages:  # after SP: the first to go when the time budget runs short
        if "ppa" in kinds:
            # stock PP with one micro-batch of slack (pp_loop_size = N + 1)
            out.append(
                _config(
                    f"sglang_pp{n}_async1",
                    "pp",
                    n,
                    ["--pp-size", str(n), "--pp-async-batch-depth", "1"],
                    variants=_pp_variants(f"sglang_pp{n}_async1"),
                )
            )
    for n in stages:
        auto = ["--spexis-alpha", "auto"]
        if "spauto" in kinds and thetas:
            # selective speculation chosen online: where speculation cannot pay, alpha drops
            # drafts until SP runs like PP
            out.append(_sp_config(f"spexis_sp{n}_alphaauto", n, thetas, auto, alpha_auto=True))
        if "spalpha1" in kinds and thetas:
            # every draft dropped: stock PP's schedule run by SP's loop (what auto falls back to)
            out.append(_sp_config(f"spexis_sp{n}_alpha1", n, thetas, ["--spexis-alpha", "1"]))
        # the same SP servers from another copy of the package (--old-python): a before /
        # after in one call
        if "spautoold" in kinds and thetas and old_python:
            name = f"spexis_sp{n}_alphaauto_before"
            out.append(_sp_config(name, n, thetas, auto, alpha_auto=True, python_path=old_python))
        if "spold" in kinds and thetas and old_python:
            out.append(_sp_config(f"spexis_sp{n}_before", n, thetas, [], python_path=old_python))
    if draft_vocab is not None:  # each SP server again, drafting among the first K ids
        out += [_with_draft_vocab(c, draft_vocab) for c in out if c["kind"] == "sp"]
    return out


def _sp_config(
    name: str, n: int, thetas: List[float], args: List[str], **kwargs: Any
) -> Dict[str, Any]:
    """An SP server with ``args`` beside SP's own, one variant per theta (``<name>_theta<t>``)."""
    variants = [{"name": f"{name}_theta{th:g}", "theta": th} for th in thetas]
    return _config(name, "sp", n, _sp_args(n, thetas[0]) + args, variants=variants, **kwargs)


def _with_draft_vocab(cfg: Dict[str, Any], k: int) -> Dict[str, Any]:
    suffix = f"_draftvocab{k}"
    variants = [{**v, "name": v["name"] + suffix} for v in cfg.get("variants", [])]
    args = cfg["args"] + ["--spexis-draft-vocab", str(k)]
    return {**cfg, "name": cfg["name"] + suffix, "args": args, "variants": variants}


def count_gpus() -> int:
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            return sum(1 for line in r.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        pass
    return 0


def default_stages(gpus: int) -> List[int]:
    """N = 2 always (listed as not run on one GPU), then powers of two up to G, and G."""
    s = {2}
    n = 4
    while n <= gpus:
        s.add(n)
        n *= 2
    if gpus >= 2:
        s.add(gpus)
    return sorted(s)


# ----------------------------------------------------------------------------- a server
class Server(ServerProcess):
    """One launch_server process (``spexis_sglang.testing.ServerProcess``) with the GPU
    machines' flags, per-rank GPU timers, and NVLink multicast refused; in the caller's
    session, so it dies with the device call."""

    def __init__(
        self,
        model_dir: str,
        args: List[str],
        port: int,
        log_path: str,
        local_cpu: bool,
        extra_env: Optional[Dict[str, str]] = None,
        python_path: Optional[str] = None,
    ):
        for a in args:
            if any(f in a for f in FORBIDDEN):
                raise SystemExit(f"refusing {a!r}: it can enable NVLink multicast")
        env = {
            "PYTHONPATH": (python_path or os.path.join(REPO, "python"))
            + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
            # every rank's decode forwards timed on the device (the stage time T of the ideal)
            "SPEXIS_GPU_TIMERS": os.environ.get("SPEXIS_GPU_TIMERS", "1"),
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
            **(extra_env or {}),
        }
        if env["NCCL_NVLS_ENABLE"] != "0":
            raise SystemExit("NCCL_NVLS_ENABLE must stay 0")
        flags = [] if local_cpu else GPU_FLAGS
        super().__init__(
            ["--model-path", model_dir, *flags, *args],
            port=port,
            env=env,
            log_path=log_path,
            new_session=False,
        )


# ----------------------------------------------------------------------------- measuring
#: the alpha controller's state recorded after an ``auto`` run (``/server_info``)
ALPHA_CONTROLLER_KEYS = (
    "latency",
    "latency_by_rows",
    "latency_curve",
    "batch",
    "profile",
    "last_choice",
    "explore_period",
    "probe_period",
    "probe_iterations",
    "changes",
    "reversals",
)


def server_state(srv: Server) -> Dict[str, Any]:
    info = srv.server_info()
    st = (info.get("internal_states") or [{}])[0]
    return {
        "spexis": st.get("spexis"),
        "spexis_alpha": st.get("spexis_alpha"),
        "gpu_forward_ms": st.get("spexis_gpu_forward_ms"),
        "pp_link": st.get("spexis_pp_link"),  # what carried the PP messages (ipc, packed, sglang)
        "max_total_num_tokens": st.get("max_total_num_tokens", info.get("max_total_num_tokens")),
        "max_running_requests": st.get("max_running_requests", info.get("max_running_requests")),
    }


def one_run(
    srv: Server,
    rng: random.Random,
    batch: int,
    in_len: int,
    out_len: int,
    vocab: int,
    timeout: float,
    theta: Optional[float] = None,
    snapshots: Optional[List[List[float]]] = None,
    gpu_states: Optional[List[Optional[Dict[str, list]]]] = None,
    polls: Optional[List[Tuple[float, Dict[str, Any]]]] = None,
    poll_s: float = 0.0,
) -> Tuple[float, Optional[Dict[str, Any]], List[int]]:
    """B fresh random prompts (no radix-cache reuse between runs), one /generate call.
    ``snapshots``: gets the wall-clock span of the ``/server_info`` call before and after it
    (what pairs a later stage's logged state with them, :func:`later_stage_phases`);
    ``gpu_states``: stage 0's GPU timers (``SPEXIS_GPU_TIMERS``) in those two answers;
    ``polls``: with ``poll_s``, stage 0's counters every ``poll_s`` seconds while the call
    runs, as ``(seconds since it began, counters)`` (:func:`steady_rate`)."""
    hi = min(vocab, 32000)
    prompts = [[rng.randrange(100, hi) for _ in range(in_len)] for _ in range(batch)]
    sampling: Dict[str, Any] = {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}
    if theta is not None:
        sampling["custom_params"] = {FORCE_ACCEPT_PARAM: theta}
    body = {"input_ids": prompts, "sampling_params": sampling}
    t0 = time.time()
    before_state = server_state(srv)
    before = before_state["spexis"]
    t1 = time.time()
    t = time.perf_counter()
    poller = _Poller(srv, t, poll_s, polls) if polls is not None and poll_s > 0 else None
    try:
        out = srv.generate(body, timeout=timeout)
    finally:
        dt = time.perf_counter() - t
        if poller is not None:
            poller.stop()
    t2 = time.time()
    after_state = server_state(srv)
    after = after_state["spexis"]
    if snapshots is not None:
        snapshots += [[t0, t1], [t2, time.time()]]
    if gpu_states is not None:
        gpu_states += [before_state["gpu_forward_ms"], after_state["gpu_forward_ms"]]
    if isinstance(out, dict):
        out = [out]
    lens = [
        int(o.get("meta_info", {}).get("completion_tokens", len(o.get("output_ids", []))))
        for o in out
    ]
    delta = None
    if before is not None and after is not None:
        from spexis_sglang.srt.stats import stat_deltas

        delta = stat_deltas(before, after)
        if "alpha" in after:  # the drop ratio in force at the end (--spexis-alpha auto moves it)
            delta["alpha_end"] = after["alpha"]
            ctrl = after_state["spexis_alpha"] or {}
            # what the chooser saw: its latency fit, batch, profile and last choice
            delta["alpha_controller"] = {k: ctrl.get(k) for k in ALPHA_CONTROLLER_KEYS}
    bad = [
        o for o in out if (o.get("meta_info", {}).get("finish_reason") or {}).get("type") == "abort"
    ]
    if bad:
        raise RuntimeError(f"request aborted: {bad[0]['meta_info']['finish_reason']}")
    return dt, delta, lens


class _Poller:
    """Stage 0's counters (``/server_info``) every ``poll_s`` seconds on a thread, each as
    ``(seconds since t0 at the middle of the call, counters)``, until :meth:`stop`."""

    def __init__(
        self, srv: Server, t0: float, poll_s: float, out: List[Tuple[float, Dict[str, Any]]]
    ) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(srv, t0, poll_s, out))
        self._thread.daemon = True
        self._thread.start()

    def _run(self, srv: Server, t0: float, poll_s: float, out: list) -> None:
        while not self._stop.wait(poll_s):
            a = time.perf_counter()
            try:
                state = server_state(srv)["spexis"]
            except Exception:  # the run's own call reports a dead server
                return
            if state and not self._stop.is_set():
                out.append(((a + time.perf_counter()) / 2 - t0, state))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


#: a steady-state window shorter than this (seconds) gives no rate: a poll's own timing
#: (~1 ms either side) would weigh more than 1 % in it
STEADY_MIN_WINDOW_S = 0.3


def steady_rate(
    polls: List[Tuple[float, Dict[str, Any]]], kind: str, batch: int, after_s: float
) -> Optional[Dict[str, Any]]:
    """Decode tokens per second while every one of the run's ``batch`` requests was running:
    stage 0's tokens between the first poll after ``after_s`` (the short run's length: every
    prefill done) and the last poll before the first request finished, over the wall time
    between the two polls. SP: committed tokens, and its ``running_requests`` gauge says
    which polls had every request running; stock PP: decode rows launched (one token each),
    every request finishing within a step of the others, so the last poll is left out.

    The wall-clock rate (two runs' difference) also charges a run's end: under forced
    acceptance SP commits a random number of tokens a row, its requests finish over several
    iterations while stock's finish on one step, and the long run's spread is the wider.
    This window leaves every run's end out, the same way for both."""
    if kind == "sp":
        key = "tokens_committed"
        full = [(t, st) for t, st in polls if st.get("running_requests") == batch]
    elif kind == "pp":
        key, full = "decode_rows", polls[:-1]
    else:
        return None
    full = [(t, st) for t, st in full if t >= after_s and key in st]
    if len(full) < 2:
        return None
    (t_a, a), (t_b, b) = full[0], full[-1]
    if t_b - t_a < STEADY_MIN_WINDOW_S or b[key] <= a[key]:
        return None
    return {
        "tok_s": (b[key] - a[key]) / (t_b - t_a),
        "window_s": round(t_b - t_a, 4),
        "polls": len(full),
    }


def phase_ms_per_iteration(
    d_short: Dict[str, float], d_long: Dict[str, float]
) -> Optional[Dict[str, float]]:
    """A loop's wall ms per iteration by phase over the long run less the short one (what
    the extra decode steps cost), from two runs' counter deltas (``stat_deltas``).

    Over decode-only iterations where the server counts them (``decode_time_*``): a phase's
    total over all iterations also holds each run's prefill, which can land in another phase
    from one run to the next, so its difference could even come out negative."""
    prefix, count = "decode_time_", "decode_timed_iterations"
    if d_long.get(count, 0) - d_short.get(count, 0) <= 0:
        prefix, count = "time_", "iterations"  # a server without decode-only totals
    iters = d_long.get(count, 0) - d_short.get(count, 0)
    if iters <= 0:
        return None
    return {
        k[len(prefix) : -len("_s")]: round(1e3 * (d_long[k] - d_short[k]) / iters, 4)
        for k in d_long
        if k.startswith(prefix) and k in d_short
    }


def measure_batch(
    srv: Server,
    cfg: Dict[str, Any],
    batch: int,
    a: argparse.Namespace,
    vocab: int,
    rng: random.Random,
    theta: Optional[float] = None,
    input_len: Optional[int] = None,
) -> Dict[str, Any]:
    """``--repeats`` short/long pairs; the pair with the median ``T_step`` is the point (one
    iteration's time jitters by ±30% between sweeps of one server), the others' step
    times and their spread are kept."""

    in_len = input_len or a.input_len

    def measure_pair() -> Dict[str, Any]:
        snapshots: List[List[float]] = []
        gpu: List[Optional[Dict[str, list]]] = []
        polls: List[Tuple[float, Dict[str, Any]]] = []
        run = (srv, rng, batch, in_len)
        opts = (vocab, a.request_timeout, theta, snapshots, gpu)
        t_s, d_s, lens_s = one_run(*run, a.short_output_len, *opts)
        t_l, d_l, lens_l = one_run(*run, a.output_len, *opts, polls, a.steady_poll_s)
        steps = a.output_len - a.short_output_len
        t_step = (t_l - t_s) / steps
        rec: Dict[str, Any] = {
            "batch": batch,
            "input_len": in_len,
            "t_short_s": round(t_s, 4),
            "t_long_s": round(t_l, 4),
            "outputs_ok": all(x == a.short_output_len for x in lens_s)
            and len(lens_s) == batch
            and all(x == a.output_len for x in lens_l)
            and len(lens_l) == batch,
            "t_step_s": t_step,
            "decode_tok_s": batch / t_step if t_step > 0 else None,
            "e2e_tok_s": batch * a.output_len / t_l,
            # the /server_info spans around the short and the long run (removed once the
            # later stages' states are read from the log: later_stage_phases)
            "snapshots": snapshots,
        }
        if gpu and gpu[-1]:  # this pair's own forwards (the later ranks': attach_later_stages)
            from spexis_sglang.srt.stats import gpu_time_deltas

            rec["gpu_forward_ms"] = {STAGE0: gpu_time_deltas(gpu[0], gpu[-1])}
        n = cfg["n"]
        if cfg["kind"] == "pp":
            # the rows its forwards ran: B/N, or B where one micro-batch held every request
            rec["stage_batch"] = forward_rows(rec) or batch / n
            rec["stage_time_s"] = t_step / n
            if d_s is not None and d_l is not None:  # SPEXIS_PHASE_TIMERS=1: stage 0's steps
                rec["stock_phase_ms_per_iteration"] = phase_ms_per_iteration(d_s, d_l)
        if cfg["kind"] == "sp" and d_s is not None and d_l is not None:
            diters = d_l.get("decode_iterations", 0) - d_s.get("decode_iterations", 0)
            rows = lambda d: d.get("rows_normal", 0) + d.get("rows_spec", 0)  # noqa: E731
            verdicts = d_l.get("accepted", 0) + d_l.get("rejected", 0)
            rec["sp"] = {
                "short": d_s,
                "long": d_l,
                "d_decode_iterations": diters,
                "iter_time_s": (t_l - t_s) / diters if diters > 0 else None,
                "rows_per_iteration": (rows(d_l) - rows(d_s)) / diters if diters > 0 else None,
                "alpha_end": d_l.get("alpha_end"),
                "acceptance": d_l.get("accepted", 0) / verdicts if verdicts else None,
                "tokens_per_row": d_l.get("tokens_committed", 0) / rows(d_l) if rows(d_l) else None,
                # stage 0's event loop per iteration, by phase (ms), over the decode-only difference
                "phase_ms_per_iteration": phase_ms_per_iteration(d_s, d_l),
            }
        rec["counter_tok_s"] = counter_tok_s(rec, cfg["kind"], n, async_depth(cfg))
        steady = steady_rate(polls, cfg["kind"], batch, t_s)
        if steady is not None:  # every request running, the runs' ends left out
            rec["steady_tok_s"] = round(steady["tok_s"], 2)
            rec["steady_window_s"] = steady["window_s"]
            rec["steady_polls"] = steady["polls"]
        # a phase that took less time over the long run than over the short one: the short
        # run stalled inside its decode iterations (seen: 0.9 s in stage 0's wait for the
        # last stage), which inflates both rates
        phases = rec.get("stock_phase_ms_per_iteration") or (rec.get("sp") or {}).get(
            "phase_ms_per_iteration"
        )
        if phases and min(phases.values()) < 0:
            rec["short_run_stalled"] = True
        if rec["counter_tok_s"] and rec["decode_tok_s"]:
            # the wall-clock difference of two runs against stage 0's own decode iterations:
            # apart when one run paid something the other did not (a slow first run at a B)
            rec["wall_over_counters"] = round(rec["decode_tok_s"] / rec["counter_tok_s"], 4)
        return rec

    pairs = [measure_pair() for _ in range(max(1, a.repeats))]
    if len(pairs) == 1:
        return measure_again_if_wall_off(pairs[0], measure_pair)
    pairs.sort(key=lambda r: r["t_step_s"])
    rec = pairs[(len(pairs) - 1) // 2]
    steps = [r["t_step_s"] for r in pairs]
    rec["repeats_t_step_s"] = [round(t, 6) for t in steps]
    rec["repeats_spread"] = round((steps[-1] - steps[0]) / rec["t_step_s"], 4)
    rec["outputs_ok"] = all(r["outputs_ok"] for r in pairs)
    return rec


def measure_again_if_wall_off(
    rec: Dict[str, Any], measure_pair: Callable[[], Dict[str, Any]]
) -> Dict[str, Any]:
    """One more pair where a single pair's wall rate and counter rate disagree (one run paid a
    one-time cost: a short run 1 s slow at B = 512 once read as 1.9x the rate); the pair whose
    two rates agree best stands, both pairs' numbers kept (``remeasured``)."""
    if wall_agrees(rec):
        return rec
    pairs = [rec, measure_pair()]
    best = min(pairs, key=lambda r: abs(r.get("wall_over_counters", 1.0) - 1.0))
    best["remeasured"] = {
        "t_step_s": [round(r["t_step_s"], 6) for r in pairs],
        "wall_over_counters": [r.get("wall_over_counters") for r in pairs],
    }
    return best


def auto_warmup(
    srv: Server,
    rng: random.Random,
    batch: int,
    in_len: int,
    a: argparse.Namespace,
    vocab: int,
    theta: Optional[float],
) -> Optional[float]:
    """``--spexis-alpha auto`` follows the load over a few hundred iterations (its estimates'
    half-life): before a point it runs batches shaped like the point's long run until each
    request made ``--auto-warmup-len`` new tokens, so alpha settles at this B, Theta and
    context, as a server under a steady load would run. One long batch instead would not fit
    the KV budget at large B (512 requests of 128 + 768 tokens are 459K tokens): the server
    would run a third of them at a time at three to seven times the context, and alpha would
    settle there. Returns the seconds it took (None: no warm-up)."""
    if a.auto_warmup_len <= 0:
        return None
    runs = -(-a.auto_warmup_len // a.output_len)
    total = 0.0
    for _ in range(runs):
        dt, _, _ = one_run(srv, rng, batch, in_len, a.output_len, vocab, a.request_timeout, theta)
        total += dt
    return total


def profile_point(
    srv: Server,
    name: str,
    batch: int,
    in_len: int,
    a: argparse.Namespace,
    vocab: int,
    rng: random.Random,
    theta: Optional[float],
    measured: Dict[str, Any],
) -> Dict[str, Any]:
    """Every rank's torch.profiler trace over ``--torch-profile-steps`` forwards of steady
    decode at this point, summarised by ``timeline.py`` (the traces stay under OUT/traces).

    A batch of ``3 * --output-len`` new tokens runs in the background; the profile starts
    once its prefill is surely over (the point's short run's time) and each rank stops it
    itself after the steps (SGLang's ``num_steps``), writing its trace before going on."""
    import requests
    from timeline import summarise  # benchmark/gpu/timeline.py, beside this script

    trace_dir = os.path.join(a.out, "traces", f"{name}_B{batch}")
    os.makedirs(trace_dir, exist_ok=True)
    errors: List[str] = []

    def load() -> None:
        try:
            one_run(srv, rng, batch, in_len, 3 * a.output_len, vocab, a.request_timeout, theta)
        except Exception as e:  # noqa: BLE001 - reported with the summary
            errors.append(repr(e))

    worker = threading.Thread(target=load)
    worker.start()
    time.sleep(measured.get("t_short_s") or 2.0)
    body = {
        "output_dir": trace_dir,
        "num_steps": a.torch_profile_steps,
        "activities": ["CPU", "GPU"],
        "with_stack": False,
        "record_shapes": False,
        "profile_id": name,
    }
    reply = requests.post(srv.base_url + "/start_profile", json=body, timeout=a.request_timeout)
    worker.join()
    if reply.status_code != 200:
        errors.append(f"/start_profile: {reply.status_code} {reply.text[:200]}")
    summary = summarise([trace_dir]).get(os.path.basename(trace_dir), {})
    if errors:
        summary["errors"] = errors
    return summary


def running_cap(cfg: Dict[str, Any], a: argparse.Namespace) -> int:
    """A server's ``--max-running-requests``: one more than the largest B (at exactly B,
    SGLang's PP=1 admission left the chunked prefill's last request waiting and decoded it
    alone after the other B - 1: an H100 box, B = 64 and 256; reproduced on CPU), N times that
    for stock PP=N, whose micro-batch cap SGLang bounds by it over N: so that its one
    micro-batch schedule holds every B of the call (a call up to B = 64 with a cap of 65 ran
    stock at B = 64 only in two micro-batches of 32)."""
    n = cfg["n"] if cfg["kind"] == "pp" else 1
    return n * (max(a.batches) + 1)


def set_micro_batch_cap(
    srv: Server, cfg: Dict[str, Any], variant: Dict[str, Any], batch: int, a: argparse.Namespace
) -> Optional[int]:
    """Stock PP=N's micro-batch cap for this point, through SGLang's own runtime knob:
    ``balanced``: B/N, so every stage interval carries B/N rows; ``sglang``: SGLang's default
    (max running requests / N, the server's cap being N times the largest B: every B of the
    call fits one micro-batch), where one prefill chunk can admit a whole small batch into
    the first micro-batch and leave the others empty, the stages taking turns. The better of
    the two is stock PP's best."""
    n = cfg["n"]
    micro_mode = variant.get("micro")
    if cfg["kind"] != "pp" or n < 2 or not micro_mode:
        return None
    micro = max(1, batch // n) if micro_mode == "balanced" else running_cap(cfg, a) // n
    reply = srv.post_json(
        "/set_internal_state",
        {"server_args": {"pp_max_micro_batch_size": micro}},
        a.request_timeout,
    )
    if not (isinstance(reply, list) and reply and all(reply)):  # one bool per scheduler
        raise RuntimeError(f"pp_max_micro_batch_size {micro} refused: {reply}")
    return micro


def run_config(
    model: str,
    model_dir: str,
    cfg: Dict[str, Any],
    a: argparse.Namespace,
    log_dir: str,
    deadline: float,
) -> List[Dict[str, Any]]:
    """Start one server, sweep the batch sizes for each variant (SP: each theta); one result
    per variant."""
    variants = cfg.get("variants") or [{"name": cfg["name"], "theta": None}]
    results: List[Dict[str, Any]] = []
    for v in variants:
        results.append(
            {
                "config": v["name"],
                "kind": cfg["kind"],
                "n": cfg["n"],
                "gpus": cfg["gpus"],
                "theta_forced": v.get("theta"),
                "measured_head_theta": bool(v.get("measured_head")),
                "status": "run",
                "batches": [],
                "skipped_batches": [],
            }
        )
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    args = [
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--dtype",
        a.dtype,
        "--context-length",
        str(a.context_length),
        "--max-running-requests",
        str(running_cap(cfg, a)),
        *cfg["args"],
    ]
    if not a.local_cpu:
        # every configuration's decode graphs cover its largest batch (SP runs all B rows)
        args += ["--cuda-graph-max-bs", str(max(a.batches))]
    if not a.custom_all_reduce and not a.local_cpu:
        args += ["--disable-custom-all-reduce"]
    if a.max_total_tokens:
        args += ["--max-total-tokens", str(a.max_total_tokens)]
    else:
        args += ["--mem-fraction-static", str(a.mem_fraction_static)]
    args += a.server_arg
    log = os.path.join(log_dir, f"{model}__{cfg['name']}.log")
    python_path = cfg.get("python_path")
    srv = Server(model_dir, args, a.port, log, a.local_cpu, cfg.get("env"), python_path)
    for res in results:
        res["server_args"] = args
        res["server_env"] = cfg.get("env") or {}
        if python_path:
            res["python_path"] = os.path.relpath(python_path, REPO)
        # as a reader reruns it: repository-relative, the machine's interpreter left out
        res["cmd"] = " ".join(["python3", *srv.cmd[1:]]).replace(REPO + os.sep, "")
    rng = random.Random(1234)
    current = results[0]
    try:
        srv.wait_ready(min(a.health_timeout, max(10.0, deadline - time.time())))
        state = {k: v for k, v in server_state(srv).items() if k != "spexis"}
        for res in results:
            res["ready_after_s"] = round(srv.ready_after or 0, 1)
            res.update(state)
        one_run(
            srv,
            rng,
            min(8, max(a.batches)),
            a.input_len,
            8,
            vocab,
            a.request_timeout,
            variants[0].get("theta"),
        )  # warm-up
        sweeps = [(a.input_len, a.batches)] + a.extra_inputs
        for v, res in zip(variants, results):
            current = res
            for in_len, b in [(n, b) for n, bs in sweeps for b in bs]:
                left = deadline - time.time()
                if left < a.min_batch_s:
                    res["skipped_batches"].append(
                        {"batch": b, "input_len": in_len, "why": f"time budget ({left:.0f} s left)"}
                    )
                    continue
                try:
                    micro = set_micro_batch_cap(srv, cfg, v, b, a)
                    warm_s = None
                    if cfg.get("alpha_auto"):
                        warm_s = auto_warmup(srv, rng, b, in_len, a, vocab, v.get("theta"))
                    else:  # the first run at a batch pays one-time costs: not in the point
                        one_run(
                            srv,
                            rng,
                            b,
                            in_len,
                            a.short_output_len,
                            vocab,
                            a.request_timeout,
                            v.get("theta"),
                        )
                    rec = measure_batch(srv, cfg, b, a, vocab, rng, v.get("theta"), in_len)
                    if warm_s is not None:
                        rec["auto_warmup_s"] = round(warm_s, 3)
                    if micro:
                        rec["pp_max_micro_batch_size"] = micro
                except Exception as e:  # noqa: BLE001 - record and go on
                    rec = {"batch": b, "error": repr(e)}
                    if srv.proc.poll() is not None:
                        res["batches"].append(rec)
                        raise RuntimeError(f"server died at batch {b}") from e
                res["batches"].append(rec)
                extra = ""
                if rec.get("sp"):
                    sp = rec["sp"]
                    extra = (
                        f", acc {sp['acceptance']:.3f}, rows/it {sp['rows_per_iteration']:.1f},"
                        f" it {1e3 * (sp['iter_time_s'] or 0):.2f} ms"
                        f" {sp['phase_ms_per_iteration']}"
                    )
                if rec.get("counter_tok_s"):
                    extra += (
                        f", counters {rec['counter_tok_s']:.0f} tok/s"
                        f" (wall/counters {rec['wall_over_counters']:.3f})"
                    )
                print(
                    f"  {model} {v['name']} in={in_len} B={b}: "
                    + (
                        f"{rec['decode_tok_s']:.0f} tok/s, "
                        f"step {rec['t_step_s'] * 1e3:.2f} ms{extra}"
                        if rec.get("decode_tok_s")
                        else f"{rec.get('error', 'no result')}"
                    ),
                    flush=True,
                )
        # last, when every point is measured: a process that ran torch.profiler twice has
        # been seen to crash (in Kineto's trace destructor) when the second profile ended
        v, first = variants[0], results[0]
        for rec in first["batches"]:
            if rec["batch"] not in a.torch_profile_batches or rec.get("input_len") != a.input_len:
                continue
            b, theta = rec["batch"], v.get("theta")
            try:
                set_micro_batch_cap(srv, cfg, v, b, a)
                if cfg.get("alpha_auto"):  # settled at this B again
                    auto_warmup(srv, rng, b, a.input_len, a, vocab, theta)
                rec["timeline"] = profile_point(
                    srv, cfg["name"], b, a.input_len, a, vocab, rng, theta, rec
                )
            except Exception as e:  # noqa: BLE001 - the points stand; the trace is lost
                rec["timeline"] = {"error": repr(e)}
                print(f"  {model} {cfg['name']} B={b}: profile failed: {e!r}", flush=True)
    except Exception as e:  # noqa: BLE001
        current["status"] = "failed"
        current["error"] = repr(e)
        current["log_tail"] = srv.log_tail(40)
        print(f"  {model} {cfg['name']} FAILED: {e!r}\n{current['log_tail']}", flush=True)
    finally:
        srv.stop()
    graphs = decode_graph_use(srv.log_path)
    gpu_ms = gpu_forward_times(srv.log_path)
    attach_later_stages(results, srv.log_path)
    for res in results:
        res["decode_log_lines_by_cuda_graph"] = graphs
        res["gpu_forward_ms"] = gpu_ms
    return [r for r in results if r["batches"] or r["status"] != "run"]


def logged_lines(log_path: str, prefix: str) -> Iterator[Tuple[str, str]]:
    """``(rank label, JSON text)`` of every ``PREFIX (label): {...}`` line a server's ranks
    logged (stats.GpuForwardTimer, stats.log_rank_state), in order; none if the log is gone."""
    pattern = re.compile(re.escape(prefix) + r" \((.*?)\): (\{.*\})")
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                m = pattern.search(line)
                if m:
                    yield m.group(1), m.group(2)
    except OSError:
        return


def rank_states(log_path: str) -> Dict[str, List[Dict[str, Any]]]:
    """Every state a later pipeline rank logged on a ``/server_info`` (``{rank label: [state,
    ...]}``, each with its wall-clock ``t``; stats.log_rank_state)."""
    from spexis_sglang.srt.stats import RANK_STATE_LOG_PREFIX

    out: Dict[str, List[Dict[str, Any]]] = {}
    for label, text in logged_lines(log_path, RANK_STATE_LOG_PREFIX):
        try:
            out.setdefault(label, []).append(json.loads(text))
        except ValueError:
            continue
    return out


def state_logged_for(
    seen: List[Dict[str, Any]], start: float, end: float = float("inf")
) -> Optional[Dict[str, Any]]:
    """A rank's answer to the ``/server_info`` call that began at ``start``: the first state
    it logged in [start, end) (it logs once the request is relayed to it), or None. The
    logged line: its counters under ``spexis``, its GPU timers (if on) beside them."""
    return next((st for st in seen if start <= st.get("t", -1.0) < end and st.get("spexis")), None)


def later_stage_phases(
    states: Dict[str, List[Dict[str, Any]]], snapshots: List[List[float]]
) -> Dict[str, Any]:
    """Each later rank's loop by phase over one short/long pair, as stage 0's, from the
    states it logged on the four ``/server_info`` calls (before and after the short run,
    before and after the long one): for each call, the first state the rank logged after the
    call began (it answers once the request has been relayed to it, possibly after stage 0
    has replied) and before the next call began. A rank that logged none for a call is left
    out."""
    from spexis_sglang.srt.stats import gpu_time_deltas, stat_deltas

    out: Dict[str, Any] = {}
    if len(snapshots) != 4:
        return out
    starts = [t0 for t0, _ in snapshots] + [float("inf")]
    for label, seen in states.items():
        lines = [state_logged_for(seen, starts[k], starts[k + 1]) for k in range(4)]
        if None in lines:
            continue
        picked = [line["spexis"] for line in lines]
        d_s, d_l = stat_deltas(picked[0], picked[1]), stat_deltas(picked[2], picked[3])
        out[label] = {
            "iterations": d_l.get("iterations", 0) - d_s.get("iterations", 0),
            "decode_iterations": d_l.get("decode_iterations", 0) - d_s.get("decode_iterations", 0),
            "phase_ms_per_iteration": phase_ms_per_iteration(d_s, d_l),
        }
        gpu_after = lines[3].get("spexis_gpu_forward_ms")
        if gpu_after:  # the pair's own forwards on this rank (SPEXIS_GPU_TIMERS)
            before = lines[0].get("spexis_gpu_forward_ms")
            out[label]["gpu_forward_ms"] = gpu_time_deltas(before, gpu_after)
    return out


def attach_later_stages(results: List[Dict[str, Any]], log_path: str) -> None:
    """Each measured point gets its later ranks' loop phases (``later_stages``); the
    ``/server_info`` spans that paired them are dropped from the record."""
    states = rank_states(log_path)
    for res in results:
        for rec in res.get("batches", []):
            snapshots = rec.pop("snapshots", None)
            if snapshots and states:
                later = later_stage_phases(states, snapshots)
                if later:
                    rec["later_stages"] = later
                for label, st in later.items():  # beside stage 0's, under the timer's label
                    gpu = st.pop("gpu_forward_ms", None)
                    if gpu is not None and "gpu_forward_ms" in rec:
                        rec["gpu_forward_ms"][f"{label}, tp rank 0"] = gpu


def gpu_forward_times(log_path: str) -> Dict[str, Dict[str, List[float]]]:
    """Each rank's device time per decode forward, ``{rank label: {"rows@ctx": [forwards,
    mean ms]}}``: the last line each rank logged (``SPEXIS_GPU_TIMERS``, stats.GpuForwardTimer)."""
    from spexis_sglang.srt.stats import GpuForwardTimer

    out: Dict[str, Dict[str, List[float]]] = {}
    try:
        for label, text in logged_lines(log_path, GpuForwardTimer.LOG_PREFIX):
            out[label] = json.loads(text)
    except ValueError:
        pass
    return out


def decode_graph_use(log_path: str) -> Dict[str, int]:
    """SGLang's decode log lines by ``cuda graph: True/False``: stock servers' evidence that
    decode replayed graphs (SP's is its ``decode_graph_replays`` counter)."""
    out = {"true": 0, "false": 0}
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if "Decode batch" in line and "cuda graph: " in line:
                    flag = line.split("cuda graph: ", 1)[1].split(",", 1)[0].strip().lower()
                    if flag in out:
                        out[flag] += 1
    except OSError:
        pass
    return out


# ----------------------------------------------------------------------------- profiles
def monotone_points(points: List[Tuple[float, float]]) -> List[List[float]]:
    """Strictly increasing batches, non-decreasing latency (running max; noise only)."""
    pts = sorted((b, t) for b, t in points if b > 0 and t and t > 0)
    out: List[List[float]] = []
    for b, t in pts:
        if out and b <= out[-1][0]:
            continue
        t = max(t, out[-1][1]) if out else t
        out.append([int(b) if float(b).is_integer() else round(b, 3), round(t, 6)])
    return out


def latency_table(res: Dict[str, Any]) -> List[List[float]]:
    pts = []
    for r in res["batches"]:
        if r.get("t_step_s") is None or r["t_step_s"] <= 0:
            continue
        if res["kind"] == "pp":
            pts.append((r["stage_batch"], r["stage_time_s"]))
        elif res["kind"] == "sp":
            it = (r.get("sp") or {}).get("iter_time_s")
            if it:
                pts.append((r["batch"], it))
        else:
            pts.append((r["batch"], r["t_step_s"]))
    return monotone_points(pts)


def best_per_batch_run(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One result made of the faster of ``runs`` (settings of one configuration) at each batch
    size; its ``config`` names them all."""
    by_batch: Dict[int, Dict[str, Any]] = {}
    for r in runs:
        for x in r["batches"]:
            if not x.get("decode_tok_s"):
                continue
            cur = by_batch.get(x["batch"])
            if cur is None or x["decode_tok_s"] > cur["decode_tok_s"]:
                by_batch[x["batch"]] = dict(x, config=r["config"])
    merged = dict(runs[0])
    merged["config"] = "best per batch of " + ", ".join(r["config"] for r in runs)
    merged["batches"] = [by_batch[b] for b in sorted(by_batch)]
    return merged


def build_profiles(
    model: str, results: List[Dict[str, Any]], a: argparse.Namespace
) -> Dict[int, Dict[str, Any]]:
    # the main sweep only (the --extra-input sweeps have other contexts)
    results = [
        dict(r, batches=[x for x in r["batches"] if x.get("input_len", a.input_len) == a.input_len])
        for r in results
    ]
    ok = [r for r in results if r["status"] == "run" and latency_table(r)]
    # one entry per (kind, n) for the planner: where stock PP ran in several settings (async
    # depth), the faster of them at each batch size, as the analysis compares SP against
    groups: Dict[Tuple[str, int], List[Dict[str, Any]]] = {}
    for r in ok:
        if r["kind"] != "sp":
            groups.setdefault((r["kind"], r["n"]), []).append(r)
    ok = [r for r in ok if r["kind"] == "sp"] + [
        rs[0] if len(rs) == 1 else best_per_batch_run(rs) for rs in groups.values()
    ]
    profiles: Dict[int, Dict[str, Any]] = {}
    tps = a.input_len + a.output_len
    for g in sorted({r["gpus"] for r in ok}):
        configs, theta = [], {}
        for r in ok:
            if r["gpus"] != g or r["kind"] == "sp":
                continue
            c: Dict[str, Any] = {
                "pp": r["n"] if r["kind"] == "pp" else 1,
                "tp": r["n"] if r["kind"] == "tp" else 1,
                "latency": latency_table(r),
                "note": f"measured: {r['config']}",
            }
            # the server's batch limit: --max-running-requests, or fewer if the KV pool is smaller
            cap = min(int(r.get("max_running_requests") or max(a.batches)), max(a.batches))
            if r.get("max_total_num_tokens"):
                cap = min(cap, int(r["max_total_num_tokens"]) // tps)
                c["note"] += f"; KV pool {r['max_total_num_tokens']} tokens"
            c["max_batch"] = max(1, cap)
            if r["kind"] == "pp":
                sps = [
                    s
                    for s in ok
                    if s["kind"] == "sp"
                    and s["n"] == r["n"]
                    and not s.get("server_env")
                    and not s.get("measured_head_theta")
                ]
                if sps:
                    sp = min(sps, key=lambda s: abs((s["theta_forced"] or 0) - 0.76))
                    c["latency_sp"] = latency_table(sp)
                    accs = [(b.get("sp") or {}).get("acceptance") for b in sp["batches"]]
                    accs = [x for x in accs if x is not None]
                    theta[str(r["n"])] = (
                        round(sum(accs) / len(accs), 4) if accs else sp["theta_forced"]
                    )
                    c["note"] += f"; latency_sp from {sp['config']}"
            configs.append(c)
        if not configs:
            continue
        # the planner needs theta for every pp >= 2 config
        for c in configs:
            if c["pp"] >= 2 and str(c["pp"]) not in theta:
                theta[str(c["pp"])] = 0.0
                c["note"] += "; no SP run: theta 0 placeholder"
        p: Dict[str, Any] = {
            "name": f"{model}-shaped (dummy weights), {g} x H200, measured",
            "description": (
                f"benchmark/gpu/decode_throughput.py: input {a.input_len}, output "
                f"{a.output_len} tokens, T from the {a.short_output_len}/{a.output_len} "
                "difference; SGLang 0.5.17, triton attention, no CUDA graphs"
            ),
            "num_gpus": g,
            "tokens_per_seq": tps,
            "configs": configs,
        }
        if theta:
            p["theta"] = theta
        profiles[g] = p
    return profiles


def validate_profile(path: str) -> Optional[str]:
    try:
        sys.path.insert(0, os.path.join(REPO, "python"))
        from spexis_sglang.core.planner import load_profile  # noqa: WPS433

        load_profile(path)
        return None
    except Exception as e:  # noqa: BLE001
        return repr(e)


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help=f"model config name ({', '.join(MODELS)}) or a config dir; repeatable. "
        "Default: llama-3.1-8b",
    )
    p.add_argument("--num-gpus", type=int, default=None, help="default: nvidia-smi -L count")
    p.add_argument(
        "--stages",
        default="auto",
        help="N for PP=N / TP=N / SP N stages, comma list; auto = 2, powers of two up "
        "to the GPU count, and the GPU count",
    )
    p.add_argument(
        "--kinds",
        default="pp1,pp,tp,sp",
        help=f"subset of {','.join(KINDS)} (ppa: stock PP with "
        "--pp-async-batch-depth 1; spauto, spalpha1: SP with --spexis-alpha auto, 1; spold, "
        "spautoold: sp, spauto from --old-python)",
    )
    p.add_argument("--thetas", default="0.6,0.76,0.9", help="forced acceptances of the SP runs")
    p.add_argument(
        "--measured-theta",
        type=float,
        default=None,
        help="one more SP variant at the acceptance measured for the default model's "
        "trained head (labelled '_measured_head')",
    )
    p.add_argument("--batches", default="16,32,64,128,256,512")
    p.add_argument(
        "--extra-input",
        action="append",
        default=[],
        help="one more sweep on the same servers: LEN:B1,B2,... (e.g. 2048:16,32,64); repeatable",
    )
    p.add_argument(
        "--old-python",
        default=None,
        help="another copy of the package's python/ dir for kind spold (a before / after)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="run each SP configuration twice: as given and with --spexis-draft-vocab K",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--short-output-len", type=int, default=16)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.8,
        help="same fraction of every GPU's memory for weights + KV in every config",
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="instead of --mem-fraction-static: the same KV pool size (tokens) for all",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra launch_server argument (repeat; e.g. --server-arg=--chunked-prefill-size=8192)",
    )
    p.add_argument(
        "--no-custom-all-reduce",
        dest="custom_all_reduce",
        action="store_false",
        help="TP without SGLang's custom all-reduce (only after seeing it fail on the machine)",
    )
    p.add_argument("--port", type=int, default=30100)
    p.add_argument("--health-timeout", type=float, default=420)
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument(
        "--time-budget",
        type=float,
        default=0,
        help="seconds for the whole script (0 = none); a server is started only with "
        "--min-server-s left, a batch only with --min-batch-s left",
    )
    p.add_argument(
        "--auto-warmup-len",
        type=int,
        default=256,
        help="--spexis-alpha auto servers: before each point, batches shaped like its long "
        "run until each request made this many new tokens (alpha settles at the point's "
        "load); 0: none",
    )
    p.add_argument(
        "--torch-profile-batches",
        default="",
        help="B1,B2,...: after measuring these B (first variant of each server), trace every "
        "rank with torch.profiler (SGLang's /start_profile, loop steps named: "
        "SPEXIS_PROFILE_RANGES) over --torch-profile-steps decode forwards; traces under "
        "OUT/traces/<config>_B<B>, "
        "their summary (timeline.py) in the point's record",
    )
    p.add_argument("--torch-profile-steps", type=int, default=30)
    p.add_argument("--min-server-s", type=float, default=120)
    p.add_argument("--min-batch-s", type=float, default=15)
    p.add_argument(
        "--steady-poll-s",
        type=float,
        default=0.25,
        help="poll stage 0's counters this often during each long run for the steady-state "
        "rate (steady_tok_s: every request running, the runs' ends left out); 0: off",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="short/long pairs per batch size; the median T_step is reported (default 1)",
    )
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or os.path.join(REPO, ".gpu", "out"),
        help="output folder (default $OUT); profiles go there too unless --profiles-dir",
    )
    p.add_argument("--profiles-dir", default=None)
    p.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    p.add_argument(
        "--local-cpu",
        action="store_true",
        help="test on a CPU machine: no GPU flags (the launcher's CPU defaults)",
    )
    a = p.parse_args(argv)
    a.model = a.model or ["llama-3.1-8b"]
    a.batches = sorted({int(x) for x in a.batches.split(",") if x})
    a.torch_profile_batches = {int(x) for x in a.torch_profile_batches.split(",") if x}
    a.thetas = [float(x) for x in a.thetas.split(",") if x]
    a.kinds = [k for k in a.kinds.split(",") if k]
    a.extra_inputs = []
    for x in a.extra_input:
        n, _, bs = x.partition(":")
        a.extra_inputs.append((int(n), sorted({int(b) for b in bs.split(",") if b})))
    bad = set(a.kinds) - set(KINDS)
    if bad:
        p.error(f"--kinds: unknown {sorted(bad)}")
    if any(
        not 0 <= t <= 1
        for t in a.thetas + ([a.measured_theta] if a.measured_theta is not None else [])
    ):
        p.error("--thetas must be in [0, 1]")
    if a.short_output_len >= a.output_len or a.short_output_len < 1:
        p.error("need 1 <= --short-output-len < --output-len")
    longest = max([a.input_len] + [n for n, _ in a.extra_inputs])
    if a.context_length < longest + a.output_len + 8:
        p.error("--context-length too small for --input-len + --output-len")
    for x in a.server_arg:
        if any(f in x for f in FORBIDDEN):
            p.error(f"refusing {x!r}: NVLink multicast stays off")
    for m in a.model:
        if m not in MODELS and not os.path.isfile(os.path.join(m, "config.json")):
            p.error(f"--model {m!r}: not one of {list(MODELS)} and no config.json there")
    return a


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    if a.torch_profile_batches:
        os.environ[ENV_PROFILE_RANGES] = "1"  # the servers name their loop steps in traces
    t_start = time.time()
    deadline = t_start + a.time_budget if a.time_budget > 0 else float("inf")
    gpus = a.num_gpus if a.num_gpus is not None else count_gpus()
    stages = (
        default_stages(gpus)
        if a.stages == "auto"
        else sorted({int(x) for x in a.stages.split(",")})
    )
    cfgs = plan_configs(stages, a.thetas, a.kinds, a.measured_theta, a.old_python, a.draft_vocab)
    os.makedirs(a.out, exist_ok=True)
    log_dir = os.path.join("/tmp", f"spexis-decode-logs-{os.getpid()}")
    os.makedirs(log_dir, exist_ok=True)
    print(
        f"GPUs: {gpus}; stages {stages}; models {a.model}; batches {a.batches}; "
        f"in {a.input_len} out {a.output_len}/{a.short_output_len}",
        flush=True,
    )
    summary: Dict[str, Any] = {
        "script": "benchmark/gpu/decode_throughput.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "num_gpus": gpus,
        "stages": stages,
        "batches": a.batches,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "short_output_len": a.short_output_len,
        "kv_budget": (
            {"max_total_tokens": a.max_total_tokens}
            if a.max_total_tokens
            else {"mem_fraction_static": a.mem_fraction_static}
        ),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "models": {},
        "not_run": [],
    }
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        summary["gpu"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        summary["gpu"] = []
    out_json = os.path.join(a.out, "decode_throughput.json")

    def save() -> None:
        summary["elapsed_s"] = round(time.time() - t_start, 1)
        with open(out_json, "w") as f:
            json.dump(summary, f, indent=1)

    try:
        for model in a.model:
            model_dir = MODELS.get(model, model)
            name = model if model in MODELS else os.path.basename(os.path.normpath(model))
            results: List[Dict[str, Any]] = []
            summary["models"][name] = {
                "config_dir": os.path.relpath(model_dir, REPO),
                "results": results,
            }
            for cfg in cfgs:
                why = None
                if cfg["gpus"] > gpus:
                    why = f"needs {cfg['gpus']} GPUs, {gpus} present"
                elif deadline - time.time() < a.min_server_s:
                    why = f"time budget ({max(0, deadline - time.time()):.0f} s left)"
                if why:
                    summary["not_run"].append(
                        {"model": name, "config": cfg["name"], "why": why, "args": cfg["args"]}
                    )
                    continue
                if a.dry_run:
                    print(
                        f"would run {name} {cfg['name']}: launch_server --model-path {model_dir} "
                        + " ".join(([] if a.local_cpu else GPU_FLAGS) + cfg["args"])
                    )
                    continue
                print(f"== {name} {cfg['name']} ({time.time() - t_start:.0f} s)", flush=True)
                results.extend(run_config(name, model_dir, cfg, a, log_dir, deadline))
                save()
            profiles = build_profiles(name, results, a)
            summary["models"][name]["profiles"] = {}
            for g, prof in profiles.items():
                os.makedirs(a.profiles_dir or a.out, exist_ok=True)
                path = os.path.join(a.profiles_dir or a.out, f"profile_{name}_{g}gpu.json")
                with open(path, "w") as f:
                    json.dump(prof, f, indent=1)
                err = validate_profile(path)
                summary["models"][name]["profiles"][str(g)] = {
                    "file": os.path.basename(path),
                    "valid": err is None,
                    "error": err,
                    "profile": prof,
                }
            save()
    finally:
        save()
        if not a.dry_run and os.listdir(log_dir):
            with tarfile.open(os.path.join(a.out, "server_logs.tar.gz"), "w:gz") as t:
                t.add(log_dir, arcname="server_logs")
        shutil.rmtree(log_dir, ignore_errors=True)

    # ---- the table, last
    print(f"\nwrote {out_json}")
    for name, m in summary["models"].items():
        print(f"\n{name}: decode tok/s (ms per decode step), batches {a.batches}")
        for r in m["results"]:
            cells = []
            by_b = {x["batch"]: x for x in r["batches"] if x.get("input_len") == a.input_len}
            for b in a.batches:
                x = by_b.get(b)
                cells.append(
                    f"{x['decode_tok_s']:.0f} ({x['t_step_s'] * 1e3:.1f})"
                    if x and x.get("decode_tok_s")
                    else "-"
                )
            extra = ""
            if r["kind"] == "sp":
                accs = [(x.get("sp") or {}).get("acceptance") for x in r["batches"]]
                accs = [v for v in accs if v is not None]
                if accs:
                    extra = f" acc {sum(accs) / len(accs):.3f}"
            print(f"  {r['config']:<24} {r['status']:<6} " + " | ".join(cells) + extra)
        for g, p in m.get("profiles", {}).items():
            print(
                f"  profile {p['file']}: {'valid' if p['valid'] else 'INVALID ' + str(p['error'])}"
            )
    if summary["not_run"]:
        print("\nnot run:")
        for x in summary["not_run"]:
            print(f"  {x['model']} {x['config']}: {x['why']}")
    try:
        from pipeline_ratio import compare, print_table

        summary["comparison"] = compare(summary)
        save()
        print_table(summary["comparison"])
    except Exception as e:  # noqa: BLE001 - the measurements are saved already
        print(f"comparison failed: {e!r}")
    failed = [r for m in summary["models"].values() for r in m["results"] if r["status"] != "run"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
