"""Compare token ids of two servers, telling floating-point near-ties from real bugs.

Plain SGLang is not batch-invariant: a row's logits move in the last bits when the batch
around it changes, so two correct servers can pick different tokens where the top two logits
almost tie (design.md §5). At the first position where the outputs differ:

1. the reference model's top-2 gap for that prefix below ``NEAR_TIE_REL`` (relative) is noise;
2. otherwise, if plain SGLang itself produces the other server's token there when the same
   prompt runs in another batch composition (alone, or the batch in reverse order), the
   position is batch-unstable in the baseline: noise too (seen on CPU fp32 at relative gaps
   up to ~1e-3, e.g. SmolLM2 where the baseline alone and in a batch of 32 disagree);
3. anything else is a real mismatch: a bug.

All counts are reported; nothing is hidden by comparing prefixes only.
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
    baseline_unstable_flips: List[Tuple[int, int, float]] = field(default_factory=list)
    real_mismatches: List[Tuple[int, int, float]] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.identical} identical, {len(self.near_tie_flips)} near-tie flips "
            f"{self.near_tie_flips}, {len(self.baseline_unstable_flips)} flips where plain "
            f"SGLang itself is batch-unstable {self.baseline_unstable_flips}, "
            f"{len(self.real_mismatches)} real mismatches "
            f"{self.real_mismatches} (prompt, position, relative top-2 gap)"
        )


@torch.no_grad()
def top2_relative_gap(model_dir: str, prefix: List[int]) -> float:
    logits = load_model(model_dir)(input_ids=torch.tensor([prefix])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float((top[0] - top[1]) / top[0].abs().clamp_min(1e-6))


def _baseline_reproduces(baseline, prompts, i: int, got: List[int], j: int, params: dict) -> bool:
    """Does plain SGLang emit ``got[: j + 1]`` for prompt ``i`` in another batch composition?"""
    n = len(got)
    sampling = {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True, **params}
    variants = [[prompts[i]], list(reversed(prompts))]
    for batch in variants:
        out = baseline.generate({"input_ids": batch, "sampling_params": sampling})
        ids = out[0 if len(batch) == 1 else len(prompts) - 1 - i]["output_ids"]
        if ids[: j + 1] == got[: j + 1]:
            return True
    return False


def compare_outputs(
    model_dir: str,
    prompts: List[List[int]],
    expected: List[List[int]],
    got: List[List[int]],
    baseline=None,
    sampling_params: dict | None = None,
) -> Comparison:
    """Classify each prompt's outputs; ``baseline`` (the plain server) enables check 2."""
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
        if gap < NEAR_TIE_REL:
            out.near_tie_flips.append((i, j, gap))
        elif baseline is not None and _baseline_reproduces(
            baseline, prompts, i, b, j, sampling_params or {}
        ):
            out.baseline_unstable_flips.append((i, j, gap))
        else:
            out.real_mismatches.append((i, j, gap))
    return out
