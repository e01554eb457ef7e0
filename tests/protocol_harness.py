"""Helpers of the in-process tests of the live membership protocol (one real store, this process a member)."""

from __future__ import annotations

from adaptive.runtime import membership
from adaptive.runtime.live_protocol import Generation, Member


def with_others(store, *others: Member) -> Generation:
    """Make this process a member of a running generation 2 with ``others`` after it."""
    generation = Generation(2, (membership.membership().me(),) + others)
    membership.publish(store, generation)
    membership.enter(generation)
    return generation
