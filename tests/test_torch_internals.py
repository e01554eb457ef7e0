"""The private torch calls of ``adaptive`` all live in the package adaptive/_utils/torch_internals/, and still work.

* The installed torch is one the adapter was checked against; on another the
  test fails with the versions found and checked (and so does
  :func:`~adaptive._utils.torch_internals.check_torch_version`).
* Every private attribute the adapter uses exists on the installed torch:
  the ones on modules and classes by import and ``getattr``, the ones set on
  instances on real objects (DDP, FSDP2 and DTensor over a gloo group of one,
  an AMP grad scaler); each adapter function is then exercised once.
* No other module of ``adaptive`` names a private torch attribute (a static
  scan of the source): no import of a private torch module or name, no
  private attribute reached from a name bound to torch, none of the
  adapter's private names as an attribute or in ``getattr``, no private
  member of a torch base class used through ``self`` or ``super()``, and no
  override of one that the adapter does not list.  Every file of the
  adapter package is the adapter (its modules by concept, re-exported by
  its ``__init__``); a file anywhere else in ``adaptive`` is scanned.
"""

from __future__ import annotations

import ast
import importlib
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import adaptive
from adaptive._utils import torch_internals
from adaptive._utils.torch_internals import PRIVATE_NAMES, PrivateName
from adaptive.runtime.job import reset_job

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "adaptive"
ADAPTER = PACKAGE / "_utils" / "torch_internals"  # the adapter: every file of this package
CHECKED = ", ".join(torch_internals.CHECKED_TORCH_VERSIONS)


def _resolve(path: str) -> Any:
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise ImportError(path)


def _missing(entry: PrivateName, holder: object) -> str:
    return (f"torch {torch.__version__} has no {entry.owner}.{entry.name}, which "
            f"adaptive._utils.torch_internals.{entry.entry_point} uses (checked on torch {CHECKED}): "
            "adapt that function to this torch")


# ------------------------------------------------------------------ the version check


def test_the_installed_torch_is_a_checked_version():
    try:
        torch_internals.check_torch_version()
    except torch_internals.UncheckedTorchVersion as error:
        pytest.fail(str(error), pytrace=False)


def test_the_checked_versions_are_the_ones_setup_py_and_requirements_name():
    setup = (REPO / "setup.py").read_text(encoding="utf-8")
    accepted = re.search(r'"torch(>=[\d.]+,<[\d.]+)"', setup)
    assert accepted and accepted.group(1) == torch_internals.SUPPORTED_TORCH_RANGE, \
        "SUPPORTED_TORCH_RANGE must be setup.py's torch range"
    low, high = (tuple(int(n) for n in bound.split(".")) for bound in
                 re.findall(r"[\d.]+", torch_internals.SUPPORTED_TORCH_RANGE))
    for version in torch_internals.CHECKED_TORCH_VERSIONS:
        assert low <= tuple(int(n) for n in version.split(".")) < high, f"{version} is outside setup.py's range"
    pinned = re.search(r"^torch==(\d+\.\d+)", (REPO / "requirements.txt").read_text(encoding="utf-8"), re.M)
    assert pinned and pinned.group(1) in torch_internals.CHECKED_TORCH_VERSIONS, \
        "the torch that requirements.txt pins is the one the tests check"


def test_an_unchecked_version_is_named_with_the_checked_ones(monkeypatch, caplog):
    monkeypatch.setattr(torch, "__version__", "2.99.1+cpu")
    torch_internals._warn_once.cache_clear()  # a fresh process
    with pytest.raises(torch_internals.UncheckedTorchVersion) as raised:
        torch_internals.check_torch_version()
    message = str(raised.value)
    assert "torch 2.99.1+cpu is installed" in message
    assert f"checked only against torch {CHECKED}" in message
    assert torch_internals.SUPPORTED_TORCH_RANGE in message and "tests/test_torch_internals.py" in message
    with caplog.at_level(logging.WARNING, logger=torch_internals.__name__):
        assert torch_internals.warn_if_unchecked_torch()
        assert torch_internals.warn_if_unchecked_torch()
    assert [record.getMessage() for record in caplog.records] == [message]  # once per process


