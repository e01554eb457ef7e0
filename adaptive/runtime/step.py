"""The step: one typed, immutable message from the running loader to the models and optimizers.

What a training step is (how many micro-batches, which one is being
trained, its planned and actual size, the loss weight of the micro-batch,
how the learning rate follows the actual size) is decided by the
:class:`~adaptive.AdaptiveDataLoader` that plans it.  The loader publishes a
:class:`StepContext` before it yields each micro-batch; everything that acts
on a step reads it from here, and nothing reads the loader:

* the optimizer wiring of the model wrappers (``optimizer.step()`` is skipped
  on accumulation micro-steps, ``zero_grad()`` acts on the first micro-step
  only, the per-step LR factor; :mod:`adaptive.parallel._training`);
* the gradient-noise-scale measurement (the batch configuration of the step,
  :class:`adaptive.batchsize.gns.GradientNoiseScale`);
* the user's loop, through the loader's ``micro_step``, ``loss_weight`` and
  ``is_accumulation_step()``.

So the batch size a user passes travels one way: ``AdaptiveDataLoader`` ->
its planned step -> :class:`StepContext` -> wrapper, noise scale and
optimizer step.  Between loader loops there is no step (:func:`current_step`
is None) and optimizers step as they would without ``adaptive``.

The :class:`StepStream` record also counts what the loader commits and what
the optimizers take, which is how a peek at a batch (``next(iter(loader))``)
is told from a trained step, and how a periodic checkpoint knows whether a
step was trained since the last one.
"""

from __future__ import annotations

import dataclasses

from adaptive.runtime.job import current_job

__all__ = ["StepContext", "StepStream", "current_step", "loop_running", "stream", "begin_step", "record_fault",
           "faulted", "discarded"]


@dataclasses.dataclass(frozen=True)
class StepContext:
    """One micro-step of one optimizer step, as the loader planned it.

    Sizes count the loader's unit (samples, or real tokens with a token
    budget) over all replicas.
    """

    loader: str  #: the name of the loader whose loop planned the step
    index: int  #: the loader's step counter before this step (it counts committed steps)
    micro_step: int  #: which micro-batch of the step is being trained, from 0
    num_micro_steps: int  #: micro-batches per replica in the step (gradient accumulation when > 1)
    size: int  #: what the step actually holds
    planned_size: int  #: the global batch size the plan aimed for (the loader's current batch size)
    init_batch_size: int  #: the batch size the user passed: the reference of the LR scaling rules
    local_batch_size: int  #: the micro-batch size of one replica (samples, or the token budget)
    num_replicas: int  #: replicas training the step
    loss_weight: float  #: the factor of this micro-batch's summed loss (see ``AdaptiveDataLoader.loss_weight``)
    padding: bool  #: this micro-batch is padding (a token-budget step shorter on this replica): weight 0
    lr_scaling: str  #: how the LR follows ``size / planned_size``: "auto", "linear", "sqrt" or "none"

    @property
    def is_accumulation_step(self) -> bool:
        """Not the last micro-step of the optimizer step: gradients are still being accumulated."""
        return self.micro_step < self.num_micro_steps - 1

    @property
    def continues_accumulation(self) -> bool:
        """Not the first micro-step of the optimizer step: the gradients of earlier micro-steps are kept."""
        return self.micro_step > 0


@dataclasses.dataclass
class StepStream:
    """The job's step record (on the job context, :mod:`adaptive.runtime.job`)."""

    loop: str | None = None  #: the loader whose loop is running, if any
    current: StepContext | None = None  #: the micro-step being trained, inside a loader loop
    optimizer_steps: int = 0  #: optimizer steps the wrapped optimizers took (not skipped during accumulation)
    steps_committed: int = 0  #: loader steps this process trained to the end (all their micro-batches)
    #: Live mode: a collective of the step in flight failed (a peer was lost); the step is discarded, and
    #: until the members re-form nothing more goes over the group (:func:`record_fault`).
    fault: BaseException | None = None
    #: Live mode: an update of the step in flight was agreed on and applied by every member
    #: (:mod:`adaptive.runtime.step_commit`); the step counts as trained even when a member is lost after it.
    step_committed: bool = False
    #: Live mode: an update of the step in flight was agreed against (applied by no member).
    step_aborted: bool = False


def stream() -> StepStream:
    """This job's step record."""
    return current_job().part(StepStream)


def current_step() -> StepContext | None:
    """The micro-step being trained now, or None outside loader loops."""
    return current_job().part(StepStream).current


def loop_running() -> bool:
    """Whether a loader loop is running (objects created now would not be found again by a replay)."""
    return current_job().part(StepStream).loop is not None


def begin_step() -> None:
    """A loader step begins: no update of it was agreed on yet."""
    steps = stream()
    steps.step_committed = steps.step_aborted = False


def record_fault(error: BaseException) -> None:
    """Live mode: a collective of the step in flight failed; the step will be discarded (the first error is kept)."""
    steps = stream()
    if steps.fault is None:
        steps.fault = error


def faulted() -> bool:
    """Whether the step in flight lost a peer (live mode): skip its optimizer step and further collectives."""
    return current_job().part(StepStream).fault is not None


def discarded() -> bool:
    """Whether the step in flight is discarded and trained again (live mode): it lost a peer before every member
    applied its update.  A step whose update every member applied counts as trained, even when a peer is lost
    after it (:mod:`adaptive.runtime.step_commit`)."""
    steps = current_job().part(StepStream)
    return steps.fault is not None and not steps.step_committed
