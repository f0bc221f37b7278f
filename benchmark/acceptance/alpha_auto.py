"""Selective speculation with a fixed alpha vs ``--spexis-alpha auto``, side by side on CPU.

One workload for every configuration, run on a fresh server per configuration: a batch of
``--prompts`` math prompts (GSM8K, from the SpecBench-like mix in ``spexis_sglang.data``),
then a batch of as many translation prompts, greedy, ``ignore_eos``, ``--new-tokens`` each
(a shift the chooser must follow: math drafts are accepted far more often than translation
drafts).
Default model, PP=2, bundled draft head.

Configurations (run in the order alpha0, auto, offline):

* ``alpha0``: ``--spexis-alpha 0 --spexis-alpha-observe 1``. Its stage 0 observes every
  iteration (no drops, every rank verified):
  the acceptance-by-confidence-rank profile of each phase and the iteration time against rows
  (``/server_info`` ``spexis_alpha``). From them, ``choose_alpha`` gives the *offline* choice
  for each phase and for the whole workload (the profile of both phases, equally weighted).
* ``offline``: ``--spexis-alpha <the whole-workload offline choice>`` (what a deployment
  with a profiled fixed alpha runs). Skipped when that choice is 0 (the same as ``alpha0``).
* ``auto``: ``--spexis-alpha auto --spexis-alpha-interval K`` (K small enough for the short
  CPU phases: the counts' half-life is 4 K iterations).

Each phase's prompts are first prefilled untimed (``max_new_tokens=1``), so the timed run
finds them in the radix cache and measures decoding. Per configuration and phase: wall time,
output tokens/s, acceptance, rows and tokens per decode iteration, drafts dropped; for
``auto`` the alpha trajectory (its choices, and ``/server_info`` polled every ``--poll``
seconds). The box is shared and its load moves wall times by 2x between runs, so the summary
also gives a load-independent figure: each run's tokens and rows per decode iteration (the
mechanics) priced with one latency fit, the alpha-0 run's ``T(rows) = a + b rows`` of decode
periods (``model_tok_s``). CPU-level numbers: a 2-core box, torch-native attention; they show
the mechanism, not GPU performance.

    .venv/bin/python benchmark/acceptance/alpha_auto.py --prompts 16 --new-tokens 64 \\
        --out benchmark/results/cpu_alpha_auto.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from spexis_sglang.cpu_support import activate

activate()

import numpy as np  # noqa: E402
import requests  # noqa: E402

from spexis_sglang.core.online_alpha import LatencyFit, OnlineAlpha  # noqa: E402
from spexis_sglang.core.selection import choose_alpha  # noqa: E402
from spexis_sglang.default_model import ensure_default_model  # noqa: E402
from spexis_sglang.srt.stats import stat_deltas  # noqa: E402
from spexis_sglang.testing import ServerProcess  # noqa: E402

PHASES = ("math", "translation")


def phase_prompts(model: str, per_phase: int, max_prompt_tokens: int) -> dict:
    from transformers import AutoTokenizer

    from spexis_sglang.data.mix import evaluation_mix

    tok = AutoTokenizer.from_pretrained(model)
    mix = evaluation_mix(n_per_category=3 * per_phase)
    out = {}
    for cat in PHASES:
        ids = []
        for p in mix:
            if p.category != cat or p.followups:
                continue
            x = list(
                tok.apply_chat_template(
                    p.chat(), add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            if len(x) <= max_prompt_tokens:
                ids.append(x)
            if len(ids) == per_phase:
                break
        if len(ids) < per_phase:
            raise SystemExit(f"only {len(ids)} {cat} prompts of <= {max_prompt_tokens} tokens")
        out[cat] = ids
    return out


def server_state(server) -> dict:
    info = server.server_info(timeout=120)
    st = info["internal_states"][0]
    return {"spexis": st["spexis"], "alpha": st.get("spexis_alpha")}


class Poller:
    """``/server_info``'s alpha every ``period`` seconds, in a thread."""

    def __init__(self, server, period: float):
        self.server, self.period = server, period
        self.samples: list = []
        self.phase = ""
        self._stop = threading.Event()
        self._t0 = time.time()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                s = server_state(self.server)
            except requests.RequestException:
                continue
            self.samples.append(
                [
                    round(time.time() - self._t0, 1),
                    self.phase,
                    s["spexis"]["alpha"],
                    s["spexis"]["decode_iterations"],
                ]
            )

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.samples


