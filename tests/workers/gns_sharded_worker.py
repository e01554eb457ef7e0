"""torchrun worker for tests/test_gns_sharded.py: the noise scale of FSDP2 models.

Usage: gns_sharded_worker.py OUT_DIR CASE [CASE ...]; writes OUT_DIR/rank<R>.json with
one entry per case.  A case is ``<optimizer>-<accum>[-bf16]`` (the closed-form
problem of tests/test_gns.py, trained with lr 0 on fully_shard), or ``grad``
(the sharded gradient of an accumulated step against the single-process mean
gradient), ``exact`` (one measured Adam step's sums against the same sums computed
from every rank's samples) or ``refusals`` (what attach refuses).  ``MESH`` in the environment, e.g. ``2x2``, asks for an HSDP mesh
(replicate x shard); default: a 1-D mesh over all ranks.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the closed-form problem

from test_gns import D1, LOCAL_BSZ, Problem  # noqa: E402

from adaptive.batchsize.gns import GradientNoiseScale  # noqa: E402

STEPS = {1: 400, 2: 250}  # differenced (one rank, no accumulation) needs more steps
ADAM_SCALE = torch.cat([torch.full((D1,), 3.0), torch.full((Problem().w_star.numel() - D1,), 0.3)])


class Part(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class TwoParts(torch.nn.Module):
    """The linear model of test_gns.SplitLinear, one block per sub-module (each fully_shard-ed)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.a, self.b = Part(weight[:D1]), Part(weight[D1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x[:, :D1]) + self.b(x[:, D1:])


def build(problem: Problem, mesh, bf16: bool = False) -> TwoParts:
    model = TwoParts(problem.w_star + problem.delta)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for module in (model.a, model.b, model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    return model


def train(problem: Problem, model, optimizer, steps: int, accum: int, seed: int) -> None:
    """The ordinary loop: FSDP reduces only on the last micro-step."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        for micro in range(accum):
            x, y = problem.batch(gen, LOCAL_BSZ)
            model.set_requires_gradient_sync(micro == accum - 1)
            (0.5 * ((model(x).float() - y) ** 2).mean()).backward()
        optimizer.step()


def converge(case: str, mesh, rank: int, world: int) -> dict:
    name, accum, *flags = case.split("-")
    accum, bf16 = int(accum), "bf16" in flags
    adam = name == "adam"
    problem = Problem(seed=30, feature_scale=ADAM_SCALE if adam else None)
    model = build(problem, mesh, bf16)
    groups = [{"params": [model.a.w]}, {"params": [model.b.w]}]
    if adam:
        optimizer = torch.optim.Adam(groups, lr=0.0, betas=(0.9, 0.99), eps=1e-8)
        gns = GradientNoiseScale(optimizer, precondition_interval=1)
    else:
        optimizer = torch.optim.SGD(groups, lr=0.0)
        gns = GradientNoiseScale(optimizer)
    gns.attach(model)  # as the sharded wrapper does: after fully_shard, before the first forward
    gns.set_batch_config(init_batch_size=LOCAL_BSZ * world, local_bsz=LOCAL_BSZ, accum_steps=accum)
    steps = STEPS[min(world * accum, 2)]
    train(problem, model, optimizer, steps, accum, seed=200 + rank)  # independent samples per rank
    state = gns.state_dict()
    json.dumps(state)
    return {"noise_scale": gns.noise_scale(), "sqr": [gns.sqr_avg(0), gns.sqr_avg(1)],
            "var": [gns.var_avg(0), gns.var_avg(1)], "updates": gns.num_updates, "steps": steps,
            "accum": accum, "batch": LOCAL_BSZ * world * accum, "gain": gns.gain(2.0),
            "grad_params": [params.sqr, params.var] if (params := gns.to_grad_params()) else None}


def grad_check(mesh, rank: int, world: int) -> dict:
    """One accumulated step (2 micro-steps) against the mean gradient of all its samples."""
    problem = Problem(seed=31)
    model = build(problem, mesh)
    optimizer = torch.optim.SGD([{"params": [model.a.w]}, {"params": [model.b.w]}], lr=0.0)
    gns = GradientNoiseScale(optimizer)
    gns.attach(model)
    gns.set_batch_config(init_batch_size=LOCAL_BSZ, local_bsz=LOCAL_BSZ, accum_steps=2)
    gen = torch.Generator().manual_seed(7)
    batches = [[problem.batch(gen, LOCAL_BSZ) for _ in range(2)] for _ in range(world)]  # [rank][micro]
    for step in range(2):  # the second step also checks that zero_grad + accumulation start afresh
        optimizer.zero_grad()
        for micro, (x, y) in enumerate(batches[rank]):
            model.set_requires_gradient_sync(micro == 1)
            (0.5 * ((model(x) - y) ** 2).mean()).backward()
    full = [model.a.w.grad.full_tensor(), model.b.w.grad.full_tensor()]
    reference = problem.model()
    x, y = (torch.cat(v) for v in zip(*[b for per_rank in batches for b in per_rank]))
    (0.5 * ((reference(x) - y) ** 2).mean()).backward()
    expected = [reference.a.grad, reference.b.grad]
    return {"max_abs_diff": max(float((f - e).abs().max()) for f, e in zip(full, expected)),
            "max_abs": max(float(e.abs().max()) for e in expected), "updates": gns.num_updates}


def exact(mesh, rank: int, world: int) -> dict:
    """One measured Adam step with 2 micro-steps, against the same sums computed here from every
    rank's samples and the full preconditioner: the probe's rows, scaling and reduction."""
    problem = Problem(seed=33, feature_scale=ADAM_SCALE)
    model = build(problem, mesh)
    params = [model.a.w, model.b.w]
    optimizer = torch.optim.Adam([{"params": [p]} for p in params], lr=0.0, betas=(0.9, 0.99), eps=1e-8)
    gns = GradientNoiseScale(optimizer, precondition_interval=1)
    gns.attach(model)
    gns.set_batch_config(init_batch_size=LOCAL_BSZ * world, local_bsz=LOCAL_BSZ, accum_steps=2)
    gen = torch.Generator().manual_seed(11)
    for step in range(2):  # step 0 has no v_hat yet; step 1 is measured
        batches = [[problem.batch(gen, LOCAL_BSZ) for _ in range(2)] for _ in range(world)]  # [rank][micro]
        optimizer.zero_grad()
        for micro, (x, y) in enumerate(batches[rank]):
            model.set_requires_gradient_sync(micro == 1)
            (0.5 * ((model(x) - y) ** 2).mean()).backward()
        if step == 1:
            measured, _votes = gns._probe.take_record().read()
            roots = []
            for p in params:
                state = optimizer.state[p]
                v_hat = state["exp_avg_sq"].full_tensor() / (1 - 0.99 ** float(state["step"]))
                roots.append((v_hat.sqrt() + 1e-8).rsqrt())
        optimizer.step()
    weight = torch.cat([p.full_tensor() for p in params])
    shards = mesh.size(mesh.ndim - 1)
    blocks = [(0, D1), (D1, weight.numel())]
    big, local = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    mean = torch.zeros_like(weight, dtype=torch.float64)
    for r, per_rank in enumerate(batches):
        for x, y in per_rank:
            g = ((x @ weight - y)[:, None] * x).mean(0).double()
            mean += g / (2 * world)
            for group, ((a, b), root) in enumerate(zip(blocks, roots)):
                rows = torch.chunk(torch.arange(b - a), shards)
                own = rows[r % shards] if r % shards < len(rows) else rows[0][:0]
                local[group] += shards * float(((g[a:b] * root.double())[own] ** 2).sum())
    for group, ((a, b), root) in enumerate(zip(blocks, roots)):
        big[group] = float(((mean[a:b] * root.double()) ** 2).sum())
    return {"big": measured.big.tolist(), "local": measured.local.tolist(), "count": measured.count,
            "expected_big": big.tolist(), "expected_local": local.tolist()}


def refusals(mesh, rank: int, world: int) -> dict:
    """What attach refuses, with the error it gives."""
    problem = Problem(seed=32)
    model = build(problem, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    errors = {}
    gns = GradientNoiseScale(optimizer)
    gns.set_batch_config(init_batch_size=LOCAL_BSZ, local_bsz=LOCAL_BSZ, num_replicas=world + 1)
    try:
        gns.attach(model)
    except ValueError as error:
        errors["replicas"] = str(error)
    model(torch.zeros(2, problem.w_star.numel())).sum().backward()  # lazy init: the root is known now
    try:
        GradientNoiseScale(optimizer).attach(model.a)
    except ValueError as error:
        errors["submodule"] = str(error)
    return errors


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = os.environ.get("MESH")
    if shape:
        dims = tuple(int(v) for v in shape.split("x"))
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    special = {"grad": grad_check, "refusals": refusals, "exact": exact}
    results = {case: special.get(case, functools.partial(converge, case))(mesh, rank, world) for case in cases}
    # The cases' models (kept by reference cycles through their hooks) go before the groups: gloo's threads
    # outliving a group abort the interpreter's finalisation now and then ("terminate called without an
    # active exception").
    gc.collect()
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
