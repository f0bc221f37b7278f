"""Read the committed results in ``benchmark/results/``: one loader for every JSON there.

    from read_results import load, decode_ratios      # with benchmark/ on sys.path
    load("cpu_sp_acceptance")                         # benchmark/results/cpu_sp_acceptance.json
    load("gpu/admission_kv600")
    decode_ratios("gpu/decode_llama-3.1-8b_no_graphs_analysis")

``python benchmark/read_results.py`` lists every results file with what it holds and the
command that made it (where the file records one); ``python benchmark/read_results.py NAME``
prints one file's summary. Numbers quoted in ``benchmark/README.md`` come from these files
(``tests/benchmark/test_results_files.py`` checks the headline ones).
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Dict, List, Optional

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# fields that say what a file measured, in the order they are tried
_WHAT_KEYS = ("what", "description", "label", "question", "note", "model", "base_model", "name")
_COMMAND_KEYS = ("command", "commands", "argv", "gpu_command")


def names() -> List[str]:
    """Every results JSON, as ``load`` takes it (``gpu/...`` for the GPU ones), sorted."""
    out = []
    for folder, _, files in os.walk(RESULTS_DIR):
        for f in files:
            if f.endswith(".json"):
                rel = os.path.relpath(os.path.join(folder, f), RESULTS_DIR)
                out.append(rel[: -len(".json")].replace(os.sep, "/"))
    return sorted(out)


def path(name: str) -> str:
    """The file of ``name`` (with or without ``.json``); a clear error for an unknown name."""
    rel = name[: -len(".json")] if name.endswith(".json") else name
    full = os.path.join(RESULTS_DIR, *rel.split("/")) + ".json"
    if not os.path.isfile(full):
        close = [n for n in names() if rel.split("/")[-1][:8] in n]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise FileNotFoundError(f"no results file {rel}.json in {RESULTS_DIR}{hint}")
    return full


def load(name: str) -> Any:
    with open(path(name)) as f:
        return json.load(f)


def describe(doc: Any) -> Dict[str, Optional[str]]:
    """What a results document says about itself: what it measured and its command."""
    what = command = None
    if isinstance(doc, dict):
        for key in _WHAT_KEYS:
            if isinstance(doc.get(key), str):
                what = doc[key]
                break
        for key in _COMMAND_KEYS:
            value = doc.get(key)
            if isinstance(value, list) and value:
                value = (
                    value[0]
                    if isinstance(value[0], str) and " " in value[0]
                    else " ".join(str(v) for v in value)
                )
            if isinstance(value, str):
                command = value
                break
    return {"what": what, "command": command}


def geomean(values: List[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def decode_ratios(name: str, min_batch: int = 0) -> Dict[float, Dict[str, float]]:
    """From a decode analysis (``benchmark/gpu/analyze.py``): per forced theta, the geometric
    means over batch sizes of SP / stock PP (the faster PP setting at each batch) and SP / TP,
    and of measured / Eq. 2 (with SP's own iteration time)."""
    doc = load(name)
    out: Dict[float, Dict[str, float]] = {}
    for model in doc["models"].values():
        for sp in model["sp"].values():
            rows = [r for r in sp["rows"] if r["batch"] >= min_batch]
            pick = lambda key: [r[key] for r in rows if r.get(key)]  # noqa: E731
            out[sp["theta_forced"]] = {
                "sp_over_pp": geomean(pick("sp_over_pp")),
                "sp_over_tp": geomean(pick("sp_over_tp")),
                "measured_over_eq2": geomean(pick("measured_over_pred_from_sp_latency")),
                "batches": [r["batch"] for r in rows],
            }
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for name in argv or names():
        info = describe(load(name))
        print(name)
        for key in ("what", "command"):
            if info[key]:
                text = info[key]
                print(f"    {key}: {text[:200]}{'...' if len(text) > 200 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
