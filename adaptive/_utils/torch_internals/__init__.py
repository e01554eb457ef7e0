"""Every private torch call the library makes, in one place (not public API).

torch offers no public way to do a few things the library needs: rebuild
DDP's reducer on a new process group, wrap a finished future as a ``Work``,
read what FSDP2 holds, run multi-tensor kernels, and a few more.  Each such
use is one small function (or name) in this package, whose docstring says
what it does, why no public API suffices, and since which torch version it
exists; this module re-exports them all, so callers import them from
``adaptive._utils.torch_internals`` only.  Every module of ``adaptive``
outside this package goes through these (tests/test_torch_internals.py
checks that no other module names a private torch attribute, and that each
one used here exists on the installed torch).

The package, by concept:

* this module: the version check, the registry of private names
  (:data:`PRIVATE_NAMES`) and the re-exports;
* ``_ddp``: DistributedDataParallel and its reducer (rebuilt on a new
  group), its buffer sync and the version-counter guard its broadcast needs;
* ``_autograd``: the end-of-backward callback, the ``torch._foreach_*``
  kernels and the grad scaler's device scale (the gradient noise scale);
* ``_c10d``: process groups (a ``Work`` from a future, gloo's private
  collective names, ``ProcessGroup``'s overridden methods);
* ``_fsdp``: FSDP2's state and parameters, and DTensor;
* ``_dcp``: distributed checkpoint's private pickle names;
* ``_elastic``: torchrun's elastic agent (ended, not restarted, at a worker's
  usage error).

Checked against the torch versions in :data:`CHECKED_TORCH_VERSIONS` (the
one ``requirements.txt`` pins and the tests run on), a subset of what
``setup.py`` accepts (:data:`SUPPORTED_TORCH_RANGE`).  On another version the
library still imports and runs (nothing is refused), but a warning is
logged once at import: :func:`check_torch_version` raises, and
tests/test_torch_internals.py fails, with the versions found and checked.
Each docstring says since when torch has the call as far as known ("in
torch since 1.x", "since 2.4"; only "checked" where the first version is not
known here), and on which version it was checked.

Public APIs that now suffice (torch 2.13), so the private call was dropped
from the caller rather than moved here:

* ``torch.distributed.distributed_c10d._get_default_group()`` (the default
  group to rebuild DDP on): ``torch.distributed.group.WORLD``, the same
  object once the group is initialised.
* ``torch.distributed.Backend._plugins`` (whether a backend is registered):
  ``torch.distributed.Backend.backend_list``, which ``register_backend``
  extends in the same call.
* ``torch.distributed.fsdp.FSDPModule`` (public since 2.6) and
  ``torch.distributed.tensor.DTensor`` (public since 2.5) are imported from
  their public homes; only older versions fall back to the private modules
  (:func:`fsdp_module_class`, :func:`dtensor_class`).
* ``GroupName`` is public in ``torch.distributed.distributed_c10d``
  (listed in its ``__all__``), so it is imported from there directly.

Not here: the live warm server imports the module ``torch._dynamo`` by name
(to pay its import once per node); it calls nothing in it.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from adaptive._utils.torch_internals._autograd import (
    foreach_div_, foreach_norm, grad_scaler_scale, queue_autograd_callback,
)
from adaptive._utils.torch_internals._c10d import (
    GLOO_ALLGATHER_BASE, GLOO_NAMES_OF_PUBLIC_COLLECTIVES, GLOO_PRIVATE_COLLECTIVES, GLOO_REDUCE_SCATTER_BASE,
    PROCESS_GROUP_OVERRIDDEN_METHODS, work_from_future,
)
from adaptive._utils.torch_internals._dcp import dcp_metadata_private_globals, dcp_storage_info_class
from adaptive._utils.torch_internals._elastic import ELASTIC_AGENT_OVERRIDDEN_METHODS, end_elastic_agent_on_exit_code
from adaptive._utils.torch_internals._ddp import (
    DDP_OVERRIDDEN_METHODS, ddp_assign_modules_buffers, ddp_comm_hooks, ddp_init_reducer, ddp_param_names,
    ddp_params_for_reducer, ddp_sync_buffers, preserve_version_counter, reducer_set_static_graph,
    register_reducer_comm_hook,
)
from adaptive._utils.torch_internals._fsdp import (
    clear_dtensor_native_sharding_cache, clear_dtensor_python_sharding_cache, dtensor_class, dtensor_like,
    dtensor_local_tensor, fsdp_is_root, fsdp_module_class, fsdp_param_groups, fsdp_param_orig_size, fsdp_state,
    fsdp_unsharded_param,
)

if TYPE_CHECKING:  # the torch types callers annotate with (adaptive.batchsize.gns._sharded, adaptive.checkpoint)
    from adaptive._utils.torch_internals._dcp import DcpStorageInfo as DcpStorageInfo
    from adaptive._utils.torch_internals._fsdp import FSDPParam as FSDPParam
    from adaptive._utils.torch_internals._fsdp import FSDPParamGroup as FSDPParamGroup

__all__ = [
    "CHECKED_TORCH_VERSIONS", "SUPPORTED_TORCH_RANGE", "PrivateName", "PRIVATE_NAMES", "UncheckedTorchVersion",
    "unchecked_torch_message", "check_torch_version", "warn_if_unchecked_torch",
    "ddp_params_for_reducer", "ddp_param_names", "ddp_init_reducer", "ddp_comm_hooks", "ddp_assign_modules_buffers",
    "ddp_sync_buffers", "DDP_OVERRIDDEN_METHODS", "reducer_set_static_graph", "register_reducer_comm_hook",
    "preserve_version_counter", "queue_autograd_callback", "foreach_norm", "foreach_div_", "grad_scaler_scale",
    "work_from_future", "GLOO_ALLGATHER_BASE", "GLOO_REDUCE_SCATTER_BASE", "GLOO_PRIVATE_COLLECTIVES",
    "GLOO_NAMES_OF_PUBLIC_COLLECTIVES", "PROCESS_GROUP_OVERRIDDEN_METHODS", "fsdp_module_class", "fsdp_state",
    "fsdp_param_groups", "fsdp_is_root", "fsdp_param_orig_size", "fsdp_unsharded_param", "dtensor_class",
    "dtensor_local_tensor", "dtensor_like",
    "clear_dtensor_python_sharding_cache", "clear_dtensor_native_sharding_cache", "dcp_storage_info_class",
    "dcp_metadata_private_globals", "end_elastic_agent_on_exit_code", "ELASTIC_AGENT_OVERRIDDEN_METHODS",
]

logger = logging.getLogger(__name__)

#: The torch minor versions every entry here was checked against (requirements.txt's pin; the tests run on it).
CHECKED_TORCH_VERSIONS: tuple[str, ...] = ("2.13",)

#: What setup.py accepts (``install_requires``); the checked versions lie inside it.
SUPPORTED_TORCH_RANGE = ">=2.4,<2.15"


# ------------------------------------------------------------------ the version check


class UncheckedTorchVersion(RuntimeError):
    """The installed torch is not one the private calls of this package were checked against."""


def _minor(version: str) -> str:
    """``"2.13.0+cpu"`` -> ``"2.13"`` (a pre-release ``"2.14.0a0+git..."`` -> ``"2.14"``)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return f"{found.group(1)}.{found.group(2)}" if found else version