def test_a_checked_version_passes_whatever_its_patch_level(monkeypatch):
    version = torch_internals.CHECKED_TORCH_VERSIONS[0]
    assert torch_internals.unchecked_torch_message(f"{version}.7+cu126") is None
    assert torch_internals.unchecked_torch_message(f"{version}.0a0+git1234") is None
    monkeypatch.setattr(torch, "__version__", f"{version}.3")
    torch_internals.check_torch_version()
    assert not torch_internals.warn_if_unchecked_torch()


# ------------------------------------------------------------------ the private names exist


def test_every_registered_name_names_an_entry_point_of_the_adapter():
    for entry in PRIVATE_NAMES:
        assert hasattr(torch_internals, entry.entry_point), entry
        assert entry.entry_point in torch_internals.__all__, entry
    overridden = (set(torch_internals.DDP_OVERRIDDEN_METHODS) | set(torch_internals.PROCESS_GROUP_OVERRIDDEN_METHODS)
                  | set(torch_internals.ELASTIC_AGENT_OVERRIDDEN_METHODS))
    assert overridden <= {entry.name for entry in PRIVATE_NAMES}


@pytest.mark.parametrize("entry", [entry for entry in PRIVATE_NAMES if entry.required and not entry.on_instances],
                         ids=lambda entry: f"{entry.owner}.{entry.name}")
def test_a_private_name_on_a_module_or_class_exists(entry: PrivateName):
    try:
        holder = _resolve(entry.owner)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"torch {torch.__version__} has no {entry.owner} ({error}), which "
                    f"adaptive._utils.torch_internals.{entry.entry_point} uses (checked on torch {CHECKED})",
                    pytrace=False)
    assert hasattr(holder, entry.name), _missing(entry, holder)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


@pytest.fixture
def group(job):
    """A job of one replica with a gloo process group of one."""
    adaptive.init_process_group("gloo")
    yield job
    if dist.is_initialized():
        dist.destroy_process_group()
    reset_job()


def _instances() -> dict[str, object]:
    """One object of each class whose instances carry a private attribute the adapter reads (owner -> object)."""
    from torch.distributed.fsdp import fully_shard

    ddp = torch.nn.parallel.DistributedDataParallel(Net())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    sharded = fully_shard(torch.nn.Linear(4, 4))
    sharded(torch.ones(2, 4)).sum().backward()  # the first forward sets the root and the unsharded parameters
    state = torch_internals.fsdp_state(sharded)
    fsdp_param = torch_internals.fsdp_param_groups(state)[0].fsdp_params[0]
    return {"torch.nn.parallel.DistributedDataParallel": ddp, "torch.amp.GradScaler": scaler,
            "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState": state,
            "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam": fsdp_param}


def test_the_private_attributes_set_on_instances_exist(group):
    instances = _instances()
    for entry in PRIVATE_NAMES:
        if entry.on_instances and entry.required:
            assert entry.owner in instances, f"build an instance of {entry.owner} in _instances()"
            assert hasattr(instances[entry.owner], entry.name), _missing(entry, instances[entry.owner])


# ------------------------------------------------------------------ the entry points work


def test_a_rebuilt_ddp_reducer_reduces_and_calls_the_hooks_again(group):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    calls = []

    def hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket (strings here)
        calls.append(state)
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    model.register_comm_hook("state", hook)
    old = model.reducer
    parameters, sparse = torch_internals.ddp_params_for_reducer(model)
    assert [id(p) for p in parameters] == [id(p) for p in model.parameters()] and sparse == [False, False]
    names = torch_internals.ddp_param_names(model, parameters)
    torch_internals.ddp_init_reducer(model, parameters, sparse, names)
    for hooked, state in torch_internals.ddp_comm_hooks(model):
        torch_internals.register_reducer_comm_hook(model.reducer, state, hooked)
    assert model.reducer is not old
    model(torch.ones(3, 4)).sum().backward()
    assert calls == ["state"]
    assert torch.allclose(model.module.weight.grad, torch.full((1, 4), 3.0))


