"""Serving under load: Poisson request-rate sweeps per server configuration.

For each configuration the server is started once (one server at a time); then, for each
request rate, SGLang's own load generator (``python -m spexis_sglang.bench_serving``, i.e.
``sglang.benchmark.serving`` unchanged, run in this process so that its imports are paid once;
its warm-up request only on a server's first rate) sends the same workload (same requests,
same ``--seed``) with Poisson arrivals. Recorded per rate:

* **mean normalized latency**: the mean over requests of end-to-end latency / output tokens
  (the paper's serving metric), the end-to-end latency of a request being its TTFT plus its
  inter-token latencies as bench_serving measures them (``--output-details``);
* TTFT and TPOT (mean, p50, p99), request and output-token throughput, completed requests;
* retractions (requests retracted in this rate's part of the server log, stock SGLang's lines
  and Spexis's: ``spexis_sglang.testing.count_retractions``), and
  from ``/server_info`` ``internal_states[0]["spexis"]`` the counters' change over the rate:
  acceptance, tokens committed per row, dropped drafts, delayed admissions, decode forwards
  replayed from CUDA graphs; for stock servers, SGLang's decode log lines by
  ``cuda graph: True/False``;
* the machine's load average before and after (``os.getloadavg``): on a shared box latency is
  only as good as the contention it ran under;
* the CPU seconds of the server's processes over the rate (by process) and the output tokens
  per CPU-second of the busiest one (what the configuration costs, far less moved by other
  tenants than wall time; on a CPU machine with a core per process it bounds throughput).

**Max rate under SLO**: the highest swept rate, below which no rate failed, whose mean
normalized latency is at most ``K`` times the configuration's own value at the lowest rate
(``--slo-k``, default 2: latency may double relative to a lightly loaded server); also the rate
where the latency-vs-rate line crosses that threshold (linear interpolation between the last
swept rate under it and the first over it; a lower bound, marked ``slo_reached: false``, when
no swept rate went over). Both also against one common threshold, ``K`` times the lowest of
all configurations' values at the lowest rate (the same absolute SLO for everyone). Ratios are
against ``--baseline`` (default: ``plain``, stock SGLang PP=N). A plot shows mean normalized
latency vs rate, one line per configuration.

Workloads (``--workload``; :mod:`spexis_sglang.data.workloads` has the details):

* ``random``: random token ids, ``--input-len`` / ``--output-len`` / ``--range-ratio``;
* ``sharegpt``: ShareGPT first turns (chat-formatted), output length = the length of the
  conversation's answer, capped at ``--max-output-len``;
* ``specbench``: the SpecBench-like six-category mix, every request up to ``--max-output-len``;
* ``long``: ShareGPT conversations with answers of at least ``--long-min-output-len`` tokens;
* ``FILE.json``: a workload written by ``--export-workload``: lengths only (committed ones in
  ``benchmark/serving/workloads/``), replayed with synthetic prompts of the same lengths (dummy
  weights), or ``--with-text`` (real prompts for real weights on a machine without the data
  packages; not committed, rebuilt by the same command).

The requests go to bench_serving as a ShareGPT-format file (``--dataset-name sharegpt
--dataset-path FILE``) built here from the packaged data. ``ignore_eos`` (``--ignore-eos``):
``auto`` = on with dummy weights or the random workload (every request runs to its length),
off for a dataset on real weights (the model ends at EOS, at the latest at its length: what the
length predictor and look-ahead admission are about). With ``--load-format dummy`` the prompts
are synthetic words of the same token lengths and the servers get a synthetic word-level
tokenizer covering the model's vocabulary (``--synthetic-vocab``; the 8B-shaped configs have no
tokenizer, and a dummy model emits ids any real small tokenizer would decode to nothing).

Configurations (``--configs``): ``pp1`` (stock SGLang, one stage: the reference where it
fits), ``plain`` (stock SGLang PP=N; ``plain-depth1`` with ``--pp-async-batch-depth 1``),
``tp`` (stock TP=N), ``sp`` (Spexis SP, ``--draft-head``, alpha 0), ``sp-alpha`` (+
``--spexis-alpha``: ``--alpha auto`` = the value the alpha chooser recorded in the draft
head's artifact, ``extra.alpha.affine``), ``sp-la`` (+ the length predictor and
``--spexis-lookahead-admission``; ``sp`` plus those under forced acceptance, where alpha's
drops buy nothing): the paper's Figure-8 breakdown; ``plain-mixed`` and ``sp-mixed``
(``plain`` and ``sp`` with ``--enable-mixed-chunk``: decode rows ride along prefill chunks);
more with ``--config NAME='ARGS'``. ``--server-args`` is appended to every server (the same
KV budget for all: ``--max-total-tokens``), ``--sp-args`` to the SP ones (e.g. forced
acceptance), ``--bench-args`` to every bench_serving call.

CPU run committed (default model, PP=2; ``benchmark/README.md`` has the command and result)::

    .venv/bin/python benchmark/serving/serving.py --workload sharegpt --num-prompts 16 \\
        --max-input-len 384 --max-output-len 64 --configs plain,sp,sp-alpha,sp-la,pp1 \\
        --rates 0.15,0.3,0.6,1.2 --server-args '--max-total-tokens 1024' --time-budget 2400 \\
        --min-config-s 300 --label 'CPU, default model, PP=2,' \\
        --out benchmark/results/cpu_serving_sharegpt.json

Merge the results of several calls (GPU: one call cannot hold every server) and recompute
the analysis and the plot: ``serving.py --merge a.json b.json --out all.json``. CPU numbers are
correctness-level (2 shared cores, torch-native attention).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple, Union

import requests

from spexis_sglang.testing import count_retractions

logger = logging.getLogger("benchmark.serving")

BUILTIN_CONFIGS = (
    "pp1",
    "plain",
    "plain-depth1",
    "tp",
    "sp",
    "sp-alpha",
    "sp-la",
    "plain-mixed",
    "sp-mixed",
)
DATASET_WORKLOADS = ("sharegpt", "specbench", "long")
DEFAULT_MAX_OUTPUT_LEN = 256


# ----------------------------------------------------------------------------- configurations
def _arg_value(args: List[str], *names: str) -> Optional[str]:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def model_path_of(server_args: List[str]) -> str:
    """The served model's directory (the default model's when ``--model-path`` is absent)."""
    path = _arg_value(server_args, "--model-path", "--model")
    if path:
        return path
    from spexis_sglang.default_model import ensure_default_model

    return ensure_default_model()


def is_dummy(server_args: List[str]) -> bool:
    return _arg_value(server_args, "--load-format") == "dummy"


def chosen_alpha(draft_head: str, model_path: str, pp_size: int) -> float:
    """The alpha the chooser recorded in the draft head's artifact (``extra.alpha.affine``)."""
    if draft_head.startswith("random:"):
        raise SystemExit(
            "--alpha auto needs a trained head's artifact; with a random head pass --alpha X"
        )
    path = draft_head
    if draft_head == "bundled":
        from spexis_sglang.srt.bundled import bundled_draft_head

        path = bundled_draft_head(model_path, pp_size)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    try:
        return float(cfg["extra"]["alpha"]["affine"])
    except (KeyError, TypeError, ValueError):
        raise SystemExit(f"{path}/config.json records no extra.alpha.affine: pass --alpha X")


