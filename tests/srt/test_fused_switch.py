"""The switch of our fused Triton kernels: the environment turns it off, a failure too (once)."""

from __future__ import annotations

import pytest

from spexis_sglang.srt.fused_switch import FusedSwitch

ENV = "SPEXIS_TEST_FUSED_SWITCH"


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False)])
def test_the_environment_decides_at_start(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert FusedSwitch(ENV, "kernel", "running").on is on


def test_a_failing_kernel_turns_it_off_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    switch = FusedSwitch(ENV, "fused test kernel", "computing")
    assert switch.run(lambda a, b=0: a + b, 2, b=3) == 5 and switch.on

    def broken():
        raise RuntimeError("no kernel image")

    with caplog.at_level("WARNING"):
        assert switch.run(broken) is None
    assert not switch.on
    assert "the fused test kernel failed on this GPU (RuntimeError: no kernel image)" in caplog.text
    assert "computing with PyTorch's ops instead" in caplog.text
