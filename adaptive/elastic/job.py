"""The job context: everything one training process holds about its job, on one object.

A training process takes part in exactly one job.  What it knows about that
job (its process groups, the checkpoint it resumed, the states that the next
checkpoint will hold, the stop and checkpoint agreement in progress, the
epoch, the loader loop that is running and the models being trained) lives
on one :class:`Job`, reached through :func:`current_job`.  Modules keep no
mutable state of their own: the loader finds the model, and the model the
running loop, through the job.  :func:`reset_job` forgets it all at once, as
if the process had restarted (tests use it between in-process "restarts").

The pieces are plain records grouped by the layer that owns them; each
layer's module reads and changes its own piece only.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import weakref
from typing import Any, Callable

__all__ = ["Job", "current_job", "reset_job"]


@dataclasses.dataclass
class ProcessGroups:
    """The groups :mod:`adaptive.elastic.collectives` created (gloo, for control messages)."""

    control: Any = None  # object collectives and the agreements' flags
    asynchronous: Any = None  # operations issued from the background thread
    executor: Any = None  # the thread that runs asynchronous operations
    owns_default_group: bool = False  # init_process_group created the default group
    teardown_registered: bool = False


@dataclasses.dataclass
class CheckpointSession:
    """The checkpoint side of the job (:mod:`adaptive.checkpoint.states`)."""

    registry: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> State, in creation order
    store: Any = None
    store_root: str | None = None
    generation: Any = None  # rank 0: the Generation this incarnation took in store_root (adaptive.checkpoint.generation)
    generation_checked_at: float | None = None  # monotonic, when rank 0 last read the newest generation
    stale: Any = None  # rank 0: the StaleGenerationError once a newer generation was seen
    resumed: Any = None  # the checkpoint this process resumed from
    resumed_looked_up: bool = False
    last_save_time: float | None = None  # monotonic
    save_count: int = 0
    steps_at_save: int = 0  # Training.steps_committed when this process last took part in a save
    epoch_scope: int | None = None  # the epoch in progress, owner of the states created now
    name_counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    pending_save: Any = None  # the asynchronous save in flight (adaptive.checkpoint._saving)
    save_group: Any = None  # the gloo group of asynchronous saves, created by the first one
    exit_wait_registered: bool = False  # the end of the process waits for the save in flight


@dataclasses.dataclass
class Agreement:
    """The stop and checkpoint agreement between replicas (:mod:`adaptive.elastic.sync_points`)."""

    stop_requested: bool = False
    stop_signal: int | None = None
    handlers_installed: bool = False
    previous_handlers: dict[int, Any] = dataclasses.field(default_factory=dict)
    pending: Any = None  # the agreement in flight: (waitable, saves done when it was issued)
    decided: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # (stop, checkpoint) to act on
    started: float = dataclasses.field(default_factory=time.monotonic)
    spacing: int = 1  # step boundaries from one agreement to the next (agreed by all replicas)
    countdown: int = 0  # step boundaries left until the next agreement
    agreed_at: float | None = None  # when the last agreement started (monotonic)
    metadata: Callable[[], dict] = dict  # describes the position of the loop in progress
    exiting: bool = False  # an agreed stop is ending the process (no warning about a loop left early)


@dataclasses.dataclass
class EpochProgress:
    """The epoch loop (:mod:`adaptive.elastic.epoch`)."""

    state: Any = None  # the checkpointed epoch counter
    looping: bool = False
    total: int | None = None  # the epoch count the running loop declared (remaining_epochs_until(total))
    finish_pending: bool = False  # finish_training() inside a loader step: the loader saves after the step
    left_early: str | None = None  # the warning about an epoch loop left without finish_training(), until the end
    left_early_hooked: bool = False  # the end of the process logs it (adaptive.elastic.epoch.warn_if_left_early)


@dataclasses.dataclass
class Training:
    """What is being trained: the running loader loop and the models."""

    loop: Any = None  # the AdaptiveDataLoader whose loop is running, if any
    model: Any = None  # the most recently created AdaptiveDataParallel
    models: "weakref.WeakSet[Any]" = dataclasses.field(default_factory=weakref.WeakSet)  # every live one
    optimizer_steps: int = 0  # optimizer steps the wrapped optimizers took (not skipped during accumulation)
    steps_committed: int = 0  # loader steps this process trained to the end (all their micro-batches)
    random_state: Any = None  # the checkpointed generator states (adaptive.elastic.random_state)


@dataclasses.dataclass
class Job:
    """One training process's view of its job; see the module docstring."""

    groups: ProcessGroups = dataclasses.field(default_factory=ProcessGroups)
    checkpoints: CheckpointSession = dataclasses.field(default_factory=CheckpointSession)
    agreement: Agreement = dataclasses.field(default_factory=Agreement)
    epochs: EpochProgress = dataclasses.field(default_factory=EpochProgress)
    training: Training = dataclasses.field(default_factory=Training)


_job = Job()
_on_reset: list[Callable[[Job], None]] = []


def current_job() -> Job:
    """This process's job."""
    return _job


def on_reset(release: Callable[[Job], None]) -> None:
    """Run ``release(old_job)`` when the job is reset (to give back what it holds: signal handlers, groups)."""
    _on_reset.append(release)


def reset_job() -> Job:
    """Forget the job, as if the process restarted; returns the new, empty one."""
    global _job
    old, _job = _job, Job()
    for release in _on_reset:
        release(old)
    return _job
