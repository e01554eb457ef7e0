"""AdaptiveFSDP: FSDP2 (``fully_shard``) whose training state survives restarts and rescales.

The sharded counterpart of :class:`~adaptive.AdaptiveDataParallel`, for
models that do not fit on one device, or whose optimizer state does not.
The ordinary loop is the same::

    model = adaptive.AdaptiveFSDP(model, optimizer, lr_scheduler)
    for epoch in adaptive.remaining_epochs_until(epochs):
        for batch in loader:
            loss = loss_fn(model(batch.x), batch.y)
            loss.backward(); optimizer.step(); optimizer.zero_grad()

What it does, on top of ``fully_shard``:

* **Sharding.** It applies ``fully_shard`` to each transformer block (each
  element of every ``nn.ModuleList``; ``shard=`` picks others) and then to
  the root, on a 1-D mesh over all replicas or a 2-D HSDP mesh
  (:func:`~adaptive.parallel.sharding_mesh`).  A module on which the user
  already called ``fully_shard`` is taken as it is.  An optimizer built on
  the unsharded model is pointed at the sharded parameters.
* **Checkpoints** (guarantee G3) go through ``torch.distributed.checkpoint``:
  every replica writes only its own shards of the model and optimizer
  state (FQN-keyed, from ``get_state_dict``), rank 0 the small rest (LR
  scheduler, grad scaler, noise-scale and scaling-rule state); a restart
  on another number of replicas or another mesh reshards on load
  (:class:`~adaptive.checkpoint.states.ShardedState`).
* **Accumulation.** On every micro-step but the last, FSDP2's gradient
  reduction is switched off (``set_requires_gradient_sync(False)``), so
  gradients are reduce-scattered once per optimizer step; ``optimizer.step()``
  does nothing and ``zero_grad()`` acts only on the first micro-step.
* **Models built on the meta device.** Wrap the meta model, then
  ``to_empty(device=...)`` and initialise it: the checkpoint is restored
  over that initialisation at the first forward (docs/sharding.md).
* **Gradient noise scale** (``model.gns``) measured from the unsharded
  local gradients FSDP2 already holds and the sharded reduced ones (see
  :mod:`adaptive.batchsize.gns._sharded`), and the LR scaling rule
  (``model.scaling_rule``), so the loader's adaptive batch sizes, token
  budgets and ramp-up work as with DDP.
* **Live membership changes** (``adaptive-run --live``).  At a join or a
  leave the model is gathered whole on the next rank 0, sharded anew on a
  mesh for the new members (:func:`~adaptive.parallel._sharding.sharding_mesh_like`)
  from a storage-free copy of the unsharded model kept for that purpose,
  and filled from rank 0's copy (:mod:`adaptive.checkpoint.peer_shards`);
  the optimizer moves to the new parameters.  ``model.module`` is then a
  new module: hold the wrapper, not the module inside it.  After a lost
  member the others join a whole copy from their snapshots of their shards
  and shard it anew the same way (HSDP: every replica group holds every
  shard); when the lost members held every copy of a shard (1-D FSDP),
  every member restarts from the checkpoint (:mod:`adaptive.elastic.live`).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Callable, Mapping, cast

import torch
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from adaptive._utils.types import StateDict
from adaptive.batchsize.scaling_rules import ScalingRule
from adaptive.checkpoint import peer_shards, states
from adaptive.checkpoint.store import CheckpointError
from adaptive.runtime import collectives, env, fault_tolerant_group, membership
from adaptive.parallel import _sharding, _training

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only (the library runs on 3.10)

    from torch.optim.lr_scheduler import LRScheduler

__all__ = ["AdaptiveFSDP"]

logger = logging.getLogger(__name__)


class _FullyShardedState(states.ShardedState):
    """Model and optimizer as DCP shards; LR scheduler, grad scaler and gradient statistics as one small part."""

    def __init__(self, name: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 parts: _training.TrainingParts, before_save: Callable[[], None],
                 reshard: Callable[[], torch.nn.Module], admitted: Callable[[], None]) -> None:
        super().__init__(name)
        self.module = module
        self.optimizer = optimizer
        self.parts = parts
        self._before_save = before_save
        self._reshard = reshard
        self._admitted = admitted
        self._saved_optimizer = False

    def state_dict(self) -> StateDict:
        self._before_save()
        # An optimizer that has not stepped has no state to save; get_state_dict would create it
        # (with a step of lr 0), which would change what an uninterrupted run does.
        return {"kind": "fully_sharded", "optimizer_started": bool(self.optimizer.state), **self.parts.state_dict()}

    def sharded_state_dict(self) -> StateDict:
        self._before_save()
        # What this returns is what a live change loads back (gathered, or copied after a loss): with the optimizer
        # exactly when it has stepped.
        self._saved_optimizer = bool(self.optimizer.state)
        if not self.optimizer.state:
            return {"model": get_model_state_dict(self.module)}
        model, optimizer = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: StateDict) -> None:
        if state.get("kind") != "fully_sharded":
            raise CheckpointError(f"state {self.name!r} in the checkpoint was saved by AdaptiveDataParallel, not "
                                  "AdaptiveFSDP; resume it with the wrapper that saved it, or give the sharded "
                                  "model another name=")
        self._saved_optimizer = bool(state["optimizer_started"])
        self.parts.load_state_dict(state)

    def live_copy(self) -> StateDict:
        return self.parts.live_copy()  # the shards: as the last committed step left them (step commit)

    def restore_live_copy(self, saved: object) -> None:
        self.parts.restore_live_copy(saved)

    def load_sharded_state_dict(self, read: Callable[[StateDict], StateDict]) -> None:
        """Read the shards this replica needs now (DCP reshards to the current mesh) and apply them."""
        if not self._saved_optimizer:
            loaded = read({"model": get_model_state_dict(self.module)})
            set_model_state_dict(self.module, loaded["model"])
            self.optimizer.state.clear()  # back to before the first step (after a lost member, in live mode)
            return
        model, optimizer = get_state_dict(self.module, self.optimizer)  # targets, sharded as the model is now
        loaded = read({"model": model, "optimizer": optimizer})
        set_state_dict(self.module, self.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optimizer"])

    def gather_for_peers(self, dst: int) -> StateDict | None:
        return peer_shards.gather_full(self.sharded_state_dict(), dst)

    def reshard_for_peers(self, gathered: StateDict | None) -> None:
        self.module = self._reshard()
        self.load_sharded_state_dict(lambda target: peer_shards.fill_from_rank0(target, gathered))

    def restore_on_admission(self) -> None:
        """A live joiner, admitted after it sharded its model on its group of one: the wrapper shards it anew
        for the generation joined and fills it from rank 0, while the members reshard theirs (collective)."""
        self._admitted()


def _check_fsdp_options(options: Mapping[str, object]) -> None:
    if "offload_policy" in options:
        raise ValueError("offload_policy (CPU offloading) is not supported by AdaptiveFSDP: measuring the "
                         "gradient noise on host-resident gradients would synchronise per parameter")
    unknown = sorted(set(options) - set(_sharding.FSDP_OPTIONS))
    if unknown:
        raise TypeError(f"AdaptiveFSDP got unexpected keyword argument(s) {', '.join(unknown)}; it passes only "
                        f"{', '.join(_sharding.FSDP_OPTIONS)} on to fully_shard")


class AdaptiveFSDP(_training.TrainedModel, torch.nn.Module):
    """FSDP2 sharding plus checkpointing of the whole training state, resharded on every rescale.

    Args:
        module: the model.  Either plain (it is sharded here, see ``shard``)
            or one on which ``torch.distributed.fsdp.fully_shard`` was
            already called (then ``mesh``, ``shard`` and the FSDP options
            must be left at their defaults).
        optimizer: its optimizer, built from ``module.parameters()``
            before or after sharding (before: it must not have stepped;
            it is pointed at the sharded parameters).
        lr_scheduler: an LR scheduler stepping that optimizer, if any.
        scaler: a ``torch.amp.GradScaler``, if float16 AMP is used
            (bfloat16 needs none).
        mesh: the device mesh: 1-D (FSDP) or 2-D ``(replicate, shard)``
            (HSDP); default :func:`~adaptive.parallel.sharding_mesh` ``()``,
            one dimension over all replicas.
        shard: which submodules get their own ``fully_shard`` (each is
            gathered just before its forward and freed after): ``"blocks"``
            (default: each element of every ``nn.ModuleList``),
            ``"root"`` (the whole model as one unit), a module class or
            tuple of classes, or a callable ``(name, module) -> bool``.
        scaling_rule: how the learning rate follows the batch size, as for
            :class:`~adaptive.AdaptiveDataParallel`.
        name: checkpoint name; give distinct names when a job trains
            several models.
        gns_interval: when to measure the gradient noise, as for
            :class:`~adaptive.AdaptiveDataParallel` (default ``"auto"``).
        **fsdp_options: passed to every ``fully_shard`` call:
            ``reshard_after_forward``, ``mp_policy`` (a
            ``MixedPrecisionPolicy``).  CPU offloading is not supported.

    Raises:
        TypeError, ValueError: an argument it cannot honour (the message
            names it and what is allowed).
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: LRScheduler | None = None, scaler: torch.amp.GradScaler | None = None, *,
                 mesh: DeviceMesh | None = None, shard: _sharding.ShardPolicy = "blocks",
                 scaling_rule: str | ScalingRule | None = None, name: str = "model",
                 gns_interval: int | str = "auto", **fsdp_options: Unpack[_sharding.FSDPOptions]) -> None:
        _check_module(module)
        _check_fsdp_options(fsdp_options)
        _training.check_optimizer(optimizer, list(module.parameters()))
        _training.check_lr_scheduler(lr_scheduler, optimizer)
        _training.check_scaler(scaler)
        _training.check_name(name)
        _training.check_gns_interval(gns_interval)
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got "
                            f"{type(mesh).__name__}")
        if mesh is not None and mesh.ndim not in (1, 2):
            raise ValueError(f"mesh must have 1 dimension (FSDP) or 2 (replicate, shard: HSDP), got {mesh.ndim}")
        _ensure_process_group(module)
        super().__init__()
        self._blueprint = _live_blueprint(module)
        self._sharding = (shard, fsdp_options.copy())
        self.module = _shard(module, optimizer, _live_mesh(mesh), shard, fsdp_options)
        self.mesh = _sharding.module_mesh(self.module)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self._gradient_sync = True
        self._make_gns_and_rule(optimizer, scaler, scaling_rule, gns_interval)
        self.gns.attach(self.module, is_last_micro_step=_is_last_micro_step)
        parts = _training.TrainingParts(optimizer, lr_scheduler, scaler, self.gns, self.scaling_rule)
        self._state = _FullyShardedState(f"adaptive.parallel.{name}", self.module, optimizer, parts,
                                         before_save=self._materialize, reshard=self._reshard,
                                         admitted=self._restore_on_admission)
        self._on_meta = _on_meta_device(self.module)
        if not self._on_meta:
            self._restore_and_wire()
        else:
            logger.debug("the model is on the meta device: it is restored from the checkpoint, and its optimizer "
                         "wired, at its first forward, after to_empty() and your initialisation")
        self._register_with_job()

    def _restore_and_wire(self) -> None:
        """Restore model, optimizer and the rest from the checkpoint, then install the optimizer's step hooks.

        Restore before the step hooks exist: creating a fresh optimizer's state for the load
        (get_state_dict) runs one optimizer step with learning rate 0.  A live joiner not admitted yet
        does both once admitted (:meth:`_restore_on_admission`).
        """
        if membership.is_awaiting_admission():
            return
        restored = states.load_state(self._state)
        self.step_lr = _training.wire_optimizer(self.optimizer, self.scaling_rule, self.gns)
        if restored and env.rank() == 0:
            logger.info("restored the sharded model and optimizer%s%s from the checkpoint (%d replicas, mesh %s)",
                        ", LR scheduler" if self.lr_scheduler is not None else "",
                        ", grad scaler" if self.scaler is not None else "", env.num_replicas(),
                        tuple(self.mesh.shape))

    def _reshard(self) -> torch.nn.Module:
        """A live membership change: shard a fresh copy of the model for the new members; returns it.

        Its values are filled by the caller (from the next rank 0's full
        copy); the buffers, which FSDP does not shard, are copied over, so
        non-persistent ones keep their values.
        """
        started = time.perf_counter()
        assert self._blueprint is not None, "live mode keeps the unsharded model's layout"
        old = self.module
        mesh = _sharding.sharding_mesh_like(self.mesh)
        new = _sharding.meta_copy(self._blueprint)
        _sharding.apply_fully_shard(new, mesh, *self._sharding)
        new.to_empty(device=next(old.parameters()).device)
        buffers = dict(old.named_buffers())
        with torch.no_grad():
            for name, buffer in new.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
        _sharding.move_optimizer(self.optimizer, old, new)
        self.module, self.mesh, self._gradient_sync = new, mesh, True
        self._configured_for = None  # the loader configures the noise scale for the new replica count
        self.gns.reattach(new, is_last_micro_step=_is_last_micro_step)
        logger.debug("sharded the model anew on mesh %s in %.3f s", tuple(mesh.shape), time.perf_counter() - started)
        return new

    def _materialize(self) -> None:
        """A model built on the meta device: once ``to_empty`` gave it storage, restore it (once)."""
        if not self._on_meta:
            return
        self._check_materialized("the first forward")
        self._on_meta = False
        self._restore_and_wire()

    def _check_materialized(self, when: str) -> None:
        if _on_meta_device(self.module):
            raise RuntimeError(
                "the model is still on the meta device: after AdaptiveFSDP(model, optimizer), call "
                f"model.to_empty(device=...) and initialise the parameters (reset_parameters() or your init) "
                f"before {when}; AdaptiveFSDP then restores the checkpoint over that initialisation "
                "(see docs/sharding.md, 'Models built on the meta device')")

    def _restore_on_admission(self) -> None:
        """Live mode: this process was admitted into a running job after it built this wrapper on its group of
        one.  Shard the model anew for the generation it joined, take the shards from the next rank 0 (the
        members reshard theirs meanwhile, in the same order), then wire the optimizer."""
        self._check_materialized("its first training loop (where a process joining a live job is admitted)")
        self._on_meta = False
        self._state.module = self._reshard()
        self._restore_and_wire()

    def forward(self, *inputs: object, **kwargs: object) -> object:
        self._materialize()
        step = self._follow_step()
        # Reduce-scatter only on the last micro-step of an optimizer step (FSDP2's no_sync).
        sync = step is None or not step.is_accumulation_step
        if sync != self._gradient_sync:
            # _shard returned the root fully_shard was called on: an FSDPModule (a Module to the type checker).
            cast(FSDPModule, self.module).set_requires_gradient_sync(sync)
            self._gradient_sync = sync
        return self.module(*inputs, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, except in the middle of an accumulation."""
        if not _training.is_continuing_accumulation():
            self.module.zero_grad(set_to_none=set_to_none)


def _is_last_micro_step() -> bool:
    return not _training.is_accumulation_step()


def _live_blueprint(module: torch.nn.Module) -> torch.nn.Module | None:
    """In live mode, a storage-free copy of the unsharded model, sharded anew at each membership change."""
    if not membership.is_live():
        return None
    if _sharding.is_fully_sharded(module):
        raise ValueError("in live mode (adaptive-run --live) pass AdaptiveFSDP the unsharded model: it shards it "
                         "and shards it again for each new membership, which it cannot do for a module on which "
                         "fully_shard was already called")
    return _sharding.meta_copy(module)


def _live_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """``mesh``, or in live mode one of its kind for the generation this process is in (a joiner not admitted
    yet: its group of one; it shards anew for the generation it joins once admitted)."""
    if not membership.is_live():
        return mesh
    if mesh is None:
        return mesh
    if mesh.size() != env.num_replicas():
        logger.info("the mesh given has %d replicas but the live generation has %d: sharding on a mesh of its kind "
                    "for them", mesh.size(), env.num_replicas())
        return _sharding.sharding_mesh_like(mesh)
    if fault_tolerant_group.applies(mesh.device_type) and not _sharding.is_fault_tolerant(mesh):
        logger.info("the mesh given was not built by adaptive.parallel.sharding_mesh(): sharding on one of its "
                    "kind whose groups let the members that are left go on in memory when one is lost")
        return _sharding.sharding_mesh_like(mesh)
    return mesh


def _check_module(module: object) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, (torch.nn.parallel.DistributedDataParallel, AdaptiveFSDP)):
        raise TypeError(f"module must be the model itself, not a {type(module).__name__}: pass the unwrapped "
                        "module (AdaptiveFSDP shards it)")
    if not any(param.requires_grad for param in module.parameters()):
        raise ValueError("module has no trainable parameters")


def _on_meta_device(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is still on the meta device (built without storage)."""
    return any(tensor.is_meta for tensor in itertools.chain(module.parameters(), module.buffers()))


def _ensure_process_group(module: torch.nn.Module) -> None:
    if collectives.is_initialized():
        return
    if env.num_replicas() > 1:
        raise RuntimeError("call adaptive.init_process_group(backend) before AdaptiveFSDP")
    first = next(module.parameters())
    collectives.init_process_group("nccl" if first.is_cuda or (first.is_meta and torch.cuda.is_available())
                                   else "gloo")


def _shard(module: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh | None,
           shard: _sharding.ShardPolicy, options: _sharding.FSDPOptions) -> torch.nn.Module:
    """``module`` sharded (or as given, if already sharded), with ``optimizer`` on its sharded parameters."""
    if _sharding.is_fully_sharded(module):
        if mesh is not None or shard != "blocks" or options:
            raise ValueError("module is already fully sharded (fully_shard was called on it): leave mesh, "
                             "shard and the fully_shard options at their defaults, or pass the unsharded model")
        return module
    _sharding.check_rebindable(optimizer)  # before sharding changes the module
    names = _sharding.parameter_names(module)
    _sharding.apply_fully_shard(module, mesh if mesh is not None else _sharding.sharding_mesh(), shard, options)
    _sharding.rebind_optimizer(optimizer, names, module)
    return module