def build_configs(
    args: argparse.Namespace, alpha: Union[float, str, None]
) -> List[Tuple[str, List[str]]]:
    """The servers' arguments per configuration. ``alpha``: a drop ratio, or ``"auto"`` (the
    server's own online chooser, ``--spexis-alpha auto``)."""
    common = shlex.split(args.server_args)
    plain = ["--pp-size", str(args.pp_size)] + common
    sp_args = shlex.split(args.sp_args)
    sp = plain + ["--spexis-draft-head", args.draft_head] + sp_args
    alpha_args = ["--spexis-alpha", str(alpha)] if alpha is not None else []
    if args.length_oracle:  # benchmark only: the true lengths, degraded (dummy weights)
        lengths = ["--spexis-benchmark-length-oracle", args.length_oracle]
    else:
        lengths = ["--spexis-length-predictor", args.length_predictor]
    # Under forced acceptance a draft's verdict does not depend on its confidence, so a fixed
    # alpha's drops buy nothing there: sp-la then measures look-ahead admission alone, not
    # alpha's cost. The online chooser stays: it falls back to PP's schedule where SP cannot pay.
    forced = "--spexis-benchmark-force-accept" in sp_args
    la_alpha = [] if forced and alpha != "auto" else alpha_args
    known = {
        "pp1": ["--pp-size", "1"] + common,
        "plain": plain,
        # stock PP with one micro-batch launched ahead (its other setting worth trying)
        "plain-depth1": plain + ["--pp-async-batch-depth", "1"],
        "tp": ["--tp-size", str(args.pp_size)] + common,
        "sp": sp,
        "sp-alpha": sp + alpha_args,
        "sp-la": sp + la_alpha + lengths + ["--spexis-lookahead-admission"],
        # decode rows ride along prefill chunks (SGLang's --enable-mixed-chunk; SP's rows too)
        "plain-mixed": plain + ["--enable-mixed-chunk"],
        "sp-mixed": sp + ["--enable-mixed-chunk"],
    }
    configs = []
    for name in [c for c in args.configs.split(",") if c]:
        if name not in known:
            raise SystemExit(f"unknown configuration {name!r}: one of {sorted(known)}")
        configs.append((name, known[name]))
    for spec in args.config:
        name, _, extra = spec.partition("=")
        configs.append((name, shlex.split(extra) + common))
    return configs


# ----------------------------------------------------------------------------- workload
class _HFTokenizer:
    """The few methods the workload builders use, from a tokenizer directory."""

    def __init__(self, directory: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(directory)
        self.chat_template = getattr(self._tok, "chat_template", None)

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text)

    def apply_chat_template(self, *a, **kw):
        return self._tok.apply_chat_template(*a, **kw)


def load_tokenizer(directory: str):
    return _HFTokenizer(directory)


def synthetic_vocab_size(args: argparse.Namespace, model_path: str) -> int:
    if args.synthetic_vocab == "0":
        return 0
    if args.synthetic_vocab != "auto":
        return int(args.synthetic_vocab)
    if not is_dummy(shlex.split(args.server_args)):
        return 0
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    return int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"])


def ignore_eos(args: argparse.Namespace, synthetic: int) -> bool:
    if args.ignore_eos != "auto":
        return args.ignore_eos == "on"
    return args.workload == "random" or bool(synthetic) or is_dummy(shlex.split(args.server_args))


