"""Allocation policies and their registry: ``goodput`` (ours), ``pollux`` (the
Pollux reproduction it improves on) and the ``tiresias`` baseline.

:data:`POLICIES` maps each registered name to its class and
:func:`make_policy` builds one by name.  (The Optimus numbers quoted by
``benchmarks/bench_scheduler.py`` are the published ones; no Optimus policy
is implemented here.)
"""

from __future__ import annotations

from typing import Any

from scheduler.policies.base import Policy
from scheduler.policies.goodput import GoodputPolicy
from scheduler.policies.pollux import PolluxPolicy
from scheduler.policies.tiresias import TiresiasPolicy

POLICIES: dict[str, type[Policy]] = {
    GoodputPolicy.name: GoodputPolicy,
    PolluxPolicy.name: PolluxPolicy,
    TiresiasPolicy.name: TiresiasPolicy,
}


def make_policy(name: str, **options: Any) -> Policy:
    """Instantiate the policy registered as ``name`` with ``options``."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(**options)


__all__ = ["POLICIES", "GoodputPolicy", "Policy", "PolluxPolicy", "TiresiasPolicy", "make_policy"]
