"""The random number generators of every rank, checkpointed so that a replay is bit-identical.

A crash rolls training back to the last checkpoint and trains the steps since
then again. For those steps to be the same steps, dropout masks and random
augmentations in the training process must draw the same numbers, so every
checkpoint holds each rank's generator states: torch's CPU generator, every
CUDA device's (when CUDA is initialised), numpy's global generator and
Python's ``random``. ``sync()`` gathers them from every rank before a save
(rank 0 writes them, as it writes every state).

**Where they are restored.** After a restart the script runs again from the
top (the replay rule, G5), and that code draws random numbers (model
initialisation, for instance). The saved states are therefore applied where
training resumes, not when they are read:

* when the checkpoint was taken at the end of an epoch, as the epoch loop
  starts the next epoch (code before the epoch's loops then draws what it
  drew in the uninterrupted run);
* otherwise when the interrupted loader loop resumes, just before its first
  step.

**Rescales.** With the same number of replicas each rank gets its own states
back. With another number, rank ``r`` takes saved rank ``r``'s states where
that rank existed; a new rank takes saved rank 0's states with its torch,
numpy and Python generators re-seeded from them and ``r``, so that no two
ranks draw the same numbers. A replay after a rescale is deterministic but
not that of the uninterrupted run, whose ranks were others.

**Live mode.** A live job's in-memory snapshots (:mod:`adaptive.elastic.live`)
keep each process's own generators (:func:`capture_local`), and the members
left after a loss put theirs back (:func:`restore_local`) with the other
states, so the steps they train again draw the numbers they drew the first
time.

DataLoader worker processes seed themselves from the loader's own generator
(see :mod:`adaptive.data.dataloader`), not from these: random augmentation
in workers is deterministic per (seed, epoch, loop, resume position), and
bit-identical across a rollback only when it is seeded per sample.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any

import numpy as np
import torch

from adaptive.checkpoint import states
from adaptive.runtime import collectives, env
from adaptive.runtime.job import current_job

__all__ = ["RandomState", "random_state", "restore_at", "capture_local", "restore_local"]

logger = logging.getLogger(__name__)

#: The checkpointed state's name.
NAME = "adaptive.random_state"


def capture_local() -> dict[str, Any]:
    """This process's generator states, as plain safely-loadable values."""
    # legacy=True is the default, spelled out: numpy's stubs type a call without it as the dict form.
    numpy_state = np.random.get_state(legacy=True)
    assert isinstance(numpy_state, tuple), "the global RandomState (an MT19937) gives the legacy tuple"
    python_state = random.getstate()
    captured: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"key": numpy_state[0], "state": torch.from_numpy(numpy_state[1].astype(np.int64)),
                  "pos": int(numpy_state[2]), "has_gauss": int(numpy_state[3]), "gauss": float(numpy_state[4])},
        "python": {"version": python_state[0], "state": list(python_state[1]), "gauss": python_state[2]},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        captured["cuda"] = torch.cuda.get_rng_state_all()
    return captured


def restore_local(saved: dict[str, Any], reseed: int | None = None) -> None:
    """Set this process's generators to ``saved`` (then re-seed them from ``reseed`` for a new rank)."""
    torch.set_rng_state(saved["torch"])
    numpy_state = saved["numpy"]
    np.random.set_state((numpy_state["key"], numpy_state["state"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["gauss"]))
    python_state = saved["python"]
    random.setstate((python_state["version"], tuple(python_state["state"]), python_state["gauss"]))
    cuda = saved.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        states_now = list(cuda)[:torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states_now)
    if reseed is not None:
        base = int(torch.randint(0, 2**62, (1,)).item())
        seed = (base * 1_000_003 + reseed) % (2**63 - 1)
        torch.manual_seed(seed)
        np.random.seed(seed % (2**32))
        random.seed(seed)


class RandomState(states.State):
    """Every rank's generator states (see the module docstring); one per job, made by :func:`random_state`."""

    version = 1

    def __init__(self) -> None:
        super().__init__(NAME)
        self._gathered: list[dict[str, Any]] | None = None
        self._saved: list[dict[str, Any]] | None = None
        self._restore_at: str | None = None
        self._joined_generation: int | None = None

    def sync(self) -> None:
        """Collective: gather every rank's generator states (rank 0 writes them)."""
        self._gathered = collectives.allgather_object(capture_local())

    def state_dict(self) -> dict[str, Any]:
        ranks = self._gathered if self._gathered is not None else [capture_local()]
        return {"version": self.version, "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._saved = list(state["ranks"])
        resumed = states.resumed_checkpoint()  # (loading implies one: the state came from it)
        meta = (resumed.info.metadata or {}) if resumed is not None else {}
        self._restore_at = "epoch" if meta.get("epoch_finished") or meta.get("training_ended") else "loop"
        self._joined_generation = meta.get("live_generation")  # sent by peers to a joiner of a live job

    def live_copy(self) -> dict[str, Any]:
        """Live mode, after every committed step: this process's own generators (not every rank's: no
        communication), in the generators' own forms, which are cheaper to take than :func:`capture_local`'s
        safely-loadable ones (this copy never leaves the process)."""
        copied: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                  "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            copied["cuda"] = torch.cuda.get_rng_state_all()
        return copied

    def restore_live_copy(self, saved: object) -> None:
        assert isinstance(saved, dict)
        torch.set_rng_state(saved["torch"])
        np.random.set_state(saved["numpy"])
        random.setstate(saved["python"])
        if "cuda" in saved:
            torch.cuda.set_rng_state_all(saved["cuda"])

    def restore(self, where: str) -> None:
        """Apply the saved states if training resumes at ``where`` (``"epoch"`` or ``"loop"``); once."""
        if self._saved is None or self._restore_at != where:
            return
        saved, self._saved = self._saved, None
        rank, count = env.rank(), len(saved)
        if self._joined_generation is not None:
            # A live joiner: the saved ranks' generators still run in the members that stayed (maybe under
            # other ranks), so it draws its own numbers, seeded from saved rank 0's, the generation and its rank.
            restore_local(saved[0], reseed=(int(self._joined_generation) << 20) + rank)
        elif rank < count:
            restore_local(saved[rank])
        else:
            restore_local(saved[0], reseed=rank)
        logger.debug("restored the random generators of rank %d (saved by %d ranks) where the %s resumes", rank,
                     count, where)


@dataclasses.dataclass
class _RandomStateSlot:
    """The job's :class:`RandomState` (its record on the job context, :mod:`adaptive.runtime.job`)."""

    state: RandomState | None = None


def random_state() -> RandomState:
    """This job's :class:`RandomState`, created (and read from the resumed checkpoint) on first use."""
    slot = current_job().part(_RandomStateSlot)
    if slot.state is None or not slot.state.is_registered():
        slot.state = RandomState()
        states.load_state(slot.state)
    return slot.state


def restore_at(where: str) -> None:
    """Training resumes here (``"epoch"``: the epoch loop's first epoch; ``"loop"``: an interrupted loop)."""
    random_state().restore(where)
