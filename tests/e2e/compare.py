"""Compare token ids of two servers, telling floating-point near-ties from real bugs.

Plain SGLang is not batch-invariant: a row's logits move in the last bits when the batch
around it changes, so two correct servers can pick different tokens where the top two logits
almost tie (design.md §5). At the first position where the outputs differ we look at the
reference model's logits for that prefix: a gap below ``NEAR_TIE_REL`` (relative) is noise,
anything else is a bug. Both counts are reported; nothing is hidden by comparing prefixes only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import torch

from .reference import load_model

NEAR_TIE_REL = 1e-4


@dataclass
class Comparison:
    identical: int = 0
    near_tie_flips: List[Tuple[int, int, float]] = field(default_factory=list)
    real_mismatches: List[Tuple[int, int, float]] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.identical} identical, {len(self.near_tie_flips)} near-tie flips "
            f"{self.near_tie_flips}, {len(self.real_mismatches)} real mismatches "
            f"{self.real_mismatches} (prompt, position, relative top-2 gap)"
        )


@torch.no_grad()
def top2_relative_gap(model_dir: str, prefix: List[int]) -> float:
    logits = load_model(model_dir)(input_ids=torch.tensor([prefix])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float((top[0] - top[1]) / top[0].abs().clamp_min(1e-6))


def compare_outputs(
    model_dir: str,
    prompts: List[List[int]],
    expected: List[List[int]],
    got: List[List[int]],
) -> Comparison:
    out = Comparison()
    for i, (prompt, a, b) in enumerate(zip(prompts, expected, got)):
        if a == b:
            out.identical += 1
            continue
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if j == min(len(a), len(b)):  # one is a prefix of the other: a length bug
            out.real_mismatches.append((i, j, float("nan")))
            continue
        gap = top2_relative_gap(model_dir, list(prompt) + list(a[:j]))
        (out.near_tie_flips if gap < NEAR_TIE_REL else out.real_mismatches).append((i, j, gap))
    return out
