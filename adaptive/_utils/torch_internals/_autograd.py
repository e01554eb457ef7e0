"""Autograd and multi-tensor kernels: what the gradient noise scale runs once per measured step.

A callback at the end of the backward pass, the ``torch._foreach_*``
kernels over every gradient, and the loss scale an AMP grad scaler holds on
the device.  Part of the adapter :mod:`adaptive._utils.torch_internals`
(import the names from there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["queue_autograd_callback", "foreach_norm", "foreach_div_", "grad_scaler_scale"]


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """``Variable._execution_engine.queue_callback``: run ``callback`` when the current backward pass ends.

    Why: the noise scale reads the gradients once per backward, after the
    last hook (DDP's and FSDP's own finalisation use the same call); tensor
    and module hooks fire per tensor.  Call only during a backward.  In
    torch since 1.x; checked on 2.13.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float = 2, *,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """``torch._foreach_norm``: the norm of each tensor, in a few multi-tensor kernels.

    Why: per-parameter norms of every gradient per measured step; the public
    ``torch.linalg.vector_norm`` runs one kernel per tensor, and
    ``torch.nn.utils.get_total_norm`` (2.6+) returns only the total.  In torch
    since 1.x (its ``dtype=`` argument is newer); checked on 2.13.
    """
    return torch._foreach_norm(list(tensors), ord, dtype=dtype)


def foreach_div_(tensors: Sequence[torch.Tensor], divisor: float) -> None:
    """``torch._foreach_div_``: divide each tensor in place, in a few multi-tensor kernels.

    Why: averaging the accumulated gradients of every parameter; the public
    way is one ``div_`` per tensor.  In torch since 1.x; checked on 2.13.
    """
    torch._foreach_div_(list(tensors), divisor)


def grad_scaler_scale(scaler: object) -> torch.Tensor | None:
    """The loss scale an AMP ``GradScaler`` holds on the device (its ``_scale``), or None when it has none yet.

    Why: the public ``get_scale()`` returns a Python float, a device-to-host
    sync per measured step.  None also for a scaler of another kind (the
    caller falls back to ``get_scale()``).  In torch since 1.6 (GradScaler); checked on 2.13.
    """
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None