def build_rows(args: argparse.Namespace, model_path: str):
    """The workload's requests: built from the data (or read from a lengths document, its
    output lengths capped at ``--max-output-len`` when that is given)."""
    import dataclasses

    from spexis_sglang.data import workloads

    if args.workload.endswith(".json"):
        with open(args.workload) as f:
            rows = workloads.rows_from_lengths_doc(json.load(f))
        if args.max_output_len:
            rows = [
                dataclasses.replace(r, output_len=min(r.output_len, args.max_output_len))
                for r in rows
            ]
        return rows[: args.num_prompts] if args.num_prompts else rows
    tok_dir = args.tokenizer or model_path
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        from spexis_sglang.default_model import ensure_default_model

        tok_dir = ensure_default_model()  # lengths in the default model's tokens
        logger.info("no tokenizer in %s: lengths counted with %s", model_path, tok_dir)
    return workloads.build_workload(
        args.workload,
        load_tokenizer(tok_dir),
        args.num_prompts or 64,
        seed=args.seed,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len or DEFAULT_MAX_OUTPUT_LEN,
        min_output_len=args.min_output_len,
        long_min_output_len=args.long_min_output_len,
    )


def workload_build_args(args: argparse.Namespace) -> dict:
    return {
        "workload": args.workload,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "max_input_len": args.max_input_len,
        "max_output_len": args.max_output_len or DEFAULT_MAX_OUTPUT_LEN,
        "min_output_len": args.min_output_len,
        "long_min_output_len": args.long_min_output_len,
    }


def prepare_workload(args: argparse.Namespace, model_path: str, work_dir: str) -> dict:
    """Writes what bench_serving reads; returns the bench arguments, the extra server
    arguments (a synthetic tokenizer) and a description of the load for the result."""
    synthetic = synthetic_vocab_size(args, model_path)
    eos = ignore_eos(args, synthetic)
    server_extra: List[str] = []
    if args.workload == "random":
        bench = [
            "--dataset-name",
            "random-ids",
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--random-range-ratio",
            str(args.range_ratio),
            "--num-prompts",
            str(args.num_prompts or 64),
        ]
        desc = {
            "name": "random",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "requests": args.num_prompts or 64,
        }
    else:
        from spexis_sglang.data import workloads

        rows = build_rows(args, model_path)
        if synthetic:
            tok_dir = workloads.write_synthetic_tokenizer(
                os.path.join(work_dir, "synthetic-tokenizer"), synthetic
            )
            server_extra = ["--tokenizer-path", tok_dir]
            count_tok = load_tokenizer(tok_dir)
        elif not all(r.prompt for r in rows):
            raise SystemExit(
                f"{args.workload} holds lengths only: replay it on dummy weights "
                "(--load-format dummy) or pass --synthetic-vocab N (or export it --with-text)"
            )
        else:
            count_tok = load_tokenizer(args.tokenizer or _tokenizer_dir(model_path))
        path = os.path.join(work_dir, "requests.json")
        with open(path, "w") as f:
            json.dump(
                workloads.sharegpt_file_rows(rows, count_tok, synthetic, args.seed),
                f,
            )
        bench = [
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            path,
            "--num-prompts",
            str(len(rows)),
        ]
        if synthetic:
            bench += ["--tokenizer", server_extra[1]]
        desc = {
            "name": (
                os.path.basename(args.workload)
                if args.workload.endswith(".json")
                else args.workload
            ),
            "build_args": _doc_build_args(args.workload) or workload_build_args(args),
            "synthetic_prompts_vocab": synthetic or None,
            **workloads.summary(rows),
        }
    if not eos:
        bench.append("--disable-ignore-eos")
    desc["ignore_eos"] = eos
    return {"bench_args": bench, "server_extra": server_extra, "workload": desc}


def _doc_build_args(workload: str) -> Optional[dict]:
    """How a workload document was built (its own record), for a result that replays it."""
    if not workload.endswith(".json"):
        return None
    with open(workload) as f:
        doc = json.load(f)
    return {"file": os.path.basename(workload), **doc.get("build_args", {})}


def _tokenizer_dir(model_path: str) -> str:
    if os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        return model_path
    from spexis_sglang.default_model import ensure_default_model

    return ensure_default_model()


def bench_command(
    args: argparse.Namespace,
    base_url: str,
    rate: float,
    out: str,
    dataset: List[str],
    warmup: bool = True,
) -> List[str]:
    """bench_serving's arguments for one rate. ``warmup``: its one warm-up request before the
    run (a whole request alone, seconds at long outputs); needed only on a fresh server."""
    return [
        "--backend",
        "sglang",
        "--base-url",
        base_url,
        *dataset,
        "--request-rate",
        str(rate),
        "--seed",
        str(args.seed),
        "--disable-tqdm",
        "--output-details",
        "--output-file",
        out,
        *([] if warmup else ["--warmup-requests", "0"]),
        *shlex.split(args.bench_args),
    ]


def _bench_timeout(signum, frame):
    raise TimeoutError("bench_serving ran past --bench-timeout")


def run_bench_serving(bench_args: List[str], timeout: float) -> None:
    """SGLang's bench_serving (``python -m spexis_sglang.bench_serving bench_args``) in this
    process: its imports (several seconds) are paid once per sweep, not once per rate.

    Its printed report is kept back; on failure (an exception or its own ``sys.exit``, or
    after ``timeout`` seconds) RuntimeError carries its tail. A signal still unwinds."""
    from spexis_sglang.srt.bench_cli import main as bench_main

    printed, argv = io.StringIO(), sys.argv  # the bench sets sys.argv: ours is put back
    previous = signal.signal(signal.SIGALRM, _bench_timeout)
    signal.alarm(max(1, int(timeout)))
    try:
        with contextlib.redirect_stdout(printed):
            bench_main(bench_args)
    except Signalled:
        raise
    except (Exception, SystemExit) as exc:
        raise RuntimeError(f"bench_serving failed: {exc!r}\n{printed.getvalue()[-2000:]}") from exc
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.argv = argv


