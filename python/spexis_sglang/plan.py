"""Rank PP x TP x SP x alpha deployments from a profile: ``python -m spexis_sglang.plan``.

A thin CLI over :mod:`spexis_sglang.core.planner`; the profile format is documented there
and in ``benchmark/profiles/README.md``.

Example::

    python -m spexis_sglang.plan --profile benchmark/profiles/example_8gpu.json
"""

from __future__ import annotations

import argparse
import json
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
        description="Rank PP x TP x SP x alpha configurations by predicted decode throughput "
        "(Spexis cost model, paper Table 1 and Eq. 1-4).",
    )
    p.add_argument(
        "--profile",
        required=True,
        help="profile JSON (see benchmark/profiles/README.md)",
    )
    p.add_argument(
        "--alpha-model",
        choices=("paper", "exact"),
        default="paper",
        help="SP_alpha model: Eq. 3-4 as printed (paper) or the exact steady state (exact). "
        "Default: %(default)s",
    )
    p.add_argument("--top", type=int, default=0, help="show only the best N rows (0 = all)")
    p.add_argument("--json", metavar="OUT", help="also write the ranked rows to this JSON file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
