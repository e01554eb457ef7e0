"""What an :class:`~adaptive.AdaptiveDataLoader` checkpoints: where it is in the job.

The loop in progress (its epoch and number within the epoch), the global
position in that loop's permutation, the loops already finished in each
epoch (skipped on replay), the optimizer steps taken and the samples (or
tokens) consumed over the whole job, and a token-budget plan in progress.
"""

from __future__ import annotations

import copy

from typing import Callable

from adaptive.checkpoint import states

__all__ = ["LoaderState"]

#: The state of the loader named ``name`` is ``adaptive.dataloader.<name>`` (also in 0.1 checkpoints).
_NAME_PREFIX = "adaptive.dataloader."


class LoaderState(states.State):
    """Where a loader is: the loop in progress, its position, samples (tokens) consumed, finished loops."""

    def __init__(self, name: str, batch_size: int, scope: int | None,
                 after_admission: Callable[[], None] | None = None) -> None:
        super().__init__(_NAME_PREFIX + name, scope=scope)
        self._after_admission = after_admission  # the loader follows a reference batch size restored late
        self.epoch: int | None = None  # epoch of the loop in progress (None: outside epochs)
        self.loop = 0  # which loop of this loader in that epoch (1-based; 0: none yet)
        self.index = 0  # global samples consumed (or skipped) by that loop
        self.finished: dict[int | None, int] = {}  # epoch -> last finished loop
        self.step = 0  # steps taken over the whole job
        self.batch_size = batch_size  # reference size: the global batch the LR was tuned for
        self.consumed = 0  # samples (tokens with a budget) trained over the whole job: drives ramp-up
        self.plan: dict | None = None  # token budgets: the TokenPlanState of the loop in progress

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "loop": self.loop,
            "index": self.index,
            "finished": [[key, value] for key, value in self.finished.items()],
            "step": self.step,
            "batch_size": self.batch_size,
            "consumed": self.consumed,
            "plan": self.plan,
        }

    def live_copy(self) -> dict:
        """Live mode, after every committed step: :meth:`state_dict` holds fresh containers of numbers already;
        only a token plan is copied deeply (a generic deep copy is most of the cost here)."""
        state = self.state_dict()
        if state["plan"] is not None:
            state["plan"] = copy.deepcopy(state["plan"])
        return state

    def manifest_step(self) -> tuple[str, int]:
        """The loader's name (with the epoch that owns it, if any) and the steps it took, for the manifest."""
        return self.name[len(_NAME_PREFIX):], int(self.step)

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.loop = int(state["loop"])
        self.index = int(state["index"])
        self.finished = {key: int(value) for key, value in state["finished"]}
        self.step = int(state["step"])
        self.batch_size = int(state["batch_size"])
        self.consumed = int(state["consumed"])
        self.plan = state["plan"]

    def restore_on_admission(self) -> None:
        """A live joiner restores its loader's position (and reference batch size) once admitted."""
        if states.load_state(self) and self._after_admission is not None:
            self._after_admission()
