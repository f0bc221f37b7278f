"""``python -m spexis_sglang.bench_serving`` (SGLang's own load generator, run from this project)
drives a tiny Poisson load against the SP server and writes its result JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .test_sp_lossless import sp_args, trained_head  # noqa: F401

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 12
OUTPUT_LEN = 16


def test_bench_serving_against_sp_server(server_factory, model_dir, trained_head, tmp_path):
    server = server_factory(sp_args(2, trained_head))
    out = tmp_path / "bench.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "spexis_sglang.bench_serving",
        "--backend",
        "sglang",
        "--base-url",
        server.base_url,
        "--dataset-name",
        "random-ids",  # random token ids: no download, the tokenizer is the served model's
        "--random-input-len",
        "32",
        "--random-output-len",
        str(OUTPUT_LEN),
        "--random-range-ratio",
        "1",  # every request asks for exactly OUTPUT_LEN tokens (ignore_eos is the default)
        "--num-prompts",
        str(NUM_PROMPTS),
        "--request-rate",
        "8",
        "--seed",
        "1",
        "--disable-tqdm",
        "--output-details",
        "--output-file",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Serving Benchmark Result" in proc.stdout

    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    assert result["completed"] == NUM_PROMPTS
    assert not any(result["errors"]), result["errors"]
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["request_throughput"] > 0
    assert result["output_throughput"] > 0
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
    # the benchmark read the server's /server_info: Spexis' counters are there, and SP ran
    spexis = result["server_info"]["internal_states"][0]["spexis"]
    assert spexis["tokens_committed"] >= NUM_PROMPTS * (OUTPUT_LEN - 1)


def _serving_module():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "serving", "serving.py")
    spec = importlib.util.spec_from_file_location("benchmark_serving_e2e", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sharegpt_workload_through_bench_serving(server_factory, model_dir, trained_head, tmp_path):
    """benchmark/serving/serving.py's path for a real workload: ShareGPT prompts
    (chat-formatted) and answer lengths written as bench_serving's ShareGPT file, EOS honoured
    on real weights, one Poisson rate against the SP server (the same server as the test above)."""
    serving = _serving_module()
    server = server_factory(sp_args(2, trained_head))
    args = serving.parse_args(
        [
            "--workload",
            "sharegpt",
            "--num-prompts",
            "6",
            "--max-input-len",
            "160",
            "--max-output-len",
            "12",
            "--out",
            str(tmp_path / "unused.json"),
        ]
    )
    wl = serving.prepare_workload(args, model_dir, str(tmp_path))
    assert wl["workload"]["ignore_eos"] is False and "--disable-ignore-eos" in wl["bench_args"]
    assert wl["workload"]["requests"] == 6 and wl["server_extra"] == []
    rec = serving.run_rate(args, server, 4.0, wl["bench_args"])
    assert rec["completed"] == 6 and rec["failed"] == 0
    assert 6 <= rec["total_output_tokens"] <= wl["workload"]["output_len"]["total"]
    assert rec["mean_normalized_latency_s"] > 0 and rec["loadavg_before"] is not None
    sp = rec["spexis"]
    assert sp["tokens_committed"] >= rec["total_output_tokens"] - 6  # (+ bench's warm-up)
    assert sp["acceptance_rate"] is not None and sp["stage0_ms_per_iteration"]