def unchecked_torch_message(version: str | None = None) -> str | None:
    """Why ``version`` (default: the installed torch's) is not checked, or None when it is."""
    version = str(torch.__version__) if version is None else version
    if _minor(version) in CHECKED_TORCH_VERSIONS:
        return None
    return (f"torch {version} is installed, but the private torch calls of adaptive "
            f"(adaptive._utils.torch_internals) were checked only against torch "
            f"{', '.join(CHECKED_TORCH_VERSIONS)} (setup.py accepts torch{SUPPORTED_TORCH_RANGE}); "
            "they may have changed: run tests/test_torch_internals.py on this version, then add it to "
            "CHECKED_TORCH_VERSIONS")


def check_torch_version() -> None:
    """Raise :class:`UncheckedTorchVersion` (naming the versions found and checked) on an unchecked torch."""
    message = unchecked_torch_message()
    if message is not None:
        raise UncheckedTorchVersion(message)


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def warn_if_unchecked_torch() -> bool:
    """Log :func:`unchecked_torch_message` once per process (imports go on); whether torch is unchecked."""
    message = unchecked_torch_message()
    if message is not None:
        _warn_once(message)
    return message is not None


# ------------------------------------------------------------------ the registry the tests check


@dataclass(frozen=True)
class PrivateName:
    """One private torch attribute this package uses.

    Attributes:
        owner: import path of the module or class that holds it (for an
            attribute set on instances, the class of those instances).
        name: the attribute.
        entry_point: the name (defined in a module of this package, re-exported here) that uses it.
        on_instances: set on each instance, not on the class (the tests build one to check it).
        required: False where the entry point copes without it (a fallback
            for older torch, or an optional cache).
    """

    owner: str
    name: str
    entry_point: str
    on_instances: bool = False
    required: bool = True