# ----------------------------------------------------------------------------- one rate
def spexis_state(base_url: str) -> Dict[str, float]:
    try:
        info = requests.get(base_url + "/server_info", timeout=60).json()
        return dict(info["internal_states"][0].get("spexis", {}))
    except (requests.RequestException, KeyError, IndexError, ValueError):
        return {}


def length_oracle_state(base_url: str) -> Optional[dict]:
    """A length-oracle server's targets and reached precision / recall (None: no oracle)."""
    from spexis_sglang.srt.sp_length_oracle import LENGTH_ORACLE_LABEL

    try:
        info = requests.get(base_url + "/server_info", timeout=60).json()
        return info["internal_states"][0].get(LENGTH_ORACLE_LABEL)
    except (requests.RequestException, KeyError, IndexError, ValueError):
        return None


def read_log(log_path: str) -> str:
    try:
        with open(log_path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def decode_graph_lines(log_text: str) -> Dict[str, int]:
    """SGLang's decode log lines by ``cuda graph: True/False`` (stock servers' evidence)."""
    out = {"true": 0, "false": 0}
    for line in log_text.splitlines():
        if "Decode batch" in line and "cuda graph: " in line:
            flag = line.split("cuda graph: ", 1)[1].split(",", 1)[0].strip().lower()
            if flag in out:
                out[flag] += 1
    return out


def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(values, q))


def server_cpu_times(pid: int) -> Dict[str, float]:
    """CPU seconds (user + system) of a server's process tree, by process title.

    On a contended machine wall-clock latency measures the neighbours as much as the server;
    the CPU time a configuration spends per output token does not (it is what the server
    costs, whoever else runs)."""
    import psutil

    out: Dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            cmd = p.cmdline()
            name = p.name()
        except psutil.Error:
            continue
        if "-m" in cmd[:-1]:
            title = cmd[cmd.index("-m") + 1]  # python -m spexis_sglang.launch_server
        elif "-c" in cmd[:-1]:
            title = "python -c"  # multiprocessing's helpers
        else:
            title = " ".join(cmd).strip()[:40] or name  # sglang::scheduler_PP0 (setproctitle)
        key = title
        i = 2
        while key in out:
            key, i = f"{title} #{i}", i + 1
        out[key] = t.user + t.system
    return out


def cpu_record(before: Dict[str, float], after: Dict[str, float], tokens: int) -> dict:
    delta = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}
    total = sum(delta.values())
    busiest = max(delta.values()) if delta else 0.0
    return {
        "server_cpu_s": round(total, 3),
        "server_cpu_s_by_process": delta,
        "busiest_process_cpu_s": round(busiest, 3),
        "output_tokens_per_server_cpu_s": tokens / total if total else None,
        # one process per core: the busiest one bounds the throughput of a dedicated machine
        "output_tokens_per_busiest_cpu_s": tokens / busiest if busiest else None,
    }


def loadavg() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def summarize_rate(result: dict, before: dict, after: dict, retractions: int) -> dict:
    """One rate's record from bench_serving's JSON line and the Spexis counters around it."""
    norm = []
    for ttft, itls, out_len, err in zip(
        result["ttfts"], result["itls"], result["output_lens"], result["errors"]
    ):
        if not err and out_len:
            norm.append((ttft + sum(itls)) / out_len)
    rec = {
        "request_rate": result["request_rate"],
        "completed": result["completed"],
        "failed": sum(1 for e in result["errors"] if e),
        "duration_s": result["duration"],
        "mean_normalized_latency_s": sum(norm) / len(norm) if norm else None,
        "p50_normalized_latency_s": percentile(norm, 50),
        "p99_normalized_latency_s": percentile(norm, 99),
        "request_throughput": result["request_throughput"],
        "output_throughput": result["output_throughput"],
        "total_output_tokens": result["total_output_tokens"],
        "retractions": retractions,
    }
    for metric in ("ttft", "tpot", "e2e_latency"):
        for stat in ("mean", "median", "p99"):
            rec[f"{stat}_{metric}_ms"] = result.get(f"{stat}_{metric}_ms")
    if after:
        from spexis_sglang.srt.stats import stat_deltas

        delta = stat_deltas(before, after)
        verdicts = delta.get("accepted", 0) + delta.get("rejected", 0)
        rows = sum(delta.get(k, 0) for k in ("rows_normal", "rows_spec", "rows_stale"))
        iters = delta.get("decode_iterations", 0)
        rec["spexis"] = {
            **delta,
            "acceptance_rate": delta.get("accepted", 0) / verdicts if verdicts else None,
            "tokens_per_row": delta.get("tokens_committed", 0) / rows if rows else None,
            "rows_per_iteration": rows / iters if iters else None,
        }
        # stage 0's loop by phase (wall time_*_s, thread CPU cpu_*_s), ms per iteration
        phases = {
            k: after[k] - before.get(k, 0)
            for k in after
            if k.startswith(("time_", "cpu_")) and isinstance(after[k], (int, float))
        }
        its = max(1, after.get("iterations", 0) - before.get("iterations", 0))
        if phases:
            rec["spexis"]["stage0_ms_per_iteration"] = {
                k: round(1000 * v / its, 3) for k, v in sorted(phases.items())
            }
    return rec


