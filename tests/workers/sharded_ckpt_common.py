"""A small FSDP2 model with Adam and a test-only ShardedState around it (shared by the sharded-checkpoint
tests in process and by ``sharded_ckpt_worker.py`` under torchrun)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from adaptive.checkpoint.states import ShardedState, load_state

# Odd sizes: 3 ranks shard them unevenly (FSDP2 pads the last shards).
SIZES = (7, 13, 5)


def build(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (same initial values on every rank for a seed), sharded over ``world`` ranks, and Adam."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.Tanh(),
                                torch.nn.Linear(SIZES[1], SIZES[2]))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, SIZES[0], generator=generator)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of the full, gathered model and optimizer state (collective; complete on rank 0).

    Copied: on one rank the gathered tensors can share memory with the live ones."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return copy.deepcopy({"model": model_state, "optim": optim_state})


def assert_equal_states(actual: Any, expected: Any, where: str = "state") -> None:
    """Exact equality: same keys, tensors bitwise equal with the same dtype and shape."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual)}"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert sorted(map(repr, actual)) == sorted(map(repr, expected)), f"{where}: keys {list(actual)}"
        for key in expected:
            assert_equal_states(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_equal_states(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


class FSDPState(ShardedState):
    """Model + Adam under fully_shard: the sharded part through get_state_dict/set_state_dict, a step counter
    as the small part. Restores itself when created, like the library's states. ``hook`` runs inside
    ``sharded_state_dict()`` (tests make a save observable with it)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, name: str = "test.fsdp",
                 hook: Callable[[], None] | None = None) -> None:
        super().__init__(name)
        self.model, self.optimizer, self.hook = model, optimizer, hook
        self.steps = 0
        self.restored = load_state(self)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])

    def sharded_state_dict(self) -> dict[str, Any]:
        if self.hook is not None:
            self.hook()
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_sharded_state_dict(self, read: Callable[[dict], dict]) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        loaded = read({"model": model_state, "optim": optim_state})
        set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])