_DDP = "torch.nn.parallel.DistributedDataParallel"
_FSDP_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState"
_FSDP_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam"
_DTENSOR = "torch.distributed.tensor.DTensor"
_ELASTIC_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent"

#: Every private torch name used here.  tests/test_torch_internals.py checks that each required one exists on
#: the installed torch, and that no module of ``adaptive`` outside this package names any of them.
PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(_DDP, "_build_params_for_reducer", "ddp_params_for_reducer"),
    PrivateName(_DDP, "_build_debug_param_to_name_mapping", "ddp_param_names"),
    PrivateName(_DDP, "_ddp_init_helper", "ddp_init_reducer"),
    PrivateName(_DDP, "_comm_hooks", "ddp_comm_hooks", on_instances=True),
    PrivateName(_DDP, "_assign_modules_buffers", "ddp_assign_modules_buffers"),
    PrivateName(_DDP, "_sync_buffers", "ddp_sync_buffers"),
    PrivateName("torch._C._distributed_c10d.Reducer", "_set_static_graph", "reducer_set_static_graph"),
    PrivateName("torch.distributed", "_register_comm_hook", "register_reducer_comm_hook"),
    PrivateName("torch.autograd", "_unsafe_preserve_version_counter", "preserve_version_counter"),
    PrivateName("torch.autograd.Variable", "_execution_engine", "queue_autograd_callback"),
    PrivateName("torch", "_foreach_norm", "foreach_norm"),
    PrivateName("torch", "_foreach_div_", "foreach_div_"),
    PrivateName("torch.amp.GradScaler", "_scale", "grad_scaler_scale", on_instances=True),
    PrivateName("torch._C._distributed_c10d", "_create_work_from_future", "work_from_future"),
    PrivateName("torch.distributed.ProcessGroupGloo", "_allgather_base", "GLOO_ALLGATHER_BASE"),
    PrivateName("torch.distributed.ProcessGroupGloo", "_reduce_scatter_base", "GLOO_REDUCE_SCATTER_BASE"),
    PrivateName("torch.distributed.ProcessGroup", "_set_group_name", "PROCESS_GROUP_OVERRIDDEN_METHODS"),
    PrivateName("torch.distributed.ProcessGroup", "_set_group_desc", "PROCESS_GROUP_OVERRIDDEN_METHODS"),
    PrivateName("torch.distributed._composable.fsdp", "FSDPModule", "fsdp_module_class", required=False),
    PrivateName("torch.distributed.fsdp.FSDPModule", "_get_fsdp_state", "fsdp_state"),
    PrivateName(_FSDP_STATE, "_fsdp_param_groups", "fsdp_param_groups", on_instances=True),
    PrivateName(_FSDP_STATE, "_fsdp_param_group", "fsdp_param_groups", on_instances=True, required=False),
    PrivateName(_FSDP_STATE, "_is_root", "fsdp_is_root", on_instances=True),
    PrivateName(_FSDP_PARAM, "_orig_size", "fsdp_param_orig_size", on_instances=True),
    PrivateName(_FSDP_PARAM, "_unsharded_param", "fsdp_unsharded_param", on_instances=True),
    PrivateName("torch.distributed._tensor", "DTensor", "dtensor_class", required=False),
    PrivateName(_DTENSOR, "_local_tensor", "dtensor_local_tensor"),
    PrivateName(_DTENSOR, "_spec", "dtensor_like"),
    PrivateName(_DTENSOR, "_op_dispatcher", "clear_dtensor_python_sharding_cache"),
    PrivateName("torch._C", "_clear_DTensor_sharding_propagator_cache", "clear_dtensor_native_sharding_cache",
                required=False),
    PrivateName("torch.distributed.checkpoint.filesystem", "_StorageInfo", "dcp_storage_info_class"),
    PrivateName("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "dcp_metadata_private_globals"),
    PrivateName("torch.serialization", "_get_layout", "dcp_metadata_private_globals"),
    PrivateName("torch.distributed.launcher.api", "LocalElasticAgent", "end_elastic_agent_on_exit_code"),
    PrivateName(_ELASTIC_AGENT, "_monitor_workers", "ELASTIC_AGENT_OVERRIDDEN_METHODS"),
)


warn_if_unchecked_torch()
