"""benchmark/serving/serving.py: one rate's record from bench_serving's JSON, and max rate under
SLO.

Synthetic inputs (no server): the numbers are chosen so that every value below is exact.
"""

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "benchmark_serving", os.path.join(HERE, "..", "..", "benchmark", "serving", "serving.py")
)
serving = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serving)


def _bench_result(rate, ttfts, itls, out_lens, errors=None):
    return {
        "request_rate": rate,
        "completed": len(out_lens),
        "duration": 10.0,
        "ttfts": ttfts,
        "itls": itls,
        "output_lens": out_lens,
        "errors": errors or [""] * len(out_lens),
        "request_throughput": len(out_lens) / 10.0,
        "output_throughput": sum(out_lens) / 10.0,
        "total_output_tokens": sum(out_lens),
        "mean_ttft_ms": 1.0,
    }


def test_summarize_rate_normalized_latency_and_spexis_deltas():
    # request 1: (0.5 + 0.25 * 2) / 2 tokens = 0.5 s/token; request 2: (1 + 2) / 1 = 3 s/token
    result = _bench_result(1.0, [0.5, 1.0], [[0.25, 0.25], [2.0]], [2, 1])
    before = {"accepted": 10, "rejected": 10, "tokens_committed": 5, "rows_normal": 5}
    after = {
        "accepted": 16,
        "rejected": 12,
        "tokens_committed": 17,
        "rows_normal": 9,
        "rows_spec": 8,
        "rows_stale": 3,
    }
    rec = serving.summarize_rate(result, before, after, retractions=2)
    assert rec["mean_normalized_latency_s"] == pytest.approx(1.75)
    assert rec["failed"] == 0 and rec["retractions"] == 2
    assert rec["mean_ttft_ms"] == 1.0
    sp = rec["spexis"]
    assert sp["accepted"] == 6 and sp["rejected"] == 2
    assert sp["acceptance_rate"] == pytest.approx(0.75)
    assert sp["tokens_per_row"] == pytest.approx(12 / 15)


def test_failed_requests_are_counted_and_left_out_of_latency():
    result = _bench_result(2.0, [1.0, 0.0], [[1.0], []], [2, 0], errors=["", "timeout"])
    rec = serving.summarize_rate(result, {}, {}, retractions=0)
    assert rec["failed"] == 1
    assert rec["mean_normalized_latency_s"] == pytest.approx(1.0)
    assert "spexis" not in rec  # plain server: no Spexis counters


def _recs(points, failed_at=None):
    return [
        {"request_rate": r, "mean_normalized_latency_s": lat, "failed": int(r == failed_at)}
        for r, lat in points
    ]


def test_max_rate_under_slo_and_ratios():
    results = {
        "plain": _recs([(1, 0.10), (2, 0.15), (4, 0.25), (8, 0.5)]),
        "sp": _recs([(1, 0.08), (2, 0.10), (4, 0.15), (8, 0.21)]),
    }
    a = serving.analyse(results, k=2.0)
    assert a["baseline"] == "plain"
    assert a["common_threshold_s"] == pytest.approx(0.16)
    plain, sp = a["configs"]["plain"], a["configs"]["sp"]
    assert plain["max_rate_under_slo"] == 2  # 0.25 > 2 x 0.10
    assert sp["max_rate_under_slo"] == 4  # 0.21 > 2 x 0.08
    assert sp["max_rate_under_slo_vs_baseline"] == pytest.approx(2.0)
    assert plain["max_rate_under_common_slo"] == 2 and sp["max_rate_under_common_slo"] == 4
    # crossings: plain 0.20 between (2, 0.15) and (4, 0.25) -> 3; sp 0.16 between
    # (4, 0.15) and (8, 0.21) -> 4 + 4 / 6
    assert plain["crossing_rate"] == pytest.approx(3.0)
    assert sp["crossing_rate"] == pytest.approx(4 + 4 / 6)
    assert sp["crossing_rate_vs_baseline"] == pytest.approx((4 + 4 / 6) / 3)
    assert plain["slo_reached"] and sp["slo_reached"]


