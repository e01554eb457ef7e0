"""Gradient noise scale of FSDP2 models (``fully_shard``) against the closed form of tests/test_gns.py.

Each test starts one real torchrun job (gloo, CPU) of tests/workers/gns_sharded_worker.py,
which trains the fixed-weight linear regression sharded (one ``fully_shard`` per
parameter block, then the root) on independent samples per rank and reports the
estimates of several cases; all ranks must report the same numbers.  Cases:
SGD without and with accumulation (2 micro-steps), Adam-preconditioned (the
preconditioner is sharded, see adaptive/batchsize/_gns_sharded.py), bf16 mixed
precision, and the gradient of an accumulated step against the single-process
mean gradient.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import portpicker
import pytest
import torch

from adaptive.batchsize.gns import GradientNoiseScale
from adaptive.runtime.process_tree import kill_process_tree
from test_gns import D1, LOCAL_BSZ, TOLERANCE, Problem, relative_error

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "gns_sharded_worker.py"
ADAM_SCALE = torch.cat([torch.full((D1,), 3.0), torch.full((Problem().w_star.numel() - D1,), 0.3)])


def run_job(tmp_path: Path, world: int, cases: list[str], mesh: str | None = None,
            timeout: float = 240) -> dict:
    """Run the worker on ``world`` processes; returns rank 0's results (checked equal on all ranks)."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("MESH", None)
    if mesh:
        env["MESH"] = mesh
    port = portpicker.pick_unused_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", str(WORKER), str(out), *cases]
    log_path = tmp_path / "job.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=str(tmp_path))
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_process_tree(proc.pid)
            proc.wait(timeout=30)
    log = log_path.read_text(errors="replace")
    assert code == 0, f"job exited with {code}:\n{log[-6000:]}"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, result in enumerate(ranks[1:], 1):
        assert result == ranks[0], f"rank {rank} differs from rank 0"  # statistics agree everywhere
    return ranks[0]


def adam_truth(problem: Problem, batch: int) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) in Adam's geometry: v_hat tends to G_i^2 + Sigma_ii / batch (the step's gradient)."""
    weight = 1.0 / ((problem.grad_mean ** 2 + problem.sigma_diag / batch).sqrt() + 1e-8)
    return float((weight * problem.grad_mean ** 2).sum()), float((weight * problem.sigma_diag).sum())


def check_exact(result: dict, world: int) -> None:
    """The measured sums of one step are exactly the formulas of adaptive/batchsize/_gns_sharded.py."""
    assert result["count"] == 2 * world
    assert result["big"] == pytest.approx(result["expected_big"], rel=1e-4)
    assert result["local"] == pytest.approx(result["expected_local"], rel=1e-4)


def check_case(case: str, result: dict, world: int) -> None:
    init_batch = LOCAL_BSZ * world
    measured_steps = result["steps"] - (1 if world * result["accum"] == 1 else 0)  # differenced: no partner
    if case.startswith("adam"):
        problem = Problem(seed=30, feature_scale=ADAM_SCALE)
        sqr, trace = adam_truth(problem, result["batch"])
        assert sqr / trace * problem.noise_scale() < 0.8  # preconditioning matters in this problem
        assert relative_error(result["noise_scale"], trace / sqr) < TOLERANCE, (case, result)
        assert relative_error(sum(result["sqr"]), sqr) < TOLERANCE, (case, result)
        assert relative_error(sum(result["var"]) * init_batch, trace) < TOLERANCE, (case, result)
        measured_steps = result["steps"] - 1  # no v_hat before the first optimizer step
    else:
        problem = Problem(seed=30)
        assert relative_error(result["noise_scale"], problem.noise_scale()) < TOLERANCE, (case, result)
        for group, (sqr, trace) in enumerate(problem.truth()):
            assert relative_error(result["sqr"][group], sqr) < TOLERANCE, (case, group, result)
            assert relative_error(result["var"][group] * init_batch, trace) < TOLERANCE, (case, group, result)
    assert result["updates"] == measured_steps, (case, result)
    sqr_avg, var_avg = sum(result["sqr"]), sum(result["var"])
    assert result["grad_params"] == pytest.approx([sqr_avg, var_avg])
    assert result["gain"] == pytest.approx((var_avg + sqr_avg) / (var_avg / 2 + sqr_avg))


@pytest.mark.distributed
def test_one_rank(tmp_path):
    """One rank: the differenced estimator on the (whole) local gradient, and accumulation."""
    results = run_job(tmp_path, 1, ["sgd-1", "sgd-2", "adam-2", "refusals"])
    for case in ("sgd-1", "sgd-2", "adam-2"):
        check_case(case, results[case], 1)
    errors = results["refusals"]
    assert "num_replicas=2" in errors["replicas"]
    assert "root FSDP module" in errors["submodule"]


@pytest.mark.slow
@pytest.mark.ci_sample  # about 30 s: CI runs it after the default suite (test_one_rank stays in it)
@pytest.mark.distributed
def test_two_ranks(tmp_path):
    """Two ranks: replicas, replicas x micro-steps, bf16 mixed precision, Adam with a sharded
    preconditioner; the sharded gradient of an accumulated step is the single-process mean."""
    results = run_job(tmp_path, 2, ["grad", "exact", "sgd-1", "sgd-2", "sgd-2-bf16", "adam-2"])
    check_exact(results.pop("exact"), 2)
    grad = results.pop("grad")
    assert grad["max_abs_diff"] <= 1e-5 * max(1.0, grad["max_abs"]), grad
    assert grad["updates"] == 2
    for case, result in results.items():
        check_case(case, result, 2)
    # bf16 parameters (norms in float32) agree with float32 training of the same samples
    assert relative_error(results["sgd-2-bf16"]["noise_scale"], results["sgd-2"]["noise_scale"]) < 0.02


@pytest.mark.slow
@pytest.mark.distributed
def test_three_ranks(tmp_path):
    """Three ranks (uneven shards: 12 = 4+4+4, 20 = 7+7+6)."""
    results = run_job(tmp_path, 3, ["exact", "sgd-1", "adam-2"])
    check_exact(results.pop("exact"), 3)
    for case, result in results.items():
        check_case(case, result, 3)


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp(tmp_path):
    """HSDP on a (replicate 2, shard 2) mesh: shards held twice, four small gradients per step."""
    results = run_job(tmp_path, 4, ["exact", "sgd-1", "adam-1"], mesh="2x2", timeout=400)
    check_exact(results.pop("exact"), 4)
    for case, result in results.items():
        check_case(case, result, 4)


def test_attach_refuses_other_modules():
    gns = GradientNoiseScale(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
    with pytest.raises(TypeError, match="DistributedDataParallel or a module on which fully_shard"):
        gns.attach(torch.nn.Linear(2, 1))
