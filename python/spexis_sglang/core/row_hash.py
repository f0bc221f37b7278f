"""Deterministic per-row uniform numbers for the benchmark-only modes, a batch per call.

Forced acceptance (``srt/sp_forced.py``) and the length oracle (``core/length_oracle.py``)
both need a random draw per decode row that depends only on what identifies the row (a hash
of the request id, the position, ...), never on a shared random stream: every rank, and every
rerun, then draws the same. splitmix64's finaliser over uint64 arrays (unsigned arithmetic
wraps modulo 2**64, as the hash wants).
"""

from __future__ import annotations

import numpy as np

__all__ = ["below64", "row_key", "uniform64", "uniform64_scalar"]

_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xBF58476D1CE4E5B9)
_C3 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1
_TWO64 = 18446744073709551616.0


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place (wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _C2
        x ^= x >> np.uint64(27)
        x *= _C3
        x ^= x >> np.uint64(31)
    return x


def uniform64(base: np.ndarray, position: np.ndarray, epoch: np.ndarray) -> np.ndarray:
    """Uniform numbers in [0, 1) from three uint64 arrays (splitmix64's finaliser)."""
    with np.errstate(over="ignore"):
        x = base * _C1 + position * _C2 + epoch * _C3
    return _mix(x).astype(np.float64) / _TWO64


def row_key(base: int, epoch0: int) -> int:
    """The per-request part of :func:`uniform64`'s sum when the epoch is counted from
    ``epoch0``: ``base * C1 - epoch0 * C3`` modulo 2**64 (see :func:`below64`)."""
    return (base * int(_C1) - epoch0 * int(_C3)) & _MASK64


def below64(
    key: np.ndarray, position: np.ndarray, epoch: np.ndarray, threshold: np.ndarray
) -> np.ndarray:
    """``uniform64(base, position, epoch - epoch0) < p`` for every row, in fewer passes:
    ``key = row_key(base, epoch0)`` (uint64), ``position`` and ``epoch`` int64 (read as
    uint64: the sum wraps modulo 2**64 either way), ``threshold = p * 2**64`` (float64;
    scaling by a power of two is exact, so the comparison is the same)."""
    with np.errstate(over="ignore"):
        x = key + position.view(np.uint64) * _C2
        x += epoch.view(np.uint64) * _C3
    return _mix(x).astype(np.float64) < threshold


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