def run_rate(args, server, rate: float, dataset: List[str], warmup: bool = True) -> dict:
    before = spexis_state(server.base_url)
    log0 = read_log(server.log_path)
    load0 = loadavg()
    cpu0 = server_cpu_times(server.proc.pid)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.jsonl")
        cmd = bench_command(args, server.base_url, rate, out, dataset, warmup)
        t0 = time.time()
        try:
            run_bench_serving(cmd, args.bench_timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"at rate {rate}: {exc}") from exc
        with open(out) as f:
            result = json.loads(f.read().splitlines()[-1])
    log1 = read_log(server.log_path)
    new_log = log1[len(log0) :]
    rec = summarize_rate(result, before, spexis_state(server.base_url), count_retractions(new_log))
    rec["bench_wall_s"] = round(time.time() - t0, 2)
    oracle = length_oracle_state(server.base_url)
    if oracle is not None:  # benchmark only: cumulative since the server started
        rec["spexis_benchmark_length_oracle"] = oracle
    rec.update(cpu_record(cpu0, server_cpu_times(server.proc.pid), result["total_output_tokens"]))
    rec["loadavg_before"] = load0
    rec["loadavg_after"] = loadavg()
    graphs = decode_graph_lines(new_log)
    if any(graphs.values()):
        rec["decode_log_lines_by_cuda_graph"] = graphs
    return rec


def sweep(args, name: str, server_args: List[str], rates: List[float], dataset, deadline):
    from spexis_sglang.testing import ServerProcess

    logger.info("%s: starting server %s", name, " ".join(server_args))
    t0 = time.time()
    server = ServerProcess(server_args).wait_ready(timeout=args.server_timeout)
    entry = {
        "server_ready_s": round(time.time() - t0, 1),
        "loadavg_at_start": loadavg(),
        "records": [],
        "rates_not_run": [],
    }
    try:
        for rate in rates:
            if deadline and time.time() > deadline:
                entry["rates_not_run"].append(rate)
                continue
            rec = run_rate(args, server, rate, dataset, warmup=not entry["records"])
            logger.info("%s rate %s: %s", name, rate, json.dumps(rec))
            entry["records"].append(rec)
    finally:
        server.stop()
    entry["wall_s"] = round(time.time() - t0, 1)
    return entry


# ----------------------------------------------------------------------------- analysis
def max_rate_under(records: List[dict], threshold: float) -> Optional[float]:
    return slo_crossing(records, threshold)["max_rate"]


def slo_crossing(records: List[dict], threshold: float) -> dict:
    """The highest swept rate under ``threshold`` (every lower rate under it too, none failed),
    and where the latency line crosses ``threshold`` (interpolated between that rate and the
    next; the highest rate, a lower bound, when no swept rate went over)."""
    best, interp, reached = None, None, False
    prev = None
    for rec in sorted(records, key=lambda r: r["request_rate"]):
        lat = rec["mean_normalized_latency_s"]
        if lat is None or rec["failed"] or lat > threshold:
            reached = True
            if prev is not None and lat is not None and not rec["failed"]:
                r0, l0 = prev["request_rate"], prev["mean_normalized_latency_s"]
                r1 = rec["request_rate"]
                interp = r0 + (threshold - l0) * (r1 - r0) / (lat - l0)
            else:
                interp = best
            break
        best = rec["request_rate"]
        prev = rec
    if not reached:
        interp = best
    return {"max_rate": best, "crossing_rate": interp, "slo_reached": reached}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def analyse(results: Dict[str, List[dict]], k: float, baseline: Optional[str] = None) -> dict:
    results = {n: r for n, r in results.items() if r}
    lowest = {
        name: min(recs, key=lambda r: r["request_rate"])["mean_normalized_latency_s"]
        for name, recs in results.items()
    }
    valid = [v for v in lowest.values() if v is not None]
    common = k * min(valid) if valid else None
    if baseline not in results:
        baseline = next(iter(results), None)
    out = {"slo_k": k, "common_threshold_s": common, "baseline": baseline, "configs": {}}
    for name, recs in results.items():
        own_thr = k * lowest[name] if lowest[name] is not None else None
        own = slo_crossing(recs, own_thr) if own_thr is not None else {}
        shared = slo_crossing(recs, common) if common is not None else {}
        out["configs"][name] = {
            "latency_at_lowest_rate_s": lowest[name],
            "own_threshold_s": own_thr,
            "max_rate_under_slo": own.get("max_rate"),
            "crossing_rate": own.get("crossing_rate"),
            "slo_reached": own.get("slo_reached"),
            "max_rate_under_common_slo": shared.get("max_rate"),
            "crossing_rate_common": shared.get("crossing_rate"),
            "common_slo_reached": shared.get("slo_reached"),
            "peak_output_throughput": max((r.get("output_throughput") or 0) for r in recs) or None,
            # far less moved by contention: tokens per CPU-second of the server's busiest
            # process (the bound of a machine with a core per process), best over the rates
            "peak_tokens_per_busiest_cpu_s": max(
                (r.get("output_tokens_per_busiest_cpu_s") or 0) for r in recs
            )
            or None,
        }
    base = out["configs"].get(baseline, {})
    for c in out["configs"].values():
        for key in (
            "max_rate_under_slo",
            "crossing_rate",
            "max_rate_under_common_slo",
            "crossing_rate_common",
            "peak_output_throughput",
            "peak_tokens_per_busiest_cpu_s",
        ):
            c[f"{key}_vs_baseline"] = _ratio(c[key], base.get(key))
    return out


