"""Per-group squared gradient norms for the noise scale, computed on the device.

Norms are read with multi-tensor kernels where no preconditioning applies,
and through one reusable float32 workspace (the size of the largest
parameter) where it does; results are summed per optimizer parameter
group with one ``index_add_``.  The differenced estimator keeps a
persistent float32 copy of the previous step's gradient.

Under FSDP2 the gradients read are the local shards (``grad_of`` returns a
sharded gradient's local tensor) and the sums are this rank's part of the
norm; :mod:`adaptive.batchsize.gns._sharded` combines them across ranks.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from adaptive._utils import torch_internals
from adaptive.batchsize.gns._precondition import Preconditioner

__all__ = ["GroupNorms"]

#: Gradient dtypes whose norms are accumulated in float32; wider ones (float64) in their own precision.
_NARROW = (torch.float16, torch.bfloat16, torch.float32)


def _norm32(tensor: torch.Tensor) -> torch.Tensor:
    """The 2-norm of ``tensor`` as a float32 scalar (a float64 gradient is not narrowed before it is summed)."""
    if tensor.dtype in _NARROW:
        return torch.linalg.vector_norm(tensor, dtype=torch.float32)
    return torch.linalg.vector_norm(tensor).float()


class GroupNorms:
    """Squared norms of the tracked parameters' gradients, per parameter group.

    Args:
        params: the tracked parameters (their ``.grad`` is read).
        group_of: each parameter's optimizer group.
        num_groups: number of optimizer groups.
        preconditioner: Adam preconditioning, or None.
        grad_of: the gradient read for a parameter (default: its ``.grad``;
            under sharding, the local tensor of its sharded gradient).
    """

    def __init__(self, params: Sequence[torch.Tensor], group_of: Sequence[int], num_groups: int,
                 preconditioner: Preconditioner | None,
                 grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> None:
        self._params = list(params)
        self._grad_of = grad_of if grad_of is not None else (lambda param: param.grad)
        self._num_groups = num_groups
        self._preconditioner = preconditioner
        self._group_of = list(group_of)
        self._group_index: torch.Tensor | None = None
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._prev_grads: dict[int, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        """Where the norms (and the group sums) live: the first parameter's device *now* (a model built on
        the meta device is measured where ``to_empty`` put it)."""
        return self._params[0].device

    @property
    def group_index(self) -> torch.Tensor:
        """Each parameter's group, as a tensor on :attr:`device` for ``index_add_``."""
        if self._group_index is None or self._group_index.device != self.device:
            self._group_index = torch.tensor(self._group_of, dtype=torch.long, device=self.device)
        return self._group_index

    def precondition_active(self) -> bool:
        """Whether gradients are measured in Adam's geometry now."""
        return self._preconditioner is not None and self._preconditioner.state == "ready"

    def root(self, index: int) -> torch.Tensor | None:
        """The preconditioner's root for parameter ``index`` (None: not preconditioned)."""
        if not self.precondition_active():
            return None
        assert self._preconditioner is not None  # precondition_active() checked it
        return self._preconditioner.roots[index]

    def _workspace(self, like: torch.Tensor) -> torch.Tensor:
        work = self._workspaces.get(like.device)
        if work is None or work.numel() < like.numel():
            work = self._workspaces[like.device] = torch.empty(like.numel(), dtype=torch.float32,
                                                               device=like.device)
        return work[:like.numel()].view(like.shape)

    def _preconditioned(self, grad: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """``grad * root`` in the reusable workspace (valid until the next call; a new tensor for a float64
        gradient, which the float32 workspace cannot hold)."""
        if grad.dtype not in _NARROW:
            return torch.mul(grad, root)
        return torch.mul(grad, root, out=self._workspace(grad))

    def sq_norm(self, grad: torch.Tensor, root: torch.Tensor | None) -> torch.Tensor:
        """``|grad * root|^2`` (``|grad|^2`` without a root), as a float32 scalar tensor."""
        source = grad if root is None else self._preconditioned(grad, root)
        return _norm32(source).square()

    def _grad(self, index: int) -> torch.Tensor:
        grad = self._grad_of(self._params[index])
        assert grad is not None, "callers pass only the indices of parameters that have a gradient"
        return grad

    def _roots(self) -> Sequence[torch.Tensor | None]:
        if self.precondition_active():
            assert self._preconditioner is not None  # precondition_active() checked it
            return self._preconditioner.roots
        return [None] * len(self._params)

    def _by_group(self, indices: Sequence[int], values: Sequence[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(self._num_groups, dtype=torch.float32, device=self.device)
        if indices:
            groups = self.group_index[list(indices)]
            out.index_add_(0, groups, torch.stack([v.to(self.device) for v in values]))
        return out

    def group_sq(self, indices: Sequence[int]) -> torch.Tensor:
        """Per-group squared norms of the (preconditioned) gradients of ``indices``."""
        roots = self._roots()
        plain = [i for i in indices if roots[i] is None and self._grad(i).dtype in _NARROW]
        values = []
        if plain:
            norms = torch_internals.foreach_norm([self._grad(i) for i in plain], 2, dtype=torch.float32)
            values += [norm.square() for norm in norms]
        narrow = set(plain)
        rest = [i for i in indices if i not in narrow]  # preconditioned, or float64
        values += [self.sq_norm(self._grad(i), roots[i]) for i in rest]
        return self._by_group(plain + rest, values)

    def differenced(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``|g_t|^2``, ``|g_{t-1}|^2`` and ``g_{t-1} . g_t`` per group.

        The previous gradient is kept raw and preconditioned here with the
        *current* preconditioner, so both partners are measured in the same
        geometry even across a refresh.
        """
        roots = self._roots()
        cur, prev, cross = [], [], []
        for i in indices:
            saved, root = self._prev_grads[i], roots[i]
            grad = self._grad(i)
            if root is not None:
                saved.mul_(root)
                grad = self._preconditioned(grad, root)
            cur.append(_norm32(grad).square())
            prev.append(torch.linalg.vector_norm(saved).square())
            cross.append(torch.dot(grad.reshape(-1).float(), saved.reshape(-1)))
        return self._by_group(indices, cur), self._by_group(indices, prev), self._by_group(indices, cross)

    def store(self, indices: Sequence[int]) -> None:
        """Keep this step's raw gradients as the next step's partner."""
        for i in indices:
            grad = self._grad(i)
            saved = self._prev_grads.get(i)
            if saved is None or saved.shape != grad.shape or saved.device != grad.device:
                saved = self._prev_grads[i] = torch.empty_like(grad, dtype=torch.float32)
            saved.copy_(grad)
