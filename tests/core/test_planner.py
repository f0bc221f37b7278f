"""Planner: profile validation, Table 1 ranking, §7.1's TP-vs-SP result, the CLI."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spexis_sglang.core.cost_model import b_alpha_star, b_eff_alpha_star, b_eff_star
from spexis_sglang.core.planner import (
    ProfileError,
    format_table,
    load_profile,
    parse_profile,
    rank_configurations,
)
from spexis_sglang.plan import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "benchmark" / "profiles" / "example_8gpu.json"


def _lin(w: float, c: float, batches=(1, 16, 64, 256, 512)) -> list[list[float]]:
    return [[b, w + c * b] for b in batches]


def _two_config_profile(tp_overhead: float, theta: float) -> dict:
    """TP8 vs PP8 SP on one ideal machine: per-GPU compute is identical; TP pays a
    multiplicative communication overhead, SP pays the speculation loss of Eq. 2."""
    w, c = 0.020, 0.00005  # one stage / one TP pass without communication
    return {
        "num_gpus": 8,
        "theta": {"8": theta},
        "configs": [
            {
                "pp": 1,
                "tp": 8,
                "max_batch": 256,
                "latency": _lin(w * (1 + tp_overhead), c * (1 + tp_overhead)),
            },
            {"pp": 8, "tp": 1, "max_batch": 256, "latency": _lin(w, c)},
        ],
    }


def test_example_profile_loads_and_ranks() -> None:
    prof = load_profile(EXAMPLE)
    rows = rank_configurations(prof)
    assert prof.num_gpus == 8 and len(prof.configs) == 4
    assert [r.throughput for r in rows] == sorted((r.throughput for r in rows), reverse=True)
    modes = {(r.pp, r.mode) for r in rows}
    assert (1, "TP") in modes and (2, "SP") in modes and (2, "PP") in modes
    # every row is Table 1 applied to the profile
    for r in rows:
        cfg = next(c for c in prof.configs if c.pp == r.pp)
        b = cfg.max_batch
        if r.mode == "TP":
            assert r.throughput == pytest.approx(b / cfg.latency(b))
        elif r.mode == "PP":
            assert r.throughput == pytest.approx((b / r.pp) / cfg.latency(b / r.pp))
        elif r.mode == "SP":
            th = prof.theta[r.pp]
            assert r.throughput == pytest.approx(b_eff_star(b, r.pp, th) / cfg.latency_sp(b))
        else:
            rows_a = b_alpha_star(b, r.pp, r.alpha)
            eff = b_eff_alpha_star(b, r.pp, r.theta, r.alpha)
            assert r.throughput == pytest.approx(eff / cfg.latency_sp(rows_a))
    table = format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "PP2xTP4 SP" in table


@pytest.mark.parametrize("theta", [0.5, 0.634, 0.785])
def test_section_7_1_tp_vs_sp(theta: float) -> None:
    """SP wins exactly when TP's communication overhead exceeds SP's speculation loss.

    With identical per-GPU compute, throughput_TP / throughput_SP =
    (N - theta (N-1)) / (1 + overhead), so the crossover is at overhead = N - theta(N-1) - 1.
    """
    loss = 8 - theta * 7 - 1.0  # SP's relative slowdown from wasted rows (Eq. 2)
    for overhead, winner in [(loss * 0.9, "TP"), (loss * 1.1, "SP")]:
        rows = rank_configurations(parse_profile(_two_config_profile(overhead, theta)))
        assert rows[0].mode == winner, (overhead, loss, rows[0])
        by_mode = {r.mode: r.throughput for r in rows}
        assert by_mode["TP"] / by_mode["SP"] == pytest.approx((1 + loss) / (1 + overhead))


def test_selective_speculation_is_ranked_when_a_rank_profile_exists() -> None:
    p = _two_config_profile(3.0, 0.5)
    p["acceptance_by_rank"] = {"8": [0.9] * 7 + [0.05] * 3}  # mean 0.645
    p["theta"]["8"] = 0.645
    rows = rank_configurations(parse_profile(p))
    sp_a = [r for r in rows if r.mode == "SP_alpha"]
    assert len(sp_a) == 1 and 0.2 <= sp_a[0].alpha <= 0.3
    assert sp_a[0].theta > 0.645
    exact = rank_configurations(parse_profile(p), alpha_model="exact")
    assert [r for r in exact if r.mode == "SP_alpha"][0].throughput > sp_a[0].throughput


def _example_dict() -> dict:
    return json.loads(EXAMPLE.read_text())


def _mut(fn):
    d = _example_dict()
    fn(d)
    return d


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda d: d.pop("num_gpus"), "profile.num_gpus: missing required key"),
        (lambda d: d.update(num_gpus="8"), "profile.num_gpus: expected an integer"),
        (lambda d: d.pop("configs"), "profile.configs: missing required key"),
        (lambda d: d.update(configs=[]), "profile.configs: expected a non-empty list"),
        (lambda d: d.update(colour=1), "profile.colour: unknown key"),
        (lambda d: d["configs"][1].update(latncy=[]), "configs[1].latncy: unknown key"),
        (lambda d: d["configs"][0].pop("latency"), "configs[0].latency: missing required key"),
        (
            lambda d: d["configs"][0].update(latency=[]),
            "configs[0].latency: the latency table is empty",
        ),
        (lambda d: d["configs"][0].update(latency="fast"), "configs[0].latency: expected a list"),
        (
            lambda d: d["configs"][2].update(latency=[[1, 0.02], [64, 0.01]]),
            "configs[2].latency[1]: latency 0.01 s at batch 64 is below",
        ),
        (
            lambda d: d["configs"][2].update(latency=[[64, 0.02], [8, 0.03]]),
            "configs[2].latency[1]: batch 8 is not greater",
        ),
        (lambda d: d["configs"][1].update(latency_sp=[[1, "x"]]), "configs[1].latency_sp[0]"),
        (lambda d: d["configs"][0].update(latency_sp=[[1, 0.1]]), "configs[0].latency_sp: only"),
        (lambda d: d["configs"][0].update(pp=2), "configs[0]: pp * tp = 2 * 8 = 16"),
        (lambda d: d["configs"][0].update(tp=1.5), "configs[0].tp: expected an integer"),
        (lambda d: d["configs"][3].update(pp=2, tp=4), "configs[3]: duplicate of configs[1]"),
        (lambda d: d["configs"][0].update(max_batch=10), "configs[0]: give exactly one of"),
        (
            lambda d: d.pop("tokens_per_seq"),
            "configs[0].kv_capacity_tokens: needs profile.tokens_per_seq",
        ),
        (
            lambda d: d["configs"][0].update(kv_capacity_tokens=-5),
            "configs[0].kv_capacity_tokens: expected a number > 0",
        ),
        (lambda d: d["theta"].update({"2": 1.2}), "profile.theta['2']: 1.2 is outside [0, 1]"),
        (lambda d: d["theta"].update({"2": "high"}), "profile.theta['2']: expected a number"),
        (lambda d: d["theta"].pop("4"), "profile.theta: missing entry for pp=4"),
        (
            lambda d: d["theta"].update({"one": 0.5}),
            "profile.theta['one']: key 'one' is not a pipeline depth",
        ),
        (
            lambda d: d["theta"].update({"2": 0.5}),
            "profile.acceptance_by_rank['2']: mean acceptance",
        ),
        (
            lambda d: d["acceptance_by_rank"].update({"2": [0.5, -0.1]}),
            "profile.acceptance_by_rank['2'][1]",
        ),
        (
            lambda d: d["acceptance_by_rank"].update({"2": []}),
            "profile.acceptance_by_rank['2']: expected a non-empty list",
        ),
        (lambda d: d.update(alpha_grid=[0.1, 1.0]), "profile.alpha_grid[1]"),
        (lambda d: d.update(tokens_per_seq=0), "profile.tokens_per_seq"),
    ],
)
def test_profile_validation_names_the_field(mutate, needle: str) -> None:
    with pytest.raises(ProfileError) as e:
        parse_profile(_mut(mutate))
    assert needle in str(e.value)


def test_profile_top_level_type_and_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="expected a JSON object"):
        parse_profile([1, 2])
    with pytest.raises(ProfileError, match="no such file"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)


def test_kv_capacity_tokens_become_sequences() -> None:
    prof = parse_profile(_example_dict())
    d = _example_dict()
    assert prof.configs[0].max_batch == int(
        d["configs"][0]["kv_capacity_tokens"] // d["tokens_per_seq"]
    )


def test_cli_prints_ranked_table(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rank.json"
    assert main(["--profile", str(EXAMPLE), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rank" in text and "best:" in text and "PP1xTP8" in text
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["throughput"] >= rows[-1]["throughput"]
    assert main(["--profile", str(EXAMPLE), "--top", "2", "--alpha-model", "exact"]) == 0
    assert "alpha model: exact" in capsys.readouterr().out


def test_cli_reports_profile_errors(tmp_path: Path, capsys) -> None:
    p = tmp_path / "p.json"
    d = _example_dict()
    d["theta"]["2"] = 7
    p.write_text(json.dumps(d))
    assert main(["--profile", str(p)]) == 2
    assert "error: profile.theta['2']: 7 is outside [0, 1]" in capsys.readouterr().err


def test_cli_as_module() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-I", "-m", "spexis_sglang.plan", "--profile", str(EXAMPLE), "--top", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("\n") >= 6


def test_profile_copy_is_not_mutated() -> None:
    d = _example_dict()
    before = copy.deepcopy(d)
    parse_profile(d)
    assert d == before