def test_baseline_is_chosen_by_name_and_unreached_slo_is_a_lower_bound():
    results = {
        "sp": _recs([(1, 0.08), (2, 0.09)]),
        "plain": _recs([(1, 0.10), (2, 0.30)]),
    }
    a = serving.analyse(results, k=2.0, baseline="plain")
    sp = a["configs"]["sp"]
    assert a["baseline"] == "plain"
    assert sp["max_rate_under_slo"] == 2 and sp["crossing_rate"] == 2
    assert sp["slo_reached"] is False  # never went over: 2 is a lower bound
    assert a["configs"]["plain"]["crossing_rate"] == pytest.approx(1.5)
    assert serving.analyse(results, k=2.0, baseline="nope")["baseline"] == "sp"


def test_a_rate_with_failures_ends_the_range():
    recs = _recs([(1, 0.1), (2, 0.1), (4, 0.1)], failed_at=2)
    assert serving.max_rate_under(recs, 1.0) == 1
    assert serving.slo_crossing(recs, 1.0)["crossing_rate"] == 1  # no interpolation into it


def test_decode_graph_lines_and_retractions_from_a_log():
    log = (
        "[x] Decode batch, #running-req: 4, cuda graph: True, gen throughput: 1\n"
        "[x] Decode batch, #running-req: 300, cuda graph: False, gen throughput: 1\n"
        "[x] Decode batch, #running-req: 4, cuda graph: True, gen throughput: 1\n"
        "[x] Spexis: KV cache pool is full, retracting request 3\n"
        "[x] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 9\n"
        "[x] Testing retraction. #retracted_reqs: 5, #new_tokens_gained: 9\n"
    )
    assert serving.decode_graph_lines(log) == {"true": 2, "false": 1}
    # one Spexis line per request; stock SGLang's line carries its count (the test-only
    # retraction line is not a KV-pool retraction)
    assert serving.count_retractions(log) == 3


def test_a_retraction_counts_once_however_many_ranks_log_it():
    """PP=2 x TP=2: all four schedulers log each retraction; DP replicas retract on their own."""
    spexis = "Spexis: KV cache pool is full, retracting request 3"
    stock = "KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 9"
    ranks = ["PP0 TP0", "PP0 TP1", "PP1 TP0", "PP1 TP1"]
    log = "".join(f"[2026-12-02 14:43:21 {r}] {line}\n" for line in (spexis, stock) for r in ranks)
    assert serving.count_retractions(log) == 3
    one_stage = "[2026-12-02 14:43:21] " + spexis + "\n"
    assert serving.count_retractions(one_stage) == 1
    two_replicas = "".join(f"[t DP{d} PP{p}] {spexis}\n" for d in (0, 1) for p in (0, 1))
    assert serving.count_retractions(two_replicas) == 2
    # a PP10 stage is not the first
    assert serving.count_retractions(f"[t PP10 TP0] {spexis}\n") == 0


def test_configurations_of_the_breakdown_share_the_server_args():
    args = serving.parse_args(
        [
            "--configs",
            "pp1,plain,sp,sp-alpha,sp-la",
            "--server-args",
            "--max-total-tokens 2048",
            "--sp-args",
            "--spexis-benchmark-force-accept 0.7",
            "--out",
            "x.json",
        ]
    )
    c = dict(serving.build_configs(args, alpha=0.3))
    assert c["pp1"] == ["--pp-size", "1", "--max-total-tokens", "2048"]
    assert c["plain"] == ["--pp-size", "2", "--max-total-tokens", "2048"]
    depth1 = dict(
        serving.build_configs(
            serving.parse_args(["--configs", "plain-depth1", "--out", "x.json"]), None
        )
    )
    assert depth1["plain-depth1"] == ["--pp-size", "2", "--pp-async-batch-depth", "1"]
    assert c["sp"][:4] == c["plain"] and "--spexis-alpha" not in c["sp"]
    assert c["sp-alpha"] == c["sp"] + ["--spexis-alpha", "0.3"]
    # forced acceptance: alpha's drops buy nothing, so sp-la is SP plus look-ahead admission
    lookahead = ["--spexis-length-predictor", "bundled", "--spexis-lookahead-admission"]
    assert c["sp-la"] == c["sp"] + lookahead
    assert "--spexis-benchmark-force-accept" in c["sp"]
    real = serving.parse_args(["--configs", "sp-alpha,sp-la", "--out", "x.json"])
    c = dict(serving.build_configs(real, alpha=0.3))
    assert c["sp-la"] == c["sp-alpha"] + lookahead
    # the server's own chooser: passed on as given, and kept by sp-la under forced acceptance
    online = dict(serving.build_configs(args, alpha="auto"))
    assert online["sp-alpha"] == online["sp"] + ["--spexis-alpha", "auto"]
    assert online["sp-la"] == online["sp-alpha"] + lookahead
    with pytest.raises(SystemExit):
        serving.build_configs(serving.parse_args(["--configs", "xx", "--out", "x"]), None)


