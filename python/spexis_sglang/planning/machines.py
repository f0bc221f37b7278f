"""Assemble a simulator ``Machine``: AIConfigurator stage costs + calibration + host + link."""

from __future__ import annotations

import functools
import logging
from typing import Optional, Union

from spexis_sglang.core.pipeline_sim import Machine
from spexis_sglang.core.stage_costs import StageCosts

from .aic import AICBridge, ModelShape, load_model_shape
from .presets import Calibration, load_calibration

logger = logging.getLogger(__name__)

__all__ = ["stage_costs_for", "machine_for", "bridge_for"]


@functools.lru_cache(maxsize=8)
def bridge_for(system: str) -> AICBridge:
    return AICBridge(system)


@functools.lru_cache(maxsize=64)
def _costs(shape: ModelShape, system: str, tp: int) -> StageCosts:
    logger.info("tabulating %s stage costs on %s at TP=%d", shape.name, system, tp)
    return bridge_for(system).stage_costs(shape, tp)


def stage_costs_for(model: Union[str, ModelShape], system: str, tp: int) -> StageCosts:
    """Uncorrected per-component stage costs of ``model`` on ``system`` at TP ``tp`` (cached)."""
    shape = model if isinstance(model, ModelShape) else load_model_shape(model)
    return _costs(shape, system, int(tp))


def machine_for(
    model: Union[str, ModelShape],
    system: str,
    tp: int = 1,
    loop: str = "serial",
    link: str = "nvlink",
    sharing: Optional[str] = None,
    calibration: Optional[Calibration] = None,
) -> Machine:
    """A ``Machine`` for the simulator.

    ``link`` is ``nvlink`` (the system's node model) or the name of a calibrated link
    (``loopback_box``); ``sharing`` the name of a GPU-sharing preset (``mps_box``) or None.
    """
    cal = calibration or load_calibration()
    costs = stage_costs_for(model, system, tp)
    lk = bridge_for(system).link() if link == "nvlink" else cal.links[link]
    return cal.machine(costs, system, lk, loop=loop, sharing=sharing)
