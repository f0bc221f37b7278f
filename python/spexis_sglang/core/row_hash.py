"""Deterministic per-row uniform numbers for the benchmark-only modes, a batch per call.

Forced acceptance (``srt/sp_forced.py``) and the length oracle (``core/length_oracle.py``)
both need a random draw per decode row that depends only on what identifies the row (a hash
of the request id, the position, ...), never on a shared random stream: every rank, and every
rerun, then draws the same. splitmix64's finaliser over uint64 arrays (unsigned arithmetic
wraps modulo 2**64, as the hash wants).
"""

from __future__ import annotations

import numpy as np

__all__ = ["uniform64", "uniform64_scalar"]

_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xBF58476D1CE4E5B9)
_C3 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def uniform64(base: np.ndarray, position: np.ndarray, epoch: np.ndarray) -> np.ndarray:
    """Uniform numbers in [0, 1) from three uint64 arrays (splitmix64's finaliser)."""
    with np.errstate(over="ignore"):
        x = base * _C1 + position * _C2 + epoch * _C3
        x ^= x >> np.uint64(30)
        x *= _C2
        x ^= x >> np.uint64(27)
        x *= _C3
        x ^= x >> np.uint64(31)
    return x.astype(np.float64) / 18446744073709551616.0


def uniform64_scalar(base: int, position: int, epoch: int) -> float:
    """:func:`uniform64` for one row, in Python integers (the reference for tests)."""
    x = base * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + epoch * 0x94D049BB133111EB
    x &= _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x / 18446744073709551616.0
