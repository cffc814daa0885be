"""Seeded shuffles of [0, n) that are never materialised: a permutation is a function of the position.

Responsible for: `SeededPermutation(n, key)`, a bijection of [0, n) evaluated on an array of positions in
O(len(positions)) time and O(1) memory whatever n is, and `derive_key`, the one way keys are made from a
seed and counters (epoch, source number). Used by the prepared datasets' epoch shuffles and by blends.
Not responsible for: which positions a rank reads (loader.py) or what a sample is (dataset.py).

Why not `torch.randperm` as `BatchLoader` does: a corpus of 10^10 samples would need an 80 GB index per
epoch. A Feistel network over the smallest even power of two >= n is a bijection of that power-of-two
range; "cycle walking" (apply it again while the result is >= n) restricts it to [0, n), since every cycle
of the bigger permutation that enters [0, n) must come back to it. The range is at most 4n, so a position
takes fewer than four walks on average. Six rounds of a 64-bit mixer (splitmix64's finaliser) make the
order look random for a data loader's purpose; it is not a cryptographic permutation and it is not the
same order as `BatchLoader`'s `torch.randperm`.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_MASK64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 values (multiplication wraps modulo 2^64, as intended)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: int) -> int:
    """A 64-bit key from integers (a seed, an epoch, a source number...): equal parts give equal keys."""
    key = 0
    for part in parts:
        x = (key ^ ((int(part) + 0x9E3779B97F4A7C15) & _MASK64))
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64  # _mix64, on Python integers
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        key = x ^ (x >> 31)
    return key


class SeededPermutation:
    """A bijection of [0, n) chosen by `key`; `perm(positions)` is the shuffled index at each position."""

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"cannot shuffle n={n} samples; n must be >= 1")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self._half = (bits + 1) // 2  # both halves of the Feistel network have the same width
        self._half_mask = np.uint64((1 << self._half) - 1)
        self._round_keys = [np.uint64(derive_key(key, r)) for r in range(ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self._half)
        left, right = x >> shift, x & self._half_mask
        for k in self._round_keys:
            left, right = right, left ^ (_mix64(right ^ k) & self._half_mask)
        return (left << shift) | right

    def __call__(self, positions) -> np.ndarray:
        """int64 indices at `positions` (any int array in [0, n))."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise ValueError(f"positions must lie in [0, {self.n}); got {pos.min()}..{pos.max()}")
        out = self._encrypt(pos.astype(np.uint64))
        outside = out >= np.uint64(self.n)
        while outside.any():  # cycle walking (see the module docstring)
            out[outside] = self._encrypt(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)