def test_merge_combines_runs_of_one_workload(tmp_path):
    def doc(name, recs, workload="sharegpt"):
        return {
            "workload": {"name": workload},
            "configs": {name: []},
            "runs": {name: {"records": recs}},
        }

    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(serving.json.dumps(doc("plain", _recs([(1, 0.1), (2, 0.3)]))))
    b.write_text(serving.json.dumps(doc("sp", _recs([(1, 0.1), (2, 0.15)]))))
    c.write_text(serving.json.dumps(doc("tp", [], workload="long")))
    merged = serving.merge([str(a), str(b)])
    assert set(merged["runs"]) == {"plain", "sp"}
    out = tmp_path / "m.json"
    serving.finish(merged, 2.0, "plain", str(out))
    res = serving.json.loads(out.read_text())
    assert res["analysis"]["configs"]["sp"]["max_rate_under_slo_vs_baseline"] == 2.0
    assert (tmp_path / "m.png").exists()
    with pytest.raises(SystemExit, match="different workloads"):
        serving.merge([str(a), str(c)])


def test_suggested_rates_cross_the_probe_capacity():
    probe = {
        "runs": {
            "plain": {"records": [{"request_throughput": 0.4}, {"request_throughput": 12.3}]},
            "sp": {"records": [{"request_throughput": 15.0}]},
        }
    }
    assert serving.suggest_rates(probe) == [1.5, 3.8, 7.5, 11.0, 15.0, 22.0]
    with pytest.raises(SystemExit):
        serving.suggest_rates({"runs": {"x": {"records": [{"request_throughput": 0}]}}})


def test_committed_workload_documents_are_consistent():
    from spexis_sglang.data import workloads

    folder = os.path.join(HERE, "..", "..", "benchmark", "serving", "workloads")
    names = sorted(f for f in os.listdir(folder) if f.endswith(".json"))
    assert names == ["long.json", "sharegpt.json", "specbench.json"]
    for name in names:
        with open(os.path.join(folder, name)) as f:
            doc = serving.json.load(f)
        rows = workloads.rows_from_lengths_doc(doc)
        assert doc["summary"] == workloads.summary(rows)
        assert not doc["with_text"] and all(r.prompt == "" for r in rows)
        cap = doc["build_args"]["max_output_len"]
        assert all(2 <= r.output_len <= cap for r in rows)
        assert all(r.prompt_len <= doc["build_args"]["max_input_len"] for r in rows)


def test_markdown_tables_of_a_result():
    recs = [
        {
            "request_rate": r,
            "mean_normalized_latency_s": lat,
            "failed": 0,
            "output_throughput": 10.0 * r,
            "retractions": 1,
            "loadavg_before": [3.0, 2.0, 1.0],
            "output_tokens_per_busiest_cpu_s": 50.0 * r * (2 if sp else 1),
            **({"spexis": {"acceptance_rate": 0.6, "admissions_delayed": 2}} if sp else {}),
        }
        for sp in (False, True)
        for r, lat in ((1, 0.1), (2, 0.3))
    ]
    doc = {"runs": {"plain": {"records": recs[:2]}, "sp": {"records": recs[2:]}}}
    doc["analysis"] = serving.analyse({n: e["records"] for n, e in doc["runs"].items()}, 2.0)
    table = serving.markdown_table(doc).splitlines()
    assert len(table) == 4 and table[2].startswith("| plain | 0.1 | 1 (1.5) | 1 |")
    assert "| 20 | 1 | 200 | 2 | 0.60-0.60 | 2 | 4 | 3.0-3.0 |" in table[3]
    assert serving.latency_table(doc).splitlines()[2] == "| plain | 0.1 | 0.3 |"


