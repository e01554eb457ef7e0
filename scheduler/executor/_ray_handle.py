"""The record of one Ray incarnation: its phase, what it holds on Ray, and what its nodes answered.

:class:`~scheduler.executor.ray_backend.RayBackend` never waits on Ray, so an
incarnation is not a call that returns but a record that each of its polls
advances: :class:`RayHandle` keeps where the incarnation is (:class:`Phase`),
the Ray objects it holds (its placement group and one launcher actor per
node), the Ray calls still pending and each node's heartbeats and exit. It is
kept apart from the backend's logic so that what the backend hands out (and
what :mod:`scheduler.executor.ray_live` keeps per replica) reads in one place.

It imports nothing of Ray. The public names are re-exported by
:mod:`scheduler.executor.ray_backend`, where users import them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from scheduler.executor.jobspec import JobSpec

__all__ = ["NodeCommand", "Phase", "RayHandle"]

#: One node's command line, from its rank (its position in the incarnation's nodes), the number of replicas
#: on it and the rendezvous endpoint (``HOST:PORT``).
NodeCommand: TypeAlias = Callable[[int, int, str], list[str]]


class Phase(str, enum.Enum):
    """Where an incarnation is; every phase but the last two has a deadline (the backend's ``timeout``)."""

    PLACING = "placing"      # waiting for the placement group
    CREATING = "creating"    # actors created: waiting for the rendezvous address (and the GPU ids)
    STARTING = "starting"    # waiting for each actor to start its launcher
    RUNNING = "running"      # launchers run: heartbeats
    ENDED = "ended"


@dataclass
class RayHandle:
    """One incarnation: its phase, placement group, actors (one per node), pending Ray calls and exits."""

    spec: JobSpec
    attempt: int
    nodes: tuple[int, ...]
    slots: tuple[int, ...]
    log_paths: tuple[str, ...]
    command: NodeCommand
    deadline: float
    phase: Phase = Phase.PLACING
    placement_group: Any = None
    actors: list[Any] = field(default_factory=list)
    #: The phase's pending calls: (position in ``nodes`` of the node called, ``ObjectRef``).
    pending: list[tuple[int, Any]] = field(default_factory=list)
    #: Outstanding heartbeats: position -> (``ObjectRef``, time sent).
    heartbeats: dict[int, tuple[Any, float]] = field(default_factory=dict)
    #: When the last answered heartbeat of each position was sent.
    answered: dict[int, float] = field(default_factory=dict)
    next_heartbeat: float = 0.0
    #: When a node's failure was first seen (the others are then confirmed alive before it counts).
    failed_at: float | None = None
    #: The rendezvous endpoint: given at launch, or a free port on the first node once its actor is created.
    endpoint: str | None = None
    #: What the logs and the placement group call it (default: the job's name).
    label: str = ""
    gpus: dict[int, list[str]] = field(default_factory=dict)
    pids: tuple[int, ...] = ()
    exit_code: int | None = None
    stopping: bool = False
    codes: dict[int, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.label or self.spec.name
