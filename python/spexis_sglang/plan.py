"""Rank PP x TP x SP x alpha deployments: ``python -m spexis_sglang.plan``.

Two ways to get stage times:

* ``--model CONFIG --system SYSTEM --gpus G`` (needs ``pip install 'spexis-sglang[planner]'``):
  per-stage GPU times from AIConfigurator's measured SGLang tables for ``SYSTEM`` (corrected
  by our own H200 measurements), played through the discrete-event simulator of SGLang's
  pipeline loop (:mod:`spexis_sglang.planning.search`). Prints the ranking with error bars,
  the margin of the best over the runner-up, and where today's closed form ranks otherwise.
* ``--profile PROFILE.json``: the closed form (Table 1, Eq. 1-4) over latency tables we
  profiled ourselves (:mod:`spexis_sglang.core.planner`, ``benchmark/profiles/README.md``).

Examples::

    python -m spexis_sglang.plan --model benchmark/gpu/configs/llama-3.1-8b \
        --system h200_sxm --gpus 8
    python -m spexis_sglang.plan --model meta-llama/Meta-Llama-3.1-70B \
        --system b200_sxm --gpus 8 --loop serial
    python -m spexis_sglang.plan --profile benchmark/profiles/example_8gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from dataclasses import asdict
from typing import Sequence

from spexis_sglang.core.planner import (
    ProfileError,
    format_table,
    load_profile,
    rank_configurations,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spexis_sglang.plan",
        description="Rank PP x TP x SP x alpha deployments by predicted decode throughput: "
        "the pipeline simulator over AIConfigurator's stage times (--model/--system/--gpus), "
        "or the closed form over a profiled latency table (--profile).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="profile JSON (see benchmark/profiles/README.md)")
    src.add_argument(
        "--model",
        help="HF config.json, a directory with one, or a model name AIConfigurator ships "
        "(e.g. meta-llama/Meta-Llama-3.1-8B); dense decoders",
    )
    p.add_argument(
        "--system", default="h200_sxm", help="AIConfigurator system (default: %(default)s)"
    )
    p.add_argument("--gpus", type=int, default=8, help="GPUs of one node (default: %(default)s)")
    p.add_argument(
        "--theta",
        type=float,
        default=0.76,
        help="draft acceptance at stage 0's exit (default: %(default)s, the shipped head's "
        "measured in-server acceptance); deeper pipelines exit earlier, see --theta-by-pp",
    )
    p.add_argument(
        "--theta-by-pp",
        default="",
        help="acceptance per pipeline depth, e.g. '4=0.63,8=0.48' (overrides --theta there)",
    )
    p.add_argument(
        "--batch", type=int, default=None, help="resident requests (default: KV-limited, <= 512)"
    )
    p.add_argument("--context", type=int, default=128, help="prompt tokens (default: %(default)s)")
    p.add_argument(
        "--output-len",
        type=int,
        default=512,
        help="output tokens, for the KV fit (default: %(default)s)",
    )
    p.add_argument(
        "--alphas",
        type=float,
        nargs="*",
        default=[0.1, 0.2, 0.3],
        help="selective-speculation drop ratios to try besides 0 (default: %(default)s)",
    )
    p.add_argument(
        "--loop",
        choices=("serial", "overlap"),
        default="overlap",
        help="SP loop: the one Spexis runs (overlap: stage 0's host work behind the GPU; host "
        "costs from its phase timers on the emulated two-GPU box) or the earlier one (serial: "
        "host phases on the critical path). Default: %(default)s",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="K",
        help="SP's draft head drafts among the first K token ids (--spexis-draft-vocab), "
        "which shortens stage 0 (default: the whole vocabulary)",
    )
    p.add_argument("--calibration", default=None, help="another calibration.json")
    p.add_argument(
        "--alpha-model",
        choices=("paper", "exact"),
        default="paper",
        help="with --profile: SP_alpha model, Eq. 3-4 as printed (paper) or the exact steady "
        "state (exact). Default: %(default)s",
    )
    p.add_argument("--top", type=int, default=0, help="show only the best N rows (0 = all)")
    p.add_argument("--json", metavar="OUT", help="also write the ranked rows to this JSON file")
    return p


def _theta_by_pp(text: str) -> dict:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        k, _, v = item.partition("=")
        try:
            pp, th = int(k), float(v)
        except ValueError:
            raise ValueError(f"--theta-by-pp: expected PP=THETA items, got {item!r}") from None
        if pp < 2 or not 0 <= th <= 1:
            raise ValueError(f"--theta-by-pp: {item!r} needs PP >= 2 and THETA in [0, 1]")
        out[pp] = th
    return out


def _main_profile(args) -> int:
    try:
        profile = load_profile(args.profile)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = rank_configurations(profile, alpha_model=args.alpha_model)
    shown = rows[: args.top] if args.top > 0 else rows
    print(f"profile: {profile.name} ({profile.num_gpus} GPUs), alpha model: {args.alpha_model}")
    print(format_table(shown))
    if any(r.extrapolated for r in shown):
        print("* latency extrapolated beyond the largest profiled batch")
    best = rows[0]
    print(f"best: {best.label} at {best.throughput:.1f} tok/s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "profile": profile.name,
                    "alpha_model": args.alpha_model,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=2,
            )
    return 0


def _main_simulate(args) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("aiconfigurator_core", "aiconfigurator"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from spexis_sglang.planning.aic import load_model_shape
        from spexis_sglang.planning.machines import bridge_for
        from spexis_sglang.planning.presets import load_calibration
        from spexis_sglang.planning.search import format_ranking, rank_deployments

        cal = load_calibration(args.calibration)
        shape = load_model_shape(args.model)
        if args.draft_vocab is not None:
            if not 1 <= args.draft_vocab <= shape.vocab_size:
                raise ValueError(
                    f"--draft-vocab must be between 1 and the model's vocabulary "
                    f"({shape.vocab_size} ids), got {args.draft_vocab}"
                )
            shape = dataclasses.replace(shape, draft_vocab=args.draft_vocab)
        rows = rank_deployments(
            shape,
            args.system,
            args.gpus,
            theta=args.theta,
            theta_by_pp=_theta_by_pp(args.theta_by_pp),
            batch=args.batch,
            context=args.context,
            output_len=args.output_len,
            alphas=[a for a in args.alphas if a > 0],
            loop=args.loop,
            calibration=cal,
        )
    except (ImportError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sc = cal.system(args.system)
    err = sc.error_bar + (0.10 if args.loop == "overlap" else 0.0)
    bridge = bridge_for(args.system)
    drafts = "" if shape.draft_vocab is None else f", drafting among {shape.draft_vocab} ids"
    print(
        f"model: {shape.name} ({shape.num_layers} layers, hidden {shape.hidden_size}{drafts}); "
        f"system: {args.system} x {args.gpus} (AIConfigurator sglang {bridge.version} tables, "
        f"NVLink {bridge.link().bandwidth_Bps / 1e9:.0f} GB/s); CUDA graphs on"
    )
    how = (
        sc.source if sc.borrowed_from is None else f"borrowed from {sc.borrowed_from}: {sc.source}"
    )
    print(f"calibration: {how}")
    print(
        f"B = {rows[0].batch} resident requests, prompt {args.context} tokens; SP loop: "
        f"{args.loop}; error bar +-{100 * err:.0f} % (validation"
        + (", + 10 points: host costs checked only on the box" if args.loop == "overlap" else "")
        + ")"
    )
    shown = rows[: args.top] if args.top > 0 else rows
    print(format_ranking(shown, err))
    best = rows[0]
    if len(rows) > 1:
        second = rows[1]
        margin = best.throughput / second.throughput - 1
        verdict = "beyond" if margin > 2 * err else "within"
        print(
            f"best: {best.label} at {best.throughput:.0f} tok/s, +{100 * margin:.1f} % over "
            f"{second.label} ({verdict} the combined error bars of +-{100 * err:.0f} % each)"
        )
    else:
        print(f"best: {best.label} at {best.throughput:.0f} tok/s")
    cf_best = max(rows, key=lambda r: r.closed_form)
    if cf_best is not best:
        print(
            f"today's closed form would pick {cf_best.label} ({cf_best.closed_form:.0f} tok/s "
            f"on GPU time alone); simulated it reaches {cf_best.throughput:.0f} tok/s "
            f"({100 * cf_best.throughput / cf_best.closed_form:.0f} % of it): the loop's host "
            "phases and transfers sit on its critical path"
        )
    else:
        print("today's closed form picks the same deployment")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "model": shape.name,
                    "system": args.system,
                    "gpus": args.gpus,
                    "loop": args.loop,
                    "error_bar": err,
                    "calibration": how,
                    "rows": [r.to_json() for r in rows],
                },
                f,
                indent=2,
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.profile:
        return _main_profile(args)
    if args.gpus < 1:
        print("error: --gpus must be >= 1", file=sys.stderr)
        return 2
    return _main_simulate(args)


if __name__ == "__main__":
    sys.exit(main())
