"""Compare the token ids of two servers: identical, or a mismatch with its evidence.

The equality tests run every server in the exact mode (``spexis_sglang.testing.exact_test_args``:
float64 on CPU, batch-invariant kernels on a GPU). In float64, batch composition moves a row's
top-2 logit gap by ~1e-13 at most (``benchmark/correctness/batch_noise.py``), so a greedy token can
only flip where the two best logits tie to about 1e-12: across the suite's few thousand
positions that has a probability of ~1e-8. The tests therefore demand identical token ids,
with no noise classes. (Without the mode, SGLang's dtype "auto" runs these float32 checkpoints
in float16, not float32: there the same shift reaches ~1e-2 and flipped CI's equality test at a
relative gap of 3.8e-4.)

For a mismatch, the summary gives the first differing position and the float64 reference
model's relative top-2 gap there, so a reader can see at once whether it is a near-tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import torch

from .reference import load_model


@dataclass
class Comparison:
    identical: int = 0
    #: (prompt, first differing position, float64 reference relative top-2 gap)
    mismatches: List[Tuple[int, int, float]] = field(default_factory=list)

    @property
    def all_identical(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        return (
            f"{self.identical} identical, {len(self.mismatches)} mismatches {self.mismatches} "
            "(prompt, first differing position, float64 reference relative top-2 gap)"
        )


@torch.no_grad()
def top2_relative_gap(model_dir: str, prefix: List[int]) -> float:
    logits = load_model(model_dir)(input_ids=torch.tensor([prefix])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float((top[0] - top[1]) / top[0].abs().clamp_min(1e-6))


def compare_outputs(
    model_dir: str,
    prompts: List[List[int]],
    expected: List[List[int]],
    got: List[List[int]],
) -> Comparison:
    """Count identical outputs; describe each mismatch by its first differing position."""
    out = Comparison()
    for i, (prompt, a, b) in enumerate(zip(prompts, expected, got)):
        if a == b:
            out.identical += 1
            continue
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if j == min(len(a), len(b)):  # one is a prefix of the other: a length bug
            out.mismatches.append((i, j, float("nan")))
            continue
        out.mismatches.append((i, j, top2_relative_gap(model_dir, list(prompt) + list(a[:j]))))
    return out
