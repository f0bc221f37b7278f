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
