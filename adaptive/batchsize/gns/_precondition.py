"""Adam preconditioning of the gradient noise measurement.

For Adam-type optimizers (parameter groups with ``betas`` and ``eps`` whose
state holds ``exp_avg_sq``), gradients are measured in the geometry the
optimizer steps in: every squared gradient element is divided by
``sqrt(v_hat) + eps``, with ``v_hat`` Adam's bias-corrected second moment
(``max_exp_avg_sq`` with amsgrad).  The preconditioner is a persistent
float32 copy of the parameters' shape (the square root of that factor, so
one multiply of the gradient gives the weighted norm), refreshed every
``interval`` optimizer steps.  Before the optimizer's first step there is
no ``v_hat``: those steps are not measured (their statistics would be in
different units).  An Adam-like optimizer without ``exp_avg_sq`` (Adamax,
...) is measured without preconditioning.

Under FSDP2 the optimizer state is sharded like the parameters
(``exp_avg_sq`` is a DTensor): the preconditioner is then kept for the
local shard only (``local`` returns a DTensor's local tensor), the same rows
as the local shard of the gradient.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

__all__ = ["Preconditioner", "step_value"]

logger = logging.getLogger(__name__)


class Preconditioner:
    """Adam's ``1 / (sqrt(v_hat) + eps)``, kept as its square root per parameter.

    ``state`` is ``"waiting"`` (no optimizer state yet: do not measure),
    ``"ready"`` or ``"off"`` (the optimizer has no ``exp_avg_sq``).
    ``local`` maps a parameter or state tensor to the tensor read (default:
    itself; under sharding, a DTensor's local shard).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 group_of: Sequence[int], interval: int,
                 local: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self._optimizer = optimizer
        self._local = local if local is not None else (lambda tensor: tensor)
        self._params = list(params)
        self._group_of = list(group_of)
        self._interval = interval
        self.roots: list[torch.Tensor | None] = [None] * len(self._params)
        self.state = "waiting"
        self._refreshed_at = -1

    def restart(self) -> None:
        """Refresh at the next step, as a new preconditioner would (its step count starts again)."""
        self.state, self._refreshed_at = "waiting", -1

    def maybe_refresh(self, step: int) -> None:
        if self.state == "off" or (self.state == "ready" and step - self._refreshed_at < self._interval):
            return
        found = stepped = 0
        with torch.no_grad():
            for i, param in enumerate(self._params):
                state = self._optimizer.state.get(param)
                if not state:
                    continue
                stepped += 1
                group = self._optimizer.param_groups[self._group_of[i]]
                second = state.get("max_exp_avg_sq") if group.get("amsgrad") else None
                second = state.get("exp_avg_sq") if second is None else second
                if second is None or "step" not in state:
                    continue
                root = self.roots[i]
                if root is None:
                    root = self.roots[i] = torch.empty_like(self._local(param), dtype=torch.float32)
                correction = 1.0 - group["betas"][1] ** step_value(self._local(state["step"]))
                torch.div(self._local(second), correction, out=root)
                root.sqrt_().add_(group["eps"]).rsqrt_()
                found += 1
        if found:
            self.state, self._refreshed_at = "ready", step
        elif stepped:
            self.state = "off"
            logger.info("optimizer state has no exp_avg_sq; the gradient noise scale is measured "
                        "without preconditioning")


def step_value(step: torch.Tensor | float) -> torch.Tensor | float:
    """Adam's step count as a float, or a device tensor (no host sync)."""
    if isinstance(step, torch.Tensor):
        return float(step) if step.device.type == "cpu" else step.to(torch.float32)
    return float(step)
