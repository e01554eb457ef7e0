"""Loss weights: what each micro-batch's summed loss is multiplied by before ``backward()``.

DDP averages gradients over replicas and each replica accumulates over its
micro-steps, so with uneven micro-batches a plain mean per micro-batch
would weight a replica with 3 short samples like one with 300.  Instead
each micro-batch's *summed* loss (over its real tokens, or its samples) is
multiplied by ``divisor / total``: ``total`` is the step's real tokens (or
samples) over all replicas and ``divisor`` what the gradient reduction
divides the summed gradient by.  The step's gradient is then exactly the
mean over all of its tokens (samples), i.e. the single-process gradient of
the same samples.  Padding micro-batches (repeats that keep replicas in
lock-step at an epoch's end) get 0.

:func:`micro_batch_weight` is that rule, the one place it is computed.  The
loader applies it to every step, of sample batches or token budgets
(:func:`loss_weight`, for a :class:`~adaptive.data.steps.PlannedStep`);
:func:`loss_weights` and :func:`sample_loss_weights` give it for all
micro-batches (or samples) of a token planner's
:class:`~adaptive.data.tokens.micro_batches.TokenStep`.  Pure numpy (no
torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from adaptive._utils.checks import check_choice, check_int

if TYPE_CHECKING:
    from adaptive.data.steps import PlannedStep
    from adaptive.data.tokens.micro_batches import TokenStep

__all__ = [
    "AVERAGE_BY",
    "GRADIENT_REDUCTIONS",
    "LOSS_REDUCTIONS",
    "loss_weight",
    "loss_weights",
    "micro_batch_weight",
    "sample_loss_weights",
]

#: What the step's gradient is a mean over.
AVERAGE_BY = ("tokens", "samples")
#: How gradients are combined across replicas: DDP's mean, or a sum.
GRADIENT_REDUCTIONS = ("mean", "sum")
#: How a micro-batch's loss was reduced over its tokens (samples).
LOSS_REDUCTIONS = ("sum", "mean")


def micro_batch_weight(is_padding: bool, total: int, divisor: int) -> float:
    """Factor for one micro-batch's *summed* loss: ``divisor / total``, or 0.

    Args:
        is_padding: the micro-batch only repeats samples (weight 0).
        total: real tokens (or samples) of the whole step, over all replicas.
        divisor: what the gradient reduction divides the gradient summed
            over replicas and micro-steps by.
    """
    if is_padding or total <= 0:
        return 0.0
    return divisor / total


def loss_weight(step: PlannedStep, micro_step: int, total: int, divisor: int) -> float:
    """Factor for one micro-batch's *summed* loss so the step's gradient is a mean over ``total``.

    The data-parallel reduction divides the gradient summed over replicas
    and micro-steps by ``divisor`` (replicas x micro-steps for
    :class:`~adaptive.AdaptiveDataParallel`, replicas for plain DDP), so
    each summed loss is multiplied by ``divisor / total``; padding
    micro-batches get 0.
    """
    return micro_batch_weight(step.padding[micro_step], total, divisor)


def _total_and_divisor(step: TokenStep, average_by: str, gradient_reduction: str) -> tuple[int, int]:
    """The ``total`` and ``divisor`` of :func:`micro_batch_weight` for a token step."""
    check_choice("average_by", average_by, AVERAGE_BY)
    check_choice("gradient_reduction", gradient_reduction, GRADIENT_REDUCTIONS)
    total = step.num_tokens if average_by == "tokens" else step.num_samples
    divisor = step.num_replicas if gradient_reduction == "mean" else 1
    return total, divisor


def _token_step_weights(step: TokenStep, average_by: str, gradient_reduction: str) -> np.ndarray:
    """:func:`micro_batch_weight` of every ``[replica, micro_step]`` of a token step."""
    total, divisor = _total_and_divisor(step, average_by, gradient_reduction)
    return np.array(
        [[micro_batch_weight(mb.is_padding, total, divisor) for mb in replica] for replica in step.micro_batches],
        dtype=np.float64,
    )


def loss_weights(
    step: TokenStep,
    average_by: str = "tokens",
    gradient_reduction: str = "mean",
    loss_reduction: str = "sum",
) -> np.ndarray:
    """Multipliers ``w[replica, micro_step]`` for each micro-batch's loss before ``backward()``.

    Replica ``r`` computes for micro-step ``m`` the loss ``L[r, m]`` of its
    micro-batch over the real tokens (``average_by="tokens"``; mask the
    padded positions) or over its samples (``average_by="samples"``), calls
    ``(w[r, m] * L[r, m]).backward()`` and lets gradients accumulate over
    micro-steps. ``loss_reduction`` says how ``L`` was reduced: ``"sum"`` of
    the per-token (per-sample) losses, or their ``"mean"`` over the
    micro-batch (what most loss functions return by default; ``w`` then
    includes the micro-batch's token or sample count).

    With ``gradient_reduction="mean"`` (DDP, which divides the all-reduced
    sum by the world size) the resulting gradient is exactly the mean over
    all real tokens (samples) of the whole step, i.e. the single-process
    gradient of the same samples, however unevenly the tokens are spread
    over replicas and micro-steps; use ``"sum"`` if gradients are summed
    across replicas instead. Padding micro-batches get weight 0.
    """
    check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
    weights = _token_step_weights(step, average_by, gradient_reduction)
    if loss_reduction == "sum":
        return weights
    counts = step.tokens() if average_by == "tokens" else step.samples()  # 0 for padding
    return weights * counts.astype(np.float64)


def sample_loss_weights(
    step: TokenStep,
    rank: int,
    micro_step: int,
    average_by: str = "tokens",
    gradient_reduction: str = "mean",
) -> np.ndarray:
    """Per-sample weights (float64) for one micro-batch, in its sample order.

    Multiply each sample's summed token loss (``"tokens"``) or its per-sample
    loss (``"samples"``) by its weight and sum: the same result as
    :func:`loss_weights` with ``loss_reduction="sum"``, for code that weights
    samples rather than micro-batches.
    """
    micro_batch = step.local(rank)[check_int("micro_step", micro_step, 0, step.num_micro_steps - 1)]
    total, divisor = _total_and_divisor(step, average_by, gradient_reduction)
    weight = micro_batch_weight(micro_batch.is_padding, total, divisor)
    return np.full(micro_batch.num_samples, weight, dtype=np.float64)