def plot(results: Dict[str, List[dict]], analysis: dict, path: str, title: str) -> None:
    """Mean normalized latency vs rate; beside it, where recorded, output tokens per
    CPU-second of the server's busiest process (far less sensitive to contention)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = any(r.get("output_tokens_per_busiest_cpu_s") for recs in results.values() for r in recs)
    fig, axes = plt.subplots(1, 2 if cpu else 1, figsize=(11, 4.2) if cpu else (6.4, 4.2))
    axes = list(axes) if cpu else [axes]
    for name, recs in results.items():
        recs = sorted(recs, key=lambda r: r["request_rate"])
        rates = [r["request_rate"] for r in recs]
        axes[0].plot(rates, [r["mean_normalized_latency_s"] for r in recs], marker="o", label=name)
        if cpu:
            axes[1].plot(
                rates,
                [r.get("output_tokens_per_busiest_cpu_s") for r in recs],
                marker="o",
                label=name,
            )
    if analysis.get("common_threshold_s"):
        axes[0].axhline(
            analysis["common_threshold_s"],
            color="grey",
            ls="--",
            lw=1,
            label=f"common SLO ({analysis['slo_k']:g}x)",
        )
    axes[0].set_ylabel("mean normalized latency (s / output token)")
    axes[0].set_title(title, fontsize=9)
    if cpu:
        axes[1].set_ylabel("output tokens per CPU-s of the busiest server process")
        axes[1].set_title(
            "server CPU cost per token (far less sensitive to other load)", fontsize=9
        )
    for ax in axes:
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_title(doc: dict) -> str:
    wl = doc.get("workload", {})
    loads = [
        x
        for entry in doc.get("runs", {}).values()
        for r in entry.get("records", [])
        for x in (r.get("loadavg_before") or [])[:1]
    ]
    load = f", load avg {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    return (
        f"{doc.get('label', '')} {wl.get('name', '')}, {wl.get('requests', '?')} req/rate"
        f"{load} ({doc.get('machine', {}).get('nproc', '?')} cores)"
    ).strip()


def finish(doc: dict, k: float, baseline: str, out: str) -> None:
    results = {name: e["records"] for name, e in doc["runs"].items()}
    doc["analysis"] = analyse(results, k, baseline)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    if any(results.values()):
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(markdown_table(doc) + "\n\n" + latency_table(doc) + "\n")
        png = os.path.splitext(out)[0] + ".png"
        plot({n: r for n, r in results.items() if r}, doc["analysis"], png, plot_title(doc))


def _fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def markdown_table(doc: dict) -> str:
    """The analysis as a markdown table, one row per configuration."""
    an = doc["analysis"]
    lines = [
        "| config | norm. latency at lowest rate (s/token) | max rate under own SLO "
        "(crossing) req/s | vs baseline | max rate under common SLO (crossing) req/s "
        "| vs baseline | peak output tok/s | vs baseline | tokens per busiest-process CPU-s "
        "| vs baseline | acceptance | retractions | delayed admissions | load avg (1 min) |",
        "|" + " --- |" * 14,
    ]
    for name, c in an["configs"].items():
        recs = doc["runs"][name]["records"]
        sp = [r.get("spexis") or {} for r in recs]
        acc = [x["acceptance_rate"] for x in sp if x.get("acceptance_rate") is not None]
        loads = [r["loadavg_before"][0] for r in recs if r.get("loadavg_before")]
        own = f"{_fmt(c['max_rate_under_slo'])} ({_fmt(c['crossing_rate'])}" + (
            ")" if c["slo_reached"] else ", not reached)"
        )
        common = f"{_fmt(c['max_rate_under_common_slo'])} ({_fmt(c['crossing_rate_common'])}" + (
            ")" if c["common_slo_reached"] else ", not reached)"
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    _fmt(c["latency_at_lowest_rate_s"]),
                    own,
                    _fmt(c["crossing_rate_vs_baseline"]),
                    common,
                    _fmt(c["crossing_rate_common_vs_baseline"]),
                    _fmt(c["peak_output_throughput"]),
                    _fmt(c["peak_output_throughput_vs_baseline"]),
                    _fmt(c["peak_tokens_per_busiest_cpu_s"]),
                    _fmt(c["peak_tokens_per_busiest_cpu_s_vs_baseline"]),
                    f"{min(acc):.2f}-{max(acc):.2f}" if acc else "-",
                    str(sum(r.get("retractions", 0) for r in recs)),
                    str(sum(x.get("admissions_delayed", 0) for x in sp)) if any(sp) else "-",
                    f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def latency_table(doc: dict) -> str:
    """Mean normalized latency (s/token) per configuration and rate."""
    rates = sorted({r["request_rate"] for e in doc["runs"].values() for r in e["records"]})
    lines = [
        "| config | " + " | ".join(f"{x:g} req/s" for x in rates) + " |",
        "|" + " --- |" * (len(rates) + 1),
    ]
    for name, e in doc["runs"].items():
        by = {r["request_rate"]: r["mean_normalized_latency_s"] for r in e["records"]}
        lines.append(f"| {name} | " + " | ".join(_fmt(by.get(x)) for x in rates) + " |")
    return "\n".join(lines)


def merge(paths: List[str]) -> dict:
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    doc = dict(docs[0])
    if len(paths) > 1:
        doc["merged_from"] = [os.path.relpath(p) for p in paths]
    doc["configs"], doc["runs"] = {}, {}
    for d in docs:
        if d.get("workload") != docs[0].get("workload"):
            raise SystemExit(f"different workloads in {paths}: not one comparison")
        doc["configs"].update(d["configs"])
        doc["runs"].update(d["runs"])
    return doc


def suggest_rates(doc: dict, fractions=(0.1, 0.25, 0.5, 0.75, 1.0, 1.5)) -> List[float]:
    """Rates for a sweep that crosses saturation, from a probe run (``--rates LOW,1000``): the
    highest request throughput any configuration reached, times ``fractions``."""
    cap = max(
        (r.get("request_throughput") or 0)
        for entry in doc["runs"].values()
        for r in entry.get("records", [])
    )
    if cap <= 0:
        raise SystemExit("the probe completed no request")
    out = []
    for f in fractions:
        x = f * cap
        digits = max(0, 1 - int(f"{x:e}".split("e")[1]))  # two significant digits
        out.append(round(x, digits))
    return sorted(set(out))


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp-size", type=int, default=2, help="N of plain, tp and the SP configs")
    ap.add_argument("--configs", default="plain,sp", help=f"comma list of {BUILTIN_CONFIGS}")
    ap.add_argument("--config", action="append", default=[], help="NAME='SERVER ARGS'")
    ap.add_argument("--server-args", default="", help="appended to every server")
    ap.add_argument("--sp-args", default="", help="appended to the SP servers")
    ap.add_argument("--bench-args", default="", help="appended to every bench_serving call")
    ap.add_argument("--draft-head", default="bundled")
    ap.add_argument("--length-predictor", default="bundled")
    ap.add_argument(
        "--length-oracle",
        default=None,
        metavar="PRESET|P/R",
        help="BENCHMARK ONLY (dummy weights, ignore_eos): sp-la's remaining lengths come from "
        "--spexis-benchmark-length-oracle PRESET (ours, paper-l70, paper-q32, perfect, P/R) "
        "instead of --length-predictor; recorded in the result",
    )
    ap.add_argument(
        "--alpha",
        default="auto",
        help="sp-alpha / sp-la drop ratio (sp-la: none under forced acceptance); auto = the "
        "head artifact's chosen alpha; online = the server's own chooser (--spexis-alpha auto, "
        "with any head)",
    )
    ap.add_argument("--rates", default="0.5,1,2,4")
    ap.add_argument(
        "--workload",
        default="random",
        help="random, sharegpt, specbench, long, or a lengths JSON (--export-workload)",
    )
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per rate (default 64; a workload file: all of its requests)",
    )
    ap.add_argument("--input-len", type=int, default=128, help="random workload")
    ap.add_argument("--output-len", type=int, default=64, help="random workload")
    ap.add_argument("--range-ratio", type=float, default=0.5, help="random workload")
    ap.add_argument("--max-input-len", type=int, default=1024, help="prompts longer are skipped")
    ap.add_argument(
        "--max-output-len",
        type=int,
        default=None,
        help=f"output length cap (default {DEFAULT_MAX_OUTPUT_LEN}; a workload file: its own "
        "lengths, capped only when this is given)",
    )
    ap.add_argument("--min-output-len", type=int, default=4, help="shorter answers are skipped")
    ap.add_argument("--long-min-output-len", type=int, default=512, help="long workload")
    ap.add_argument("--tokenizer", default=None, help="counts the lengths (default: the model's)")
    ap.add_argument(
        "--synthetic-vocab",
        default="auto",
        help="synthetic prompts and tokenizer over this many ids; auto = the model's "
        "vocab_size with --load-format dummy, else 0 (off)",
    )
    ap.add_argument("--ignore-eos", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slo-k", type=float, default=2.0)
    ap.add_argument("--baseline", default="plain", help="ratios are against this config")
    ap.add_argument("--label", default="", help="plot title prefix")
    ap.add_argument("--server-timeout", type=float, default=900.0)
    ap.add_argument("--bench-timeout", type=float, default=3600.0)
    ap.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds for the whole run (0: none); configurations that would start with less "
        "than --min-config-s left are listed as not run, rates past it are skipped",
    )
    ap.add_argument("--min-config-s", type=float, default=120.0)
    ap.add_argument("--out", help="result JSON; the plot goes beside it (.png)")
    ap.add_argument("--export-workload", metavar="PATH", help="write the lengths and exit")
    ap.add_argument(
        "--export-sharegpt",
        metavar="PATH",
        help="write the workload as the ShareGPT-format file bench_serving reads, and exit",
    )
    ap.add_argument(
        "--with-text",
        action="store_true",
        help="--export-workload: keep the prompts (real weights on a machine without the data)",
    )
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge results, re-analyse")
    ap.add_argument("--plan", action="store_true", help="print the configurations and exit")
    ap.add_argument(
        "--suggest-rates",
        metavar="PROBE_JSON",
        help="print sweep rates from a probe run's result (0.1-1.5x its peak req/s) and exit",
    )
    args = ap.parse_args(argv)
    if not (
        args.out or args.suggest_rates or args.plan or args.export_workload or args.export_sharegpt
    ):
        ap.error("--out is required")
    return args


def portable_argv(argv: List[str]) -> List[str]:
    """The command line as recorded in a result: paths inside the repository relative to it,
    others (a device's $OUT) by their file name under ``$OUT``; whitespace runs collapsed."""
    out = []
    for a in argv:
        if os.path.isabs(a) and (os.path.exists(a) or os.path.isdir(os.path.dirname(a))):
            rel = os.path.relpath(a)
            a = rel if not rel.startswith("..") else "$OUT/" + os.path.basename(a)
        out.append(" ".join(a.split()) if "\n" in a else a)
    return out


class Signalled(SystemExit):
    """SIGTERM or SIGINT: unwinds through everything, the bench_serving run included."""


def _exit_on_signal(signum, frame):
    raise Signalled(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    # SIGTERM and SIGINT unwind (the running server is stopped, partial results kept), also
    # when started in the background, where a shell leaves SIGINT ignored
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    if args.suggest_rates:
        with open(args.suggest_rates) as f:
            print(",".join(f"{r:g}" for r in suggest_rates(json.load(f))))
        return 0
    if args.merge:
        finish(merge(args.merge), args.slo_k, args.baseline, args.out)
        logger.info("wrote %s", args.out)
        return 0

    from spexis_sglang.cpu_support import activate

    cpu = activate()
    t_start = time.time()
    common = shlex.split(args.server_args)
    model_path = model_path_of(common)
    if args.export_workload:
        from spexis_sglang.data import workloads

        if args.workload not in DATASET_WORKLOADS:
            raise SystemExit(f"--export-workload needs one of {DATASET_WORKLOADS}")
        rows = build_rows(args, model_path)
        os.makedirs(os.path.dirname(os.path.abspath(args.export_workload)), exist_ok=True)
        with open(args.export_workload, "w") as f:
            json.dump(
                workloads.lengths_doc(
                    args.workload, rows, workload_build_args(args), with_text=args.with_text
                ),
                f,
            )
            f.write("\n")
        logger.info("wrote %s: %s", args.export_workload, workloads.summary(rows))
        return 0

    if args.export_sharegpt:
        if args.workload == "random":
            raise SystemExit("--export-sharegpt needs a dataset workload")
        with tempfile.TemporaryDirectory() as tmp:
            wl = prepare_workload(args, model_path, tmp)
            if wl["server_extra"]:
                raise SystemExit("--export-sharegpt writes real prompts: not with dummy weights")
            os.makedirs(os.path.dirname(os.path.abspath(args.export_sharegpt)), exist_ok=True)
            shutil.copyfile(os.path.join(tmp, "requests.json"), args.export_sharegpt)
        logger.info(
            "wrote %s: bench_serving --dataset-name sharegpt --dataset-path %s --num-prompts %d%s",
            args.export_sharegpt,
            args.export_sharegpt,
            wl["workload"]["requests"],
            "" if wl["workload"]["ignore_eos"] else " --disable-ignore-eos",
        )
        return 0

    names = [c for c in args.configs.split(",") if c]
    alpha = None
    if {"sp-alpha", "sp-la"} & set(names):
        if args.alpha == "online":
            alpha = "auto"
        elif args.alpha == "auto":
            alpha = chosen_alpha(args.draft_head, model_path, args.pp_size)
        else:
            alpha = float(args.alpha)
    rates = sorted(float(r) for r in args.rates.split(","))
    work_dir = tempfile.mkdtemp(prefix="spexis-serving-")
    try:
        wl = prepare_workload(args, model_path, work_dir)
        configs = [(n, a + wl["server_extra"]) for n, a in build_configs(args, alpha)]
        placeholder = [
            "$WORK/" + os.path.relpath(x, work_dir) if x.startswith(work_dir) else x
            for x in wl["bench_args"]
        ]
        configs_doc = {
            n: ["$WORK/" + os.path.relpath(x, work_dir) if x.startswith(work_dir) else x for x in a]
            for n, a in configs
        }
        if args.plan:
            for name, server_args in configs_doc.items():
                print(f"{name}: {' '.join(server_args)}")
            print("bench:", " ".join(placeholder + shlex.split(args.bench_args)))
            print("workload:", json.dumps(wl["workload"]))
            return 0
        doc = {
            "argv": portable_argv(sys.argv[1:] if argv is None else argv),
            "label": args.label,
            "cpu": cpu,
            "machine": {"nproc": os.cpu_count(), "loadavg_at_start": loadavg()},
            "alpha": alpha,
            # benchmark only: sp-la's predictions came from the true lengths, degraded
            "benchmark_length_oracle": args.length_oracle,
            "workload": wl["workload"],
            "bench_args": placeholder + shlex.split(args.bench_args),
            "configs": configs_doc,
            "rates": rates,
            "runs": {},
            "not_run": {},
        }
        deadline = t_start + args.time_budget if args.time_budget else None
        for name, server_args in configs:
            if deadline and time.time() + args.min_config_s > deadline:
                doc["not_run"][name] = "time budget"
                continue
            try:
                doc["runs"][name] = sweep(
                    args, name, server_args, rates, wl["bench_args"], deadline
                )
            except Exception as e:  # noqa: BLE001 - one config failing must not lose the rest
                logger.exception("%s failed", name)
                doc["not_run"][name] = f"failed: {type(e).__name__}: {str(e)[-1500:]}"
            doc["machine"]["loadavg_at_end"] = loadavg()
            doc["wall_s"] = round(time.time() - t_start, 1)
            finish(doc, args.slo_k, args.baseline, args.out)  # partial results survive
        finish(doc, args.slo_k, args.baseline, args.out)
        logger.info("analysis: %s", json.dumps(doc["analysis"], indent=1))
        logger.info("wrote %s (wall %.0f s)", args.out, time.time() - t_start)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