def test_adaptive_data_parallel_follows_a_regroup_and_broadcasts_buffers_without_bumping_versions(group):
    net = Net()
    model = adaptive.AdaptiveDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1), gns_interval=1)
    old = model.reducer
    model._follow_regroup()  # as after a live membership change (one replica here)
    assert model.reducer is not old and model.process_group is dist.group.WORLD
    versions = [buffer._version for buffer in model.modules_buffers]
    model._broadcast_buffers()
    assert [buffer._version for buffer in model.modules_buffers] == versions
    model(torch.randn(3, 4)).pow(2).mean().backward()  # the rebuilt reducer runs a step
    assert net.linear.weight.grad is not None


def test_work_from_future_completes_and_the_backend_registers_once(group):
    from adaptive.runtime import fault_tolerant_group

    future: torch.futures.Future[None] = torch.futures.Future()
    future.set_result(None)
    work = torch_internals.work_from_future(future)
    assert isinstance(work, dist.Work) and work.wait() and work.is_completed()
    fault_tolerant_group.register()
    fault_tolerant_group.register()  # the second call finds it registered
    assert fault_tolerant_group.BACKEND in dist.Backend.backend_list
    for name in torch_internals.GLOO_PRIVATE_COLLECTIVES:
        assert hasattr(fault_tolerant_group.FaultTolerantGroup, name)


def test_the_autograd_and_tensor_entry_points():
    tensors = [torch.arange(4.0), torch.ones(2, 3)]
    norms = torch_internals.foreach_norm(tensors, 2, dtype=torch.float32)
    assert [float(n) for n in norms] == pytest.approx([float(torch.linalg.vector_norm(t)) for t in tensors])
    torch_internals.foreach_div_(tensors, 2)
    assert torch.equal(tensors[0], torch.arange(4.0) / 2) and torch.equal(tensors[1], torch.full((2, 3), 0.5))
    order = []
    weight = torch.ones(2, requires_grad=True)
    weight.register_hook(lambda grad: torch_internals.queue_autograd_callback(lambda: order.append("end")))
    weight.register_hook(lambda grad: order.append("hook"))
    (weight * 3).sum().backward()
    assert order == ["hook", "end"]
    buffer = torch.zeros(3)
    with torch_internals.preserve_version_counter([buffer]):
        version = buffer._version
        buffer.add_(1)
    assert buffer._version == version


def test_grad_scaler_scale_is_the_device_tensor_once_scaling_started():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert torch_internals.grad_scaler_scale(scaler) is None  # created lazily by the first scale()
    scaler.scale(torch.ones(()))
    scale = torch_internals.grad_scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and float(scale) == scaler.get_scale() == 8.0
    assert torch_internals.grad_scaler_scale(object()) is None