def run_config(name: str, server_args: list, prompts: dict, new_tokens: int, poll: float):
    print(f"[{name}] starting: {' '.join(server_args)}", flush=True)
    server = ServerProcess(server_args).wait_ready()
    poller = Poller(server, poll) if poll > 0 else None
    phases = {}
    try:
        for phase in PHASES:
            if poller is not None:
                poller.phase = phase
            # prefill first, untimed (max_new_tokens=1): the timed run then finds the prompts
            # in the radix cache and measures decoding, not this box's prefill under load
            server.greedy_ids(prompts[phase], 1)
            before = server_state(server)
            t0 = time.time()
            out = server.greedy_ids(prompts[phase], new_tokens, ignore_eos=True)
            wall = time.time() - t0
            after = server_state(server)
            d = stat_deltas(before["spexis"], after["spexis"])
            tokens = sum(len(o) for o in out)
            rows = d["rows_normal"] + d["rows_spec"]
            rec = {
                "wall_s": round(wall, 2),
                "output_tokens": tokens,
                "output_tok_s": round(tokens / wall, 3),
                "acceptance": round(d["accepted"] / max(1, d["accepted"] + d["rejected"]), 4),
                "rows_per_iteration": round(rows / max(1, d["decode_iterations"]), 3),
                "tokens_per_iteration": round(
                    d["tokens_committed"] / max(1, d["decode_iterations"]), 3
                ),
                "tokens_per_row": round(d["tokens_committed"] / max(1, rows), 4),
                "counters": d,
                "alpha_at_end": after["spexis"]["alpha"],
                "alpha_state_at_end": after["alpha"],
            }
            phases[phase] = rec
            print(
                f"[{name}] {phase}: {rec['output_tok_s']} tok/s, acceptance "
                f"{rec['acceptance']}, rows/iter {rec['rows_per_iteration']}, alpha at end "
                f"{rec['alpha_at_end']}",
                flush=True,
            )
    finally:
        samples = poller.stop() if poller is not None else []
        server.stop()
    total_tokens = sum(p["output_tokens"] for p in phases.values())
    total_wall = sum(p["wall_s"] for p in phases.values())
    return {
        "name": name,
        "server_args": server_args,
        "phases": phases,
        "output_tok_s": round(total_tokens / total_wall, 3),
        "wall_s": round(total_wall, 2),
        "alpha_polled": samples,
    }


def offline_choice(alpha0: dict, num_stages: int, batch: int, auto: dict | None) -> dict:
    """``choose_alpha`` on what the alpha-0 run observed: per phase and for the workload.

    The observer's counts are decayed per iteration; the translation phase's own counts are
    its end counts less the math phase's, aged by the translation phase's iterations. The
    latency fit is the alpha-0 run's, or, where its rows never varied enough to show a slope,
    the auto run's (recorded as ``latency_from``)."""
    a = alpha0["phases"]["math"]["alpha_state_at_end"]
    b = alpha0["phases"]["translation"]["alpha_state_at_end"]
    aged = a["decay"] ** (b["iteration"] - a["iteration"])
    counts = {
        "math": (np.array(a["verified_by_bin"]), np.array(a["accepted_by_bin"])),
        "translation": (
            np.array(b["verified_by_bin"]) - aged * np.array(a["verified_by_bin"]),
            np.array(b["accepted_by_bin"]) - aged * np.array(a["accepted_by_bin"]),
        ),
    }
    lat, source = b["latency"], "alpha0"
    if not lat["identified"] and auto is not None:
        lat, source = auto["phases"]["translation"]["alpha_state_at_end"]["latency"], "auto"
    fit = LatencyFit(lat["intercept_s"], lat["slope_s"], lat["identified"], lat.get("wait_s", 0.0))
    out = {"latency": lat, "latency_from": source, "batch": batch, "profiles": {}, "alpha": {}}

    def profile(verified, accepted):
        # the same smoothing as the online chooser (prior at the pooled mean, monotone)
        oa = OnlineAlpha(num_stages)
        oa._verified, oa._accepted = np.maximum(verified, 0), np.maximum(accepted, 0)
        return oa.profile()

    both_v = sum(c[0] / max(c[0].sum(), 1e-9) for c in counts.values())
    both_a = sum(c[1] / max(c[0].sum(), 1e-9) for c in counts.values())
    for key, (v, acc) in list(counts.items()) + [("workload", (both_v * 1000, both_a * 1000))]:
        prof = profile(v, acc)
        best, _ = choose_alpha(num_stages, batch, prof, fit, model="exact", interior_cost=fit.wait)
        out["profiles"][key] = [round(x, 4) for x in prof.acceptance]
        out["alpha"][key] = best.alpha
    return out


