"""SplitMix64: the one integer mixer behind every seeded key.

Pure integer arithmetic, so keys derived from (seed, epoch, ...) are the
same on every process and platform (unlike Python's salted ``hash()``).
The permutation's round keys and the token planner's shuffle keys are
both derived here; their outputs must never change, since a checkpoint's
position is only meaningful under the order that (seed, epoch) gives.
"""

from __future__ import annotations

__all__ = ["MASK64", "GOLDEN_GAMMA", "MIX_MULTIPLIER_1", "MIX_MULTIPLIER_2", "mix64", "splitmix64_step"]

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd: SplitMix64's increment
MIX_MULTIPLIER_1 = 0xBF58476D1CE4E5B9  # SplitMix64's finaliser multipliers
MIX_MULTIPLIER_2 = 0x94D049BB133111EB


def mix64(z: int) -> int:
    """SplitMix64's finaliser: a 64-bit integer mixed to an unrelated one (a bijection)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX_MULTIPLIER_1) & MASK64
    z = ((z ^ (z >> 27)) * MIX_MULTIPLIER_2) & MASK64
    return z ^ (z >> 31)


def splitmix64_step(state: int) -> tuple[int, int]:
    """One step of the SplitMix64 generator: ``(next_state, output)``."""
    state = (state + GOLDEN_GAMMA) & MASK64
    return state, mix64(state)
