"""Allocation policies: ``goodput`` (ours), ``tiresias`` and ``optimus`` baselines."""

from __future__ import annotations

from typing import Any, Dict, Type

from scheduler.policies.base import Policy
from scheduler.policies.goodput import GoodputPolicy
from scheduler.policies.tiresias import TiresiasPolicy

POLICIES: Dict[str, Type[Policy]] = {
    GoodputPolicy.name: GoodputPolicy,
    TiresiasPolicy.name: TiresiasPolicy,
}


def make_policy(name: str, **options: Any) -> Policy:
    """Instantiate the policy registered as ``name`` with ``options``."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(**options)


__all__ = ["POLICIES", "GoodputPolicy", "Policy", "TiresiasPolicy", "make_policy"]