def summarize(results: dict) -> None:
    """Per run: measured tok/s, and tok/s of its mechanics priced by one latency fit."""
    if not results["runs"]:
        return
    ref = results["runs"][0]
    lat = ref["phases"][PHASES[-1]]["alpha_state_at_end"]["latency"]
    fit = LatencyFit(lat["intercept_s"], lat["slope_s"], lat["identified"])
    results["common_latency_fit"] = {"from": ref["name"], **lat}
    rows = []
    for r in results["runs"]:
        row = {"config": r["name"], "output_tok_s": r["output_tok_s"]}
        row["vs_first"] = round(r["output_tok_s"] / ref["output_tok_s"], 3)
        model = {}
        for ph, p in r["phases"].items():
            model[ph] = p["tokens_per_iteration"] / fit(p["rows_per_iteration"])
            row[f"{ph}_tok_s"] = p["output_tok_s"]
            row[f"{ph}_model_tok_s"] = round(model[ph], 3)
            row[f"{ph}_tokens_per_iteration"] = p["tokens_per_iteration"]
            row[f"{ph}_rows_per_iteration"] = p["rows_per_iteration"]
            row[f"{ph}_alpha_end"] = p["alpha_at_end"]
        # both phases commit the same tokens: the workload's rate is the harmonic mean
        row["model_tok_s"] = round(len(model) / sum(1 / m for m in model.values()), 3)
        rows.append(row)
    for row in rows:
        row["model_vs_first"] = round(row["model_tok_s"] / rows[0]["model_tok_s"], 3)
    results["summary"] = rows
    print(json.dumps(rows, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="prompts per phase")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--max-prompt-tokens", type=int, default=320)
    ap.add_argument("--interval", type=int, default=10, help="auto's --spexis-alpha-interval")
    ap.add_argument("--poll", type=float, default=3.0, help="seconds between alpha polls (auto)")
    ap.add_argument("--configs", default="alpha0,auto,offline")
    ap.add_argument("--out", default=None)
    ap.add_argument("--summarize", metavar="JSON", help="recompute a result file's summary")
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            results = json.load(f)
        summarize(results)
        with open(args.summarize, "w") as f:
            json.dump(results, f, indent=1)
        return 0

    model = ensure_default_model()
    prompts = phase_prompts(model, args.prompts, args.max_prompt_tokens)
    base = ["--pp-size", "2", "--spexis-draft-head", "bundled", "--spexis-log-interval", "10"]
    base += ["--max-total-tokens", "12288"]
    configs = args.configs.split(",")
    results = {
        "command": " ".join(sys.argv),
        "note": "CPU-level: shared 2-core box (other servers running), torch-native attention",
        "model": "bundled SmolLM2-135M-Instruct",
        "pp_size": 2,
        "prompts_per_phase": args.prompts,
        "new_tokens": args.new_tokens,
        "prompt_tokens": {k: [len(p) for p in v] for k, v in prompts.items()},
        "load_average_start": list(np.round(np.array(__import__("os").getloadavg()), 1)),
        "runs": [],
    }
    t_start = time.time()
    alpha0 = auto = None
    if "alpha0" in configs:
        # its observer measures every iteration: the offline choice is made from it
        alpha0_args = base + ["--spexis-alpha", "0", "--spexis-alpha-observe", "1"]
        alpha0 = run_config("alpha0", alpha0_args, prompts, args.new_tokens, 0)
        results["runs"].append(alpha0)
    if "auto" in configs:
        auto_args = ["--spexis-alpha", "auto", "--spexis-alpha-interval", str(args.interval)]
        auto = run_config("auto", base + auto_args, prompts, args.new_tokens, args.poll)
        auto["alpha_history"] = auto["phases"]["translation"]["alpha_state_at_end"]["history"]
        results["runs"].append(auto)
    if alpha0 is not None:
        results["offline"] = offline_choice(alpha0, 2, args.prompts, auto)
        print("offline choice:", json.dumps(results["offline"]["alpha"]), flush=True)
    if "offline" in configs and alpha0 is not None:
        a = results["offline"]["alpha"]["workload"]
        if a > 0:
            run = run_config(
                f"offline{a:g}", base + ["--spexis-alpha", str(a)], prompts, args.new_tokens, 0
            )
            results["runs"].append(run)
    results["wall_s"] = round(time.time() - t_start, 1)
    results["load_average_end"] = list(np.round(np.array(__import__("os").getloadavg()), 1))
    summarize(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
