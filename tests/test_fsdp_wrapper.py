"""AdaptiveFSDP in one process: what it shards, what it refuses, what it saves and restores."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard

import adaptive
from adaptive.checkpoint.store import CheckpointError
from adaptive.parallel import sharding_mesh
from conftest import restart_process_state


class Block(torch.nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(2, 6)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.extra = Block()
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.extra(x)).sum(-1)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _sharded_names(model: torch.nn.Module) -> list[str]:
    return sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule))


def test_default_policy_shards_each_block_then_the_root(job):
    net = _net()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    model = adaptive.AdaptiveFSDP(net, optimizer)
    assert _sharded_names(model.module) == ["", "blocks.0", "blocks.1"]
    # the optimizer now steps the sharded parameters
    sharded = {id(p) for p in model.module.parameters()}
    assert all(id(p) in sharded for group in optimizer.param_groups for p in group["params"])
    assert tuple(model.mesh.shape) == (1,)


@pytest.mark.parametrize("shard, expected", [
    ("root", [""]),
    (Block, ["", "blocks.0", "blocks.1", "extra"]),
    ((Block, torch.nn.Linear), ["", "blocks.0", "blocks.0.linear", "blocks.1", "blocks.1.linear", "embed", "extra",
                                "extra.linear", "head"]),
    (lambda name, module: name == "head", ["", "head"]),
])
def test_shard_policies(job, shard, expected):
    net = _net()
    model = adaptive.AdaptiveFSDP(net, torch.optim.SGD(net.parameters(), lr=0.1), shard=shard)
    assert _sharded_names(model.module) == expected


def test_a_module_the_user_sharded_is_taken_as_it_is(job):
    net = _net()
    adaptive.init_process_group("gloo")
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    model = adaptive.AdaptiveFSDP(net, optimizer)
    assert model.module is net
    with pytest.raises(ValueError, match="already fully sharded"):
        restart_process_state()
        adaptive.AdaptiveFSDP(net, optimizer, shard="root")


def test_bad_arguments_are_refused_with_their_names(job):
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        adaptive.AdaptiveFSDP("net", optimizer)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        adaptive.AdaptiveFSDP(net, "sgd")
    with pytest.raises(ValueError, match="not in the model"):
        adaptive.AdaptiveFSDP(net, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
    with pytest.raises(TypeError, match="unexpected keyword argument.*find_unused_parameters"):
        adaptive.AdaptiveFSDP(net, optimizer, find_unused_parameters=True)
    with pytest.raises(ValueError, match="offload_policy"):
        adaptive.AdaptiveFSDP(net, optimizer, offload_policy=object())
    with pytest.raises(ValueError, match="shard must be"):
        adaptive.AdaptiveFSDP(net, optimizer, shard="layers")
    with pytest.raises(TypeError, match="mesh must be"):
        adaptive.AdaptiveFSDP(net, optimizer, mesh=(1,))
    with pytest.raises(ValueError, match="gns_interval"):
        adaptive.AdaptiveFSDP(net, optimizer, gns_interval=0)
    with pytest.raises(TypeError, match="name must be"):
        adaptive.AdaptiveFSDP(net, optimizer, name="")
    frozen = _net().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        adaptive.AdaptiveFSDP(frozen, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    stepped = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.ones(3, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="already stepped"):
        adaptive.AdaptiveFSDP(net, stepped)
    assert not isinstance(net, FSDPModule)  # refused before anything was sharded


def test_sharding_mesh_validates_shard_size(job):
    adaptive.init_process_group("gloo")
    assert tuple(sharding_mesh().shape) == (1,)
    assert tuple(sharding_mesh(1).shape) == (1, 1)
    assert tuple(sharding_mesh("node").shape) == (1, 1)
    with pytest.raises(ValueError, match="must divide"):
        sharding_mesh(2)
    with pytest.raises(TypeError, match="shard_size"):
        sharding_mesh(1.5)


def test_live_resharding_helpers_keep_the_layout_without_storage():
    """The storage-free copy a live job shards anew keeps tied parameters tied; HSDP shard groups keep their
    size where it divides the replicas, else grow (never shrink)."""
    from adaptive.parallel._sharding import live_shard_size, meta_copy

    model = _net()
    model.head.weight = torch.nn.Parameter(torch.zeros(1, 6))
    model.register_buffer("table", torch.arange(4.0), persistent=False)
    model.extra.linear.weight = model.blocks[0].linear.weight  # tied
    copy = meta_copy(model)
    assert all(t.is_meta for t in [*copy.parameters(), *copy.buffers()])
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])  # the original is untouched
    assert copy.extra.linear.weight is copy.blocks[0].linear.weight
    assert [n for n, _ in copy.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [(size, replicas, live_shard_size(size, replicas)) for size, replicas in
            [(2, 4), (2, 3), (2, 1), (4, 6), (3, 9), (1, 5)]] == \
        [(2, 4, 2), (2, 3, 3), (2, 1, 1), (4, 6, 6), (3, 9, 3), (1, 5, 1)]


def _train(model, optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(8, 2, generator=generator)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _full_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return dict(zip(("model", "optimizer"), get_state_dict(model.module, optimizer,
                                                           options=StateDictOptions(full_state_dict=True))))


def test_checkpoint_restores_model_optimizer_scheduler_exactly(job):
    net = _net()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model = adaptive.AdaptiveFSDP(net, optimizer, scheduler)
    _train(model, optimizer, 3)
    for _ in range(3):
        scheduler.step()
    adaptive.save_all_states({"note": "test"})
    saved = _full_state(model, optimizer)
    restart_process_state()
    net2 = _net()
    optimizer2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=2, gamma=0.5)
    model2 = adaptive.AdaptiveFSDP(net2, optimizer2, scheduler2)
    restored = _full_state(model2, optimizer2)
    for name, tensor in saved["model"].items():
        assert torch.equal(tensor, restored["model"][name]), name
    for name, state in saved["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, restored["optimizer"]["state"][name][key]), (name, key)
    assert scheduler2.last_epoch == 3 and optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    # the restored optimizer steps on: the same update as the uninterrupted one
    _train(model, optimizer, 1)
    _train(model2, optimizer2, 1)
    for (name, a), b in zip(model.module.named_parameters(), model2.module.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


def test_a_checkpoint_before_the_first_step_leaves_the_optimizer_fresh(job):
    net = _net()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    adaptive.AdaptiveFSDP(net, optimizer)
    adaptive.save_all_states()
    assert not optimizer.state  # saving did not create optimizer state
    restart_process_state()
    net2 = _net()
    optimizer2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    adaptive.AdaptiveFSDP(net2, optimizer2)
    assert not optimizer2.state


def test_the_wrappers_refuse_each_others_checkpoints(job):
    net = _net()
    adaptive.AdaptiveDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1))
    adaptive.save_all_states()
    restart_process_state()
    net2 = _net()
    with pytest.raises(CheckpointError, match="saved by AdaptiveDataParallel"):
        adaptive.AdaptiveFSDP(net2, torch.optim.SGD(net2.parameters(), lr=0.1))
