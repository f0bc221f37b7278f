"""The measured inputs of the simulator: host costs, links, GPU sharing, calibration.

Everything here is read from ``data/calibration.json``, which
``benchmark/sim/calibrate.py`` writes from the repository's committed measurements (every
entry carries its provenance). Nothing is measured at planning time.

* ``host``: host time per loop phase (``core.stage_costs.HostCosts``). ``graphs_overlap`` is
  the SP loop Spexis runs (stage 0's host work behind the GPU), from its phase timers on the
  emulated two-GPU box; ``graphs_serial`` the earlier loop with CUDA graphs (host phases on
  the critical path), from stage 0's phase timers on the H200 machine.
* ``links``: transfers between stages. NVLink links come from AIConfigurator's node model
  per system (``aic.AICBridge.link``); ``loopback_box`` is NCCL over loopback sockets on
  the emulated two-GPU box.
* ``sharing``: ``mps_box``, one H200 split by MPS into two 50 % clients.
* ``systems``: per-system correction of AIConfigurator's stage times against our own
  measurements (``StageCosts.correction``) and the error bar a prediction carries.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from spexis_sglang.core.pipeline_sim import LoopSpec, Machine
from spexis_sglang.core.stage_costs import CostGrid, DeviceSharing, HostCosts, LinkSpec

__all__ = [
    "CALIBRATION_PATH",
    "Calibration",
    "SystemCalibration",
    "load_calibration",
    "LOOPS",
]

CALIBRATION_PATH = Path(__file__).with_name("data") / "calibration.json"

#: Loop choreographies by name: the overlapped loop Spexis runs (hidden states leave right
#: after the launch; host costs from ``graphs_overlap``) and the earlier serial one.
LOOPS = {
    "serial": LoopSpec(graphs=True, send_after_launch=False),
    "overlap": LoopSpec(graphs=True, send_after_launch=True),
}
_HOST_FOR_LOOP = {"serial": "graphs_serial", "overlap": "graphs_overlap"}


@dataclass(frozen=True)
class SystemCalibration:
    """How far AIConfigurator's stage times are from ours on one system, and the error bar."""

    correction: Optional[CostGrid]
    error_bar: float
    source: str
    borrowed_from: Optional[str] = None


@dataclass(frozen=True)
class Calibration:
    host: Mapping[str, HostCosts]
    links: Mapping[str, LinkSpec]
    sharing: Mapping[str, DeviceSharing]
    systems: Mapping[str, SystemCalibration]
    default_error_bar: float
    raw: Mapping[str, Any]

    def system(self, name: str) -> SystemCalibration:
        """The system's own calibration, or one borrowed from a system of the same family."""
        if name in self.systems:
            return self.systems[name]
        fam = self.raw.get("borrow", {}).get(name)
        if fam and fam in self.systems:
            base = self.systems[fam]
            extra = float(self.raw.get("borrow_error_bar_extra", 0.05))
            return SystemCalibration(
                base.correction, base.error_bar + extra, base.source, borrowed_from=fam
            )
        return SystemCalibration(None, self.default_error_bar, "uncalibrated")

    def host_for(self, loop: str) -> HostCosts:
        return self.host[_HOST_FOR_LOOP[loop]]

    def machine(
        self,
        costs,
        system: str,
        link: LinkSpec,
        loop: str = "serial",
        sharing: Optional[str] = None,
    ) -> Machine:
        """Stage costs (corrected for ``system``) with the loop's host costs and a link."""
        cal = self.system(system)
        if cal.correction is not None and costs.correction is None:
            costs = costs.with_correction(cal.correction)
        return Machine(
            costs=costs,
            host=self.host_for(loop),
            link=link,
            sharing=self.sharing[sharing] if sharing else None,
            name=f"{system} ({loop} loop)",
        )


def _link(d: Mapping[str, Any]) -> LinkSpec:
    return LinkSpec(
        latency_s=float(d["latency_s"]),
        bandwidth_Bps=float(d["bandwidth_Bps"]),
        meta_latency_s=float(d.get("meta_latency_s", 30e-6)),
        name=d.get("name", ""),
    )


def parse_calibration(data: Mapping[str, Any]) -> Calibration:
    systems = {}
    for name, d in data.get("systems", {}).items():
        corr = d.get("correction")
        systems[name] = SystemCalibration(
            CostGrid.from_json(corr) if corr else None,
            float(d.get("error_bar", data.get("default_error_bar", 0.2))),
            d.get("source", ""),
        )
    return Calibration(
        host={k: HostCosts.from_json(v) for k, v in data.get("host", {}).items()},
        links={k: _link(v) for k, v in data.get("links", {}).items()},
        sharing={
            k: DeviceSharing(tuple(v["compute"]), tuple(v["memory"]), v.get("name", ""))
            for k, v in data.get("sharing", {}).items()
        },
        systems=systems,
        default_error_bar=float(data.get("default_error_bar", 0.2)),
        raw=copy.deepcopy(dict(data)),
    )


@functools.lru_cache(maxsize=4)
def _load(path: str) -> Calibration:
    with open(path, encoding="utf-8") as f:
        return parse_calibration(json.load(f))


def load_calibration(path: Optional[str | os.PathLike] = None) -> Calibration:
    """The committed calibration (``data/calibration.json``) or another file of that format."""
    p = Path(path) if path is not None else CALIBRATION_PATH
    if not p.is_file():
        raise FileNotFoundError(
            f"{p}: no calibration file (python benchmark/sim/calibrate.py writes it)"
        )
    return _load(str(p.resolve()))
