"""The AIConfigurator bridge and the simulator-backed planner CLI, on a small config.

Needs the optional extra (``pip install 'spexis-sglang[planner]'``; the CPU set-up installs
it): skipped, with the reason, where ``aiconfigurator_core`` is missing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("aiconfigurator_core", reason="spexis-sglang[planner] not installed")

from spexis_sglang.core.pipeline_sim import Deployment, simulate_decode_benchmark  # noqa: E402
from spexis_sglang.core.stage_costs import StagePlan  # noqa: E402
from spexis_sglang.plan import main  # noqa: E402
from spexis_sglang.planning.aic import AICBridge, ModelShape, load_model_shape  # noqa: E402
from spexis_sglang.planning.machines import machine_for  # noqa: E402
from spexis_sglang.planning.presets import load_calibration  # noqa: E402
from spexis_sglang.planning.search import deployments, max_batch  # noqa: E402

SMALL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
ROWS, CTX = (1, 8, 64), (128, 1024)
LLAMA = str(Path(__file__).resolve().parents[2] / "benchmark/gpu/configs/llama-3.1-8b")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    (d / "config.json").write_text(json.dumps(SMALL))
    return d


@pytest.fixture(scope="module")
def bridge():
    return AICBridge("h200_sxm")


@pytest.fixture(scope="module")
def tables(small, bridge):
    m = load_model_shape(str(small))
    return {
        tp: bridge.stage_costs(
            m, tp, rows=ROWS, ctx=CTX, prefill_tokens=(256, 2048), prefill_ctx=(256,)
        )
        for tp in (1, 2)
    }


def test_model_shape_from_config(small):
    m = load_model_shape(str(small))
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (
        4,
        1024,
        16,
        8,
        64,
    )
    assert m.kv_bytes_per_token() == 2 * 4 * 8 * 64 * 2


def test_components_match_aiconfigurators_own_decode_step(small, tables):
    """Our per-layer operators x layers + embedding + LM head = its whole-model step."""
    from aiconfigurator_core.sdk.engine import EngineHandle

    h = EngineHandle.compile(str(small), "h200_sxm", "sglang", backend_version="current")
    plan = StagePlan.for_pipeline(4, 1, sp=False)[0]
    for b in (8, 64):
        theirs = sum(op[1] for op in h.decode_step_per_op(b, 128, 2)) * 1e-3
        ours = tables[1].breakdown(plan, b, 129)
        ours.pop("sampling")  # ours only: AIConfigurator has no sampling operator
        assert sum(ours.values()) == pytest.approx(theirs, rel=0.05)


def test_tables_grow_with_batch_and_context_and_tp_adds_allreduce(tables):
    t1, t2 = tables[1], tables[2]
    assert set(t1.decode) >= {"gemm", "attention", "elementwise", "lm_head", "draft_head"}
    assert "allreduce" not in t1.decode and t2.decode["allreduce"](8, 128) > 0
    for c, g in t1.decode.items():
        assert g(64, 128) >= g(1, 128) > 0, c
    att = t1.decode["attention"]
    assert att(64, 1024) > att(64, 128)
    assert t2.decode["gemm"](64, 128) < t1.decode["gemm"](64, 128)  # half the weights per GPU
    # SP's stage 0 pays for the draft head; the last stage for the LM head
    p0, p1 = StagePlan.for_pipeline(4, 2, sp=True)
    assert "draft_head" in t1.breakdown(p0, 8, 128) and "lm_head" not in t1.breakdown(p0, 8, 128)
    assert "lm_head" in t1.breakdown(p1, 8, 128)
    assert t1.stage_time(p0, 8, 128, "prefill") > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_a_draft_vocabulary_prices_a_shorter_draft_head_only(small, bridge, tables, tp):
    """``--spexis-draft-vocab``: the draft head scores fewer ids (under TP the rank with the
    most of them, and the ranks exchange their best only); nothing else changes."""
    m = dataclasses.replace(load_model_shape(str(small)), draft_vocab=4000)
    cut = bridge.stage_costs(m, tp, rows=ROWS, ctx=CTX, prefill_tokens=(256,), prefill_ctx=(256,))
    whole = tables[tp]
    for rows in (8, 64):
        assert cut.decode["draft_head"](rows, 128) < 0.9 * whole.decode["draft_head"](rows, 128)
        for c in ("gemm", "attention", "lm_head", "sampling"):
            assert cut.decode[c](rows, 128) == whole.decode[c](rows, 128), c


def test_plan_cli_prices_a_draft_vocabulary_and_refuses_a_bad_one(small, capsys):
    args = ["--model", str(small), "--system", "h200_sxm", "--gpus", "2", "--alphas"]
    assert main([*args, "--draft-vocab", "8000"]) == 0
    assert "drafting among 8000 ids" in capsys.readouterr().out
    assert main([*args, "--draft-vocab", "32001"]) == 2
    assert "--draft-vocab must be between 1 and the model's vocabulary (32000 ids), got 32001" in (
        capsys.readouterr().err
    )


def test_link_and_memory_from_the_node_model(bridge):
    lk = bridge.link()
    assert lk.bandwidth_Bps == 450e9 and lk.latency_s == 1e-5
    assert bridge.gpu_memory_bytes > 140e9 and bridge.gpus_per_node == 8


def test_unpriceable_or_unsupported_models_fail_clearly(tmp_path, bridge):
    tiny = dict(SMALL, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    with pytest.raises(ValueError, match="cannot price the decode attention"):
        bridge.stage_costs(load_model_shape(str(tmp_path)), 1, rows=(1,), ctx=(128,))
    with pytest.raises(ValueError, match="dense decoders only"):
        ModelShape.from_hf_config(dict(SMALL, architectures=["Qwen3MoeForCausalLM"]), "moe")
    with pytest.raises(FileNotFoundError, match="neither a config.json"):
        load_model_shape("no/such-model")


def test_deployments_and_batch_fit(small):
    m = load_model_shape(str(small))
    labels = [d.label for d in deployments(4, m, (0.2,))]
    assert labels == ["TP4", "PP2xTP2", "SP2xTP2", "SP2xTP2 a=0.20", "PP4", "SP4", "SP4 a=0.20"]
    # a 141 GB H200 holds 512 sequences of 640 tokens of a small model, not of 10M tokens
    assert max_batch(m, 141e9, Deployment("sp", 2), 640) == 512
    assert max_batch(m, 141e9, Deployment("sp", 2), 10**7) < 16


@pytest.mark.parametrize("batch,measured", [(16, 3130), (64, 10937), (256, 24105)])
def test_committed_calibration_predicts_stock_pp1_on_the_h200(batch, measured):
    """The committed calibration (AIConfigurator's stage times corrected by per-stage timings
    on one H200) predicts stock SGLang PP=1 measured on that GPU, graphs on, within the
    simulator's 10 % target; these points are not what the correction was fitted on."""
    cal = load_calibration()
    m = machine_for(LLAMA, "h200_sxm", tp=1, calibration=cal)
    thr, _, _ = simulate_decode_benchmark(Deployment("tp", 1, 1), m, batch)
    assert thr == pytest.approx(measured, rel=0.10)


def test_plan_cli_ranks_with_the_simulator(small, tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            "--model",
            str(small),
            "--system",
            "h200_sxm",
            "--gpus",
            "2",
            "--alphas",
            "0.2",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["label"] for r in rows} == {"TP2", "PP2", "SP2", "SP2 a=0.20"}
    thr = [r["throughput"] for r in rows]
    assert thr == sorted(thr, reverse=True)
    assert "best:" in text and "closed form" in text


def test_plan_cli_bad_input_exits_2_with_a_message(capsys):
    assert main(["--model", "no/such-model", "--gpus", "2"]) == 2
    assert "neither a config.json" in capsys.readouterr().err
    assert main(["--model", LLAMA, "--theta-by-pp", "x"]) == 2
    assert "--theta-by-pp" in capsys.readouterr().err
