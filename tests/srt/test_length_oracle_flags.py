"""``--spexis-benchmark-length-oracle``: refused unless dummy weights and a draft head, never
with a length predictor; its targets reach the scheduler processes and the help text."""

from __future__ import annotations

import pytest

from spexis_sglang.core.length_oracle import PRESETS
from spexis_sglang.default_model import ensure_default_model
from spexis_sglang.srt import launch as launch_server
from spexis_sglang.srt.sp_length_oracle import shipped_predictor_quality

SP = ["--pp-size", "2", "--spexis-draft-head", "random:0"]
DUMMY = ["--load-format", "dummy"]
ORACLE = "--spexis-benchmark-length-oracle"


@pytest.mark.parametrize(
    "argv, message",
    [
        (SP + [ORACLE, "paper-l70"], "refused unless the weights are random anyway"),
        (
            ["--pp-size", "2", *DUMMY, ORACLE, "paper-l70"],
            "--spexis-benchmark-length-oracle needs --spexis-draft-head",
        ),
        (
            SP + DUMMY + [ORACLE, "perfect", "--spexis-length-predictor", "bundled"],
            "give --spexis-length-predictor or the oracle, not both",
        ),
        (SP + DUMMY + [ORACLE, "paper"], "expected a preset (ours, perfect, paper-l70"),
        (SP + DUMMY + [ORACLE, "0.9/0.5,0.8/0.5"], "5 comma-separated P/R pairs"),
        (SP + DUMMY + [ORACLE, "0.9/1.2"], "recall must be in [0, 1], got 1.2"),
        (
            SP + DUMMY + ["--spexis-lookahead-admission"],
            "--spexis-lookahead-admission needs --spexis-length-predictor (or, benchmark only, "
            "--spexis-benchmark-length-oracle)",
        ),
    ],
)
def test_bad_length_oracle_flags_are_refused(argv, message, capsys):
    assert launch_server.main(["--model-path", ensure_default_model(), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.parametrize(
    "spec, want",
    [
        ("paper-l70", PRESETS["paper-l70"].as_dict()),
        ("paper-q32", PRESETS["paper-q32"].as_dict()),
        ("ours", None),
        ("0.8/0.4", None),
    ],
)
def test_oracle_with_lookahead_admission_reaches_the_schedulers(spec, want, monkeypatch):
    from spexis_sglang.srt.config import ENV_CONFIG, ENV_DRAFT_HEAD, get_config
    from spexis_sglang.srt.launch import prepare_server_args

    for name in (ENV_CONFIG, ENV_DRAFT_HEAD):  # restored after the test
        monkeypatch.setenv(name, "")
    argv = ["--model-path", ensure_default_model(), *SP, *DUMMY, ORACLE, spec]
    _, cfg = prepare_server_args(argv + ["--spexis-lookahead-admission"])
    assert cfg.lookahead_admission and cfg.length_predictor is None
    if spec == "ours":
        want = shipped_predictor_quality().as_dict()
    elif want is None:
        assert cfg.length_oracle["precision"] == [0.8] * 5
        assert cfg.length_oracle["recall"] == [0.4] * 5
        want = cfg.length_oracle
    assert cfg.length_oracle == want
    cfg.to_env()
    assert get_config() == cfg


def test_help_names_the_length_oracle(capsys):
    assert launch_server.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--spexis-benchmark-length-oracle PRESET|P/R|P/R,..." in out
    assert "BENCHMARK ONLY" in out and "'paper-l70' / 'paper-q32'" in out