def test_the_fsdp_and_dtensor_entry_points(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    assert torch_internals.fsdp_module_class() is FSDPModule and torch_internals.dtensor_class() is DTensor
    inner = torch.nn.Linear(4, 4)
    root = torch.nn.Sequential(inner, torch.nn.Linear(4, 2))
    fully_shard(inner)
    fully_shard(root)
    state = torch_internals.fsdp_state(root)
    fsdp_param = torch_internals.fsdp_param_groups(state)[0].fsdp_params[0]
    assert torch_internals.fsdp_unsharded_param(fsdp_param) is None  # before the first all-gather
    root(torch.ones(2, 4)).sum().backward()
    assert torch_internals.fsdp_is_root(state) is True
    assert torch_internals.fsdp_is_root(torch_internals.fsdp_state(inner)) is False
    assert torch_internals.fsdp_param_orig_size(fsdp_param) == fsdp_param.sharded_param.shape
    assert isinstance(torch_internals.fsdp_unsharded_param(fsdp_param), torch.nn.Parameter)
    mesh = init_device_mesh("cpu", (1,))
    whole = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
    local = torch_internals.dtensor_local_tensor(whole)
    with torch.no_grad():
        assert local is whole.to_local()
    copy = torch_internals.dtensor_like(local.clone(), whole)
    assert copy.placements == whole.placements and torch.equal(copy.full_tensor(), whole.full_tensor())
    torch_internals.clear_dtensor_python_sharding_cache()
    assert torch_internals.clear_dtensor_native_sharding_cache() == hasattr(
        torch._C, "_clear_DTensor_sharding_propagator_cache")


def test_the_dcp_entry_points():
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    assert torch_internals.dcp_storage_info_class() is _StorageInfo
    found = torch_internals.dcp_metadata_private_globals()
    assert found[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] is _StorageInfo
    assert set(found) == {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                          ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                          ("torch.serialization", "_get_layout")}


def test_the_elastic_agent_entry_point_ends_the_agent_at_the_exit_code(monkeypatch):
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    monkeypatch.setattr(api, "LocalElasticAgent", api.LocalElasticAgent)  # restored after the test
    calls: list[object] = []
    torch_internals.end_elastic_agent_on_exit_code(
        2, lambda ranks: calls.append(ranks) or ValueError(ranks), lambda: calls.append("before"))
    agent_class = api.LocalElasticAgent
    assert issubclass(agent_class, LocalElasticAgent) and agent_class is not LocalElasticAgent
    for name in torch_internals.ELASTIC_AGENT_OVERRIDDEN_METHODS:
        assert name in vars(agent_class)
    agent = agent_class.__new__(agent_class)  # the override only reads the base class's result
    result = RunResult(state=WorkerState.FAILED, failures={3: SimpleNamespace(exitcode=1)})
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: result)
    assert agent._monitor_workers(None) is result and calls == []  # another status: torchrun's own result
    result.failures.update({1: SimpleNamespace(exitcode=2), 0: SimpleNamespace(exitcode=2)})
    with pytest.raises(ValueError):
        agent._monitor_workers(None)
    assert calls == ["before", [0, 1]]  # the workers are killed first, then the error names the ranks


