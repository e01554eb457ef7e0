"""AdaptiveDataParallel: DistributedDataParallel whose training state survives restarts.

The model, optimizer, LR scheduler and AMP grad scaler are checkpointed
together with the loaders, epochs and accumulators, and restored when the
wrapper is created after a restart (guarantee G3).  It accepts every
argument ``DistributedDataParallel`` does.

It also measures the gradient noise scale (``model.gns``, see
:mod:`adaptive.batchsize.gns`) and scales the learning rate at every optimizer step by
a scaling rule (``model.scaling_rule``, see :mod:`adaptive.batchsize.scaling_rules`),
so that the loader can change the batch size while training.  When the
loader runs gradient accumulation, the wrapper makes the ordinary loop do
the right thing: on every micro-step but the last, the backward pass skips
the all-reduce and ``optimizer.step()`` does nothing; ``zero_grad()`` acts
only on the first micro-step of each optimizer step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from adaptive._utils import torch_internals
from adaptive._utils.types import StateDict
from adaptive.checkpoint import states
from adaptive.checkpoint.store import CheckpointError
from adaptive.runtime import collectives, env, loss_watch, membership, peer_failure
from adaptive.runtime.errors import CollectiveError
from adaptive.runtime import step as step_records
from adaptive.parallel import _training

__all__ = ["AdaptiveDataParallel"]

logger = logging.getLogger(__name__)


class _AdaptiveDataParallelState(states.State):
    """Model, optimizer, LR scheduler, grad scaler and gradient statistics, saved as one unit by rank 0."""

    def __init__(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 parts: _training.TrainingParts) -> None:
        super().__init__(name)
        self.model = model
        self.optimizer = optimizer
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                **self.parts.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "model" not in state:
            raise CheckpointError(f"state {self.name!r} in the checkpoint was saved by AdaptiveFSDP (sharded), not "
                                  "AdaptiveDataParallel; resume it with the wrapper that saved it, or give this "
                                  "model another name=")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.parts.load_state_dict(state)

    def restore_on_admission(self) -> None:
        """A live candidate admitted: restored as at creation; when the candidates formed the generation from
        disk (every member of the one asked was lost), they all call this, and start from rank 0's weights.

        With no checkpoint yet each built its model with its own random init, on its group of one, where
        DDP's broadcast from rank 0 at construction did nothing (collective on the new generation then).
        """
        super().restore_on_admission()
        if not membership.membership().took_state_from_peers:
            with torch.no_grad():
                broadcast_from_rank0([*self.model.parameters(), *self.model.buffers()],
                                     torch.distributed.group.WORLD, "the weights of the generation formed from disk")

    def live_copy(self) -> StateDict:
        return self.parts.live_copy()  # the weights and optimizer state: equal on every member (step commit)

    def restore_live_copy(self, saved: object) -> None:
        self.parts.restore_live_copy(saved)


def broadcast_from_rank0(tensors: list[torch.Tensor], group: torch.distributed.ProcessGroup | None,
                         what: str) -> None:
    """Copy rank 0's ``tensors`` into every member's, one flat broadcast per dtype and device (in the same order
    on every member), each waited for by :func:`adaptive.runtime.collectives.wait`; call under ``no_grad``."""
    for kind in sorted({(tensor.dtype, tensor.device) for tensor in tensors}, key=str):
        same = [tensor for tensor in tensors if (tensor.dtype, tensor.device) == kind]
        flat = torch.cat([tensor.reshape(-1) for tensor in same])
        work = torch.distributed.broadcast(flat, group_src=0, group=group, async_op=True)
        collectives.wait(work, what)
        for tensor, value in zip(same, flat.split([tensor.numel() for tensor in same])):
            tensor.copy_(value.view_as(tensor))


class AdaptiveDataParallel(_training.TrainedModel, DistributedDataParallel):
    """``DistributedDataParallel`` plus checkpointing of the whole training state.

    Args:
        module: the model, as for DDP.
        optimizer: its optimizer.
        lr_scheduler: an LR scheduler stepping that optimizer, if any.
        scaler: a ``torch.amp.GradScaler``, if AMP is used.
        scaling_rule: how the learning rate follows the batch size:
            ``"adascale"``, ``"adamscale"`` (square-root AdaScale for Adam),
            ``"linear"``, ``"sqrt"``, ``"none"``, or a
            :class:`~adaptive.batchsize.scaling_rules.ScalingRule` such as
            ``LEGW(base_warmup_steps=...)``; default chosen from
            the optimizer (AdamScale for Adam-type, AdaScale otherwise).
        name: checkpoint name; give distinct names when a job trains
            several models.
        gns_interval: when to measure the gradient noise: ``"auto"``
            (the default) as often as keeps the measurement within 1% of
            the training time (every step where it is cheap, as for large
            batches on GPUs; up to every 32nd), or every this many
            optimizer steps (an int >= 1).  A measured step reads the
            gradients about twice more (their norms before and after the
            all-reduce), which shows on CPUs and for small models; the
            noise scale changes slowly, so every few steps is enough (the
            moving averages weigh each measurement for the steps since
            the last one).
        **kwargs: passed to ``DistributedDataParallel`` (``device_ids``,
            ``find_unused_parameters``, ``bucket_cap_mb``, ...).
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any = None, scaler: Any = None, *, scaling_rule: Any = None,
                 name: str = "model", gns_interval: int | str = "auto", **kwargs: Any) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        _training.check_optimizer(optimizer, list(module.parameters()))
        _training.check_lr_scheduler(lr_scheduler, optimizer)
        _training.check_scaler(scaler)
        _training.check_name(name)
        _training.check_gns_interval(gns_interval)
        if not collectives.is_initialized():
            if env.num_replicas() > 1:
                raise RuntimeError("call adaptive.init_process_group(backend) before AdaptiveDataParallel")
            collectives.init_process_group("nccl" if next(module.parameters()).is_cuda else "gloo")
        super().__init__(module, **kwargs)  # a live joiner builds it on its group of one; it rebinds when admitted
        if membership.is_live():  # a lost peer fails the step's reduction, not the backward pass
            self.register_comm_hook(None, _allreduce_or_record_fault)
        self._replicas = torch.distributed.get_world_size(self.process_group)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self._make_gns_and_rule(optimizer, scaler, scaling_rule, gns_interval)
        self.gns.attach(self, is_last_micro_step=lambda: not _training.is_accumulation_step())
        self.step_lr = _training.wire_optimizer(optimizer, self.scaling_rule, self.gns)
        parts = _training.TrainingParts(optimizer, lr_scheduler, scaler, self.gns, self.scaling_rule)
        self._state = _AdaptiveDataParallelState(f"adaptive.parallel.{name}", self.module, optimizer, parts)
        self._register_with_job()
        _training.follow_regroups(self)
        if states.load_state(self._state) and env.rank() == 0:
            logger.info("restored model, optimizer%s%s from the checkpoint",
                        ", LR scheduler" if lr_scheduler is not None else "",
                        ", grad scaler" if scaler is not None else "")

    def _follow_regroup(self) -> None:
        """Live mode: the job's process group was rebuilt; reduce over the new one from the next step.

        The reducer is bound to its group, so it is built again the way DDP
        builds it when unpickled (over the new default group); communication
        hooks registered earlier are registered again on the new reducer.
        (DDP's private calls: :mod:`adaptive._utils.torch_internals`.)
        """
        world = torch.distributed.group.WORLD  # the default group
        if world is None:
            raise ValueError("Default process group has not been initialized, "
                             "please make sure to call init_process_group.")
        self.process_group = world
        self._replicas = torch.distributed.get_world_size(self.process_group)
        parameters, expect_sparse_gradient = torch_internals.ddp_params_for_reducer(self)
        torch_internals.ddp_init_reducer(self, parameters, expect_sparse_gradient,
                                         torch_internals.ddp_param_names(self, parameters))
        if self.static_graph:
            torch_internals.reducer_set_static_graph(self.reducer)
        for hook, state in torch_internals.ddp_comm_hooks(self):
            torch_internals.register_reducer_comm_hook(self.reducer, state, hook)
        # As in a joiner's new wrapper, the first forward syncs the buffers (after steps with one replica,
        # which synchronise nothing, DDP would skip it here: the members would disagree on collectives).
        self.require_forward_param_sync = True
        self.gns.follow_group(self.process_group, self._replicas)
        self._configured_for = None  # the noise scale is configured afresh at the next forward (steps may repeat)

    def _sync_buffers(self) -> None:
        """DDP's broadcast of the buffers before a forward; in live mode a lost peer is recorded, not raised."""
        if step_records.faulted():
            return
        try:
            if membership.is_live() and not hasattr(self, "buffer_hook"):
                self._broadcast_buffers()
            else:
                torch_internals.ddp_sync_buffers(self)  # DDP's own (the method this one overrides)
        except (RuntimeError, torch.distributed.DistError) as error:
            if not peer_failure.absorb_in_live_mode(error):
                raise

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers on every member, as DDP broadcasts them, but waited for by
        :func:`adaptive.runtime.collectives.wait` (a lost peer another member reported ends the wait)."""
        with torch.no_grad():
            torch_internals.ddp_assign_modules_buffers(self)
            buffers = list(self.modules_buffers)
            with torch_internals.preserve_version_counter(buffers):
                broadcast_from_rank0(buffers, self.process_group, "the buffer broadcast")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Exactly what ``no_sync()`` does, decided per micro-step by the step the loader published.
        # With one replica there is nothing to reduce: DDP's bucket copies are skipped altogether.
        step = self._follow_step()
        self.require_backward_grad_sync = self._replicas > 1 and (step is None or not step.is_accumulation_step)
        return super().forward(*inputs, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, except in the middle of an accumulation."""
        if not _training.is_continuing_accumulation():
            super().zero_grad(set_to_none=set_to_none)