def test_cpu_record_per_process_and_tokens_per_cpu_second():
    before = {"sglang::scheduler_PP0": 10.0, "sglang::scheduler_PP1": 5.0}
    after = {"sglang::scheduler_PP0": 14.0, "sglang::scheduler_PP1": 7.0, "detok": 1.0}
    rec = serving.cpu_record(before, after, tokens=140)
    assert rec["server_cpu_s"] == 7.0 and rec["busiest_process_cpu_s"] == 4.0
    assert rec["server_cpu_s_by_process"]["detok"] == 1.0
    assert rec["output_tokens_per_server_cpu_s"] == 20.0
    assert rec["output_tokens_per_busiest_cpu_s"] == 35.0
    assert serving.cpu_record({}, {}, 5)["output_tokens_per_busiest_cpu_s"] is None
    import subprocess
    import sys
    import time

    # a process of its own (under pytest-xdist the test process may also hold other tests'
    # servers as children): one entry, and the CPU it has used
    code = (
        "import time\nt = time.process_time()\n"
        "while time.process_time() - t < 0.2: pass\ntime.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 30
        while True:
            mine = serving.server_cpu_times(child.pid)
            if sum(mine.values()) >= 0.2 or time.time() > deadline:
                break
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait()
    assert len(mine) == 1 and list(mine.values())[0] >= 0.2


def test_recorded_command_lines_hold_no_machine_paths(tmp_path):
    inside = os.path.abspath(os.path.join(HERE, "x.json"))
    argv = ["--out", str(tmp_path / "r.json"), "--server-args", "a\n   b", "--w", inside]
    got = serving.portable_argv(argv)
    assert got[1] == "$OUT/r.json" and got[3] == "a b"
    assert got[5] == os.path.relpath(inside) and not os.path.isabs(got[5])


def test_a_workload_file_replays_its_lengths_capped_only_on_request(tmp_path):
    from spexis_sglang.data import workloads

    rows = [workloads.Request("u", "s", "c", "", 10, n) for n in (5, 300, 1000)]
    path = tmp_path / "w.json"
    path.write_text(serving.json.dumps(workloads.lengths_doc("sharegpt", rows, {})))
    args = serving.parse_args(["--workload", str(path), "--out", "x"])
    assert [r.output_len for r in serving.build_rows(args, "unused")] == [5, 300, 1000]
    args = serving.parse_args(["--workload", str(path), "--max-output-len", "64", "--out", "x"])
    assert [r.output_len for r in serving.build_rows(args, "unused")] == [5, 64, 64]
    args = serving.parse_args(["--workload", str(path), "--num-prompts", "2", "--out", "x"])
    assert len(serving.build_rows(args, "unused")) == 2


def test_bench_serving_warms_up_a_fresh_server_only():
    args = serving.parse_args(["--out", "unused.json"])
    first = serving.bench_command(args, "http://h:1", 4.0, "o.jsonl", ["--dataset-name", "x"])
    later = serving.bench_command(args, "http://h:1", 8.0, "o.jsonl", [], warmup=False)
    assert "--warmup-requests" not in first
    assert later[later.index("--warmup-requests") + 1] == "0"
    assert later[later.index("--request-rate") + 1] == "8.0"


@pytest.mark.parametrize(
    "extra, timeout, message",
    [
        # no server there: bench_serving gives up after its ready check and exits 1
        (["--ready-check-timeout-sec", "1"], 60, r"SystemExit\(1\)"),
        ([], 1, "ran past --bench-timeout"),
    ],
)
def test_bench_serving_failures_raise_and_leave_argv_alone(extra, timeout, message):
    """bench_serving runs in the sweep's process: its exit, an exception or a hang becomes a
    RuntimeError naming it (the sweep stops its server and keeps what it has), and the
    sweep's own sys.argv is put back."""
    from spexis_sglang.cpu_support import activate

    activate()
    argv = list(serving.sys.argv)
    bench = ["--backend", "sglang", "--base-url", "http://127.0.0.1:9"]
    bench += ["--dataset-name", "random-ids", "--num-prompts", "1", "--random-input-len", "4"]
    tokenizer = os.path.join(HERE, "..", "..", "benchmark", "gpu", "configs", "tiny-llama")
    bench += ["--random-output-len", "2", "--tokenizer", tokenizer]
    with pytest.raises(RuntimeError, match=message):
        serving.run_bench_serving(bench + extra, timeout)
    assert serving.sys.argv == argv