# ------------------------------------------------------------------ no private torch name elsewhere


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch object's dotted path, for every name an import binds to torch."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    bound[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _dotted(node: ast.expr, bound: dict[str, str]) -> str | None:
    """The torch path of a name or attribute chain rooted at a torch-bound name (None otherwise)."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        root = _dotted(node.value, bound)
        return None if root is None else f"{root}.{node.attr}"
    return None


def _torch_bases(node: ast.ClassDef, bound: dict[str, str]) -> list[object]:
    bases = []
    for base in node.bases:
        path = _dotted(base, bound)
        if path is not None:
            try:
                bases.append(_resolve(path))
            except (ImportError, AttributeError):
                pass
    return bases


def _is_self_or_super(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def _private_uses(path: Path, root: Path = REPO) -> list[str]:
    """Every use of a private torch name in one source file, as ``path:line: what`` (relative to ``root``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    bound = _torch_names(tree)
    registered = {entry.name for entry in PRIVATE_NAMES if _is_private(entry.name)}
    where = path.relative_to(root)
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(map(_is_private, alias.name.split("."))):
                    flag(node, f"imports the private module {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            if any(map(_is_private, node.module.split("."))):
                flag(node, f"imports from the private module {node.module}")
            for alias in node.names:
                if _is_private(alias.name):
                    flag(node, f"imports the private name {node.module}.{alias.name}")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            path_of = _dotted(node, bound)
            if path_of is not None:
                flag(node, f"uses the private torch attribute {path_of}")
            elif node.attr in registered:
                flag(node, f"uses .{node.attr}, a private torch attribute")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in registered:
            flag(node, f"names {node.value!r}, a private torch attribute (getattr or a method table)")
        elif isinstance(node, ast.ClassDef):
            bases = _torch_bases(node, bound)
            if not bases:
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.Attribute) and _is_private(inner.attr) and _is_self_or_super(inner.value) \
                        and any(hasattr(base, inner.attr) for base in bases):
                    flag(inner, f"uses .{inner.attr} of a torch base class of {node.name}")
                if isinstance(inner, ast.FunctionDef) and _is_private(inner.name) and inner.name not in registered \
                        and any(hasattr(base, inner.name) for base in bases):
                    flag(inner, f"overrides {inner.name} of its torch base class without the adapter listing it")
    return found


def _in_adapter(path: Path, adapter: Path = ADAPTER) -> bool:
    """Whether a source file is one of the adapter package's (which may name private torch attributes)."""
    return adapter in path.parents


def _adapter_modules() -> list[str]:
    """The dotted names of the adapter package's submodules."""
    return sorted(f"{torch_internals.__name__}.{path.stem}" for path in ADAPTER.glob("*.py")
                  if path.name != "__init__.py")


def test_no_module_but_the_adapter_uses_a_private_torch_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if not _in_adapter(path):
            found += _private_uses(path)
    assert not found, ("private torch names outside adaptive/_utils/torch_internals/; add a function to the module "
                       "of that package for its concept (what, why, since which torch), re-export it from the "
                       "package's __init__.py and call it instead:\n" + "\n".join(found))


def test_the_adapter_is_every_file_of_its_package_and_nothing_else(tmp_path):
    assert (ADAPTER / "__init__.py").is_file() and _adapter_modules(), "the adapter is a package of modules"
    assert any(_private_uses(path) for path in ADAPTER.glob("*.py")), "the scan sees the adapter's private names"
    adapter = tmp_path / "adaptive" / "_utils" / "torch_internals"
    assert _in_adapter(adapter / "__init__.py", adapter) and _in_adapter(adapter / "_ddp.py", adapter)
    for outside in (tmp_path / "adaptive" / "_utils" / "torch_internals.py",
                    tmp_path / "adaptive" / "_utils" / "torch_internals_extra" / "x.py",
                    tmp_path / "adaptive" / "parallel" / "data_parallel.py"):
        assert not _in_adapter(outside, adapter), outside


def test_the_package_re_exports_every_public_name_of_its_modules():
    defined_here = {name for name in torch_internals.__all__
                    if getattr(getattr(torch_internals, name), "__module__", None) == torch_internals.__name__}
    from_modules: set[str] = set()
    for module_name in _adapter_modules():
        module = importlib.import_module(module_name)
        assert module.__doc__, f"{module_name} has no docstring"
        for name in module.__all__:
            assert getattr(torch_internals, name) is getattr(module, name), f"{module_name}.{name}"
            from_modules.add(name)
    assert set(torch_internals.__all__) == from_modules | {
        "CHECKED_TORCH_VERSIONS", "SUPPORTED_TORCH_RANGE", "PRIVATE_NAMES", *defined_here}
    for entry in PRIVATE_NAMES:  # each entry point is defined in one of the modules (or is a module constant)
        defined_in = getattr(getattr(torch_internals, entry.entry_point), "__module__", None)
        assert defined_in is None or defined_in in _adapter_modules(), entry


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    source = '''
import torch
import torch.distributed as dist
from torch.distributed import _register_comm_hook
from torch._C import _distributed_c10d
from torch.nn.parallel import DistributedDataParallel


class Wrapper(DistributedDataParallel):
    def _pre_forward(self):
        self._ddp_init_helper()
        return super()._sync_buffers()

    def _own(self):
        return self._mine


def f(x, state):
    torch._foreach_norm(x)
    dist.Backend._plugins
    getattr(state, "_fsdp_param_groups", None)
    x._local_tensor
    return x._library_private, torch.__version__
'''
    module = tmp_path / "adaptive" / "example.py"
    module.parent.mkdir()
    module.write_text(source, encoding="utf-8")
    found = "\n".join(_private_uses(module, tmp_path))
    for expected in ("private name torch.distributed._register_comm_hook", "private module torch._C",
                     "uses ._ddp_init_helper", "uses ._sync_buffers", "overrides _pre_forward",
                     "torch._foreach_norm", "torch.distributed.Backend._plugins", "'_fsdp_param_groups'",
                     "uses ._local_tensor"):
        assert expected in found, f"{expected!r} not in:\n{found}"
    for innocent in ("_mine", "_library_private", "__version__", "_own"):
        assert innocent not in found, found