def _allreduce_or_record_fault(state: object, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's averaging all-reduce of a gradient bucket (live mode), which survives a lost peer.

    When the all-reduce fails (a member died), or another member reports a
    lost peer before it completes (:mod:`adaptive.runtime.loss_watch`), the
    failure is recorded on the step (:func:`adaptive.runtime.step.record_fault`)
    and the bucket keeps its local gradients: the backward pass ends normally, the optimizer step
    is skipped and the step is discarded at the next boundary, where the
    members that are left re-form (:func:`adaptive.elastic.live.recover`).
    """
    tensor = bucket.buffer()
    if step_records.faulted():
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done
    group = torch.distributed.group.WORLD
    tensor.div_(torch.distributed.get_world_size(group))
    reduced = torch.distributed.all_reduce(tensor, group=group, async_op=True).get_future()
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def finish(future: torch.futures.Future[list[torch.Tensor]]) -> None:
        try:
            value = future.value()[0]
        except Exception as error:  # the backend's error for a lost peer
            step_records.record_fault(error)
            value = tensor
        loss_watch.complete_once(result, value)

    def given_up() -> torch.Tensor:  # another member reported the loss: this all-reduce will not complete
        step_records.record_fault(CollectiveError("a gradient all-reduce given up: another member reported a "
                                                  "lost peer"))
        return tensor

    loss_watch.release_on_loss(result, given_up)
    reduced.add_done_callback(finish)
    return result


# DDP checks a hook's annotations as objects; this module's are strings (``from __future__ import annotations``).
_allreduce_or_record_fault.__annotations__.update(
    {"bucket": torch.distributed.GradBucket, "return": torch.futures.Future[torch.Tensor]})
