"""Gradient noise scale against a problem with a closed-form answer.

The problem: linear regression ``y = w* . x + eps`` with ``x ~ N(0, I_d)``
and ``eps ~ N(0, sigma^2)``, loss ``l = (w . x - y)^2 / 2`` averaged over the
batch, weights held fixed at ``w = w* + delta`` (learning rate 0).  The
per-sample gradient is ``g = (w . x - y) x = (delta . x - eps) x``, so

* ``G = E[g] = E[x x^T] delta = delta``;
* ``E[g g^T] = E[(delta . x)^2 x x^T] + sigma^2 I = |delta|^2 I + 2 delta delta^T + sigma^2 I``
  (Isserlis: ``E[x_i x_j x_k x_l] = d_ij d_kl + d_ik d_jl + d_il d_jk``);
* ``Sigma = E[g g^T] - G G^T = (|delta|^2 + sigma^2) I + delta delta^T``,
  ``tr(Sigma) = d (|delta|^2 + sigma^2) + |delta|^2``;
* noise scale ``B = tr(Sigma) / |G|^2``.

With the parameters split into blocks (one per optimizer group) the same
holds per block: ``|G_g|^2 = |delta_g|^2`` and
``tr(Sigma_g) = d_g (|delta|^2 + sigma^2) + |delta_g|^2``.

With an independent scaling of the features, ``x_i ~ N(0, s_i^2)`` (used
for the preconditioning test), ``G = S delta`` with ``S = diag(s^2)`` and
``Sigma = (delta^T S delta + sigma^2) S + (S delta)(S delta)^T``.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import portpicker
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import adaptive
from adaptive.batchsize.gns import GradientNoiseScale
from adaptive.batchsize.scaling_rules import AdaScale

D1, D2 = 12, 20
SIGMA = 1.0
LOCAL_BSZ = 16
STEPS = 400
TOLERANCE = 0.15
REPLICA_STEPS = 250


class SplitLinear(torch.nn.Module):
    """``x -> x[:, :D1] . a + x[:, D1:] . b``: a linear model in two parameter blocks."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(weight[:D1].clone())
        self.b = torch.nn.Parameter(weight[D1:].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :D1] @ self.a + x[:, D1:] @ self.b


class Problem:
    """Fixed-weight regression with known per-group |G|^2 and tr(Sigma)."""

    def __init__(self, seed: int = 0, feature_scale: torch.Tensor | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.w_star = torch.randn(D1 + D2, generator=gen)
        self.delta = 0.5 * torch.randn(D1 + D2, generator=gen)
        self.s = torch.ones(D1 + D2) if feature_scale is None else feature_scale
        s2 = self.s ** 2
        grad = s2 * self.delta
        common = float(self.delta @ (s2 * self.delta)) + SIGMA ** 2
        self.grad_mean = grad
        self.sigma_diag = common * s2 + grad ** 2  # diagonal of Sigma

    def truth(self, blocks=((0, D1), (D1, D1 + D2))):
        """Per-block (|G|^2, tr(Sigma))."""
        return [(float((self.grad_mean[a:b] ** 2).sum()), float(self.sigma_diag[a:b].sum())) for a, b in blocks]

    def noise_scale(self) -> float:
        return float(self.sigma_diag.sum() / (self.grad_mean ** 2).sum())

    def model(self) -> SplitLinear:
        return SplitLinear(self.w_star + self.delta)

    def batch(self, gen: torch.Generator, size: int):
        x = torch.randn(size, D1 + D2, generator=gen) * self.s
        y = x @ self.w_star + SIGMA * torch.randn(size, generator=gen)
        return x, y


def _two_groups(model: SplitLinear, optimizer_cls=torch.optim.SGD, **kwargs):
    return optimizer_cls([{"params": [model.a]}, {"params": [model.b]}], lr=0.0, **kwargs)


def train(problem: Problem, ddp: DistributedDataParallel, optimizer, steps: int, accum: int, seed: int,
          scaler=None, bad_steps=()):
    """Ordinary loop: micro-steps under no_sync, the last one synchronises."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accum):
            x, y = problem.batch(gen, LOCAL_BSZ)
            if step in bad_steps and micro == 0:
                x[0, 0] = math.inf  # an overflowing micro-batch
            sync = micro == accum - 1
            with (torch.enable_grad() if sync else ddp.no_sync()):  # forward and backward inside
                loss = 0.5 * ((ddp(x) - y) ** 2).mean()
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        elif step not in bad_steps:  # like AMP, no update from an overflowing step
            optimizer.step()


def relative_error(estimate: float, truth: float) -> float:
    return abs(estimate / truth - 1.0)


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group, as AdaptiveDataParallel uses for one replica."""
    created = False
    if not dist.is_initialized():
        port = portpicker.pick_unused_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
        created = True
    if dist.get_world_size() != 1:
        pytest.skip("needs a one-process default group")
    yield
    if created:
        dist.destroy_process_group()


def _setup(problem: Problem, accum: int, optimizer_cls=torch.optim.SGD, gns_kwargs=None, ddp_kwargs=None,
           **opt_kwargs):
    model = problem.model()
    optimizer = _two_groups(model, optimizer_cls, **opt_kwargs)
    ddp = DistributedDataParallel(model, **(ddp_kwargs or {}))
    gns = GradientNoiseScale(optimizer, **(gns_kwargs or {}))
    gns.attach(ddp)
    gns.set_batch_config(init_batch_size=LOCAL_BSZ, local_bsz=LOCAL_BSZ, accum_steps=accum)
    return ddp, optimizer, gns


# ---------------------------------------------------------------- one replica
@pytest.mark.parametrize("accum", [1, 4], ids=["differenced", "accumulation"])
def test_one_replica_converges_to_truth(process_group, accum):
    problem = Problem(seed=1)
    ddp, optimizer, gns = _setup(problem, accum)
    train(problem, ddp, optimizer, STEPS, accum, seed=2)
    assert relative_error(gns.noise_scale(), problem.noise_scale()) < TOLERANCE
    for group, (sqr, trace) in enumerate(problem.truth()):
        assert relative_error(gns.sqr_avg(group), sqr) < TOLERANCE, group
        assert relative_error(gns.var_avg(group) * LOCAL_BSZ, trace) < TOLERANCE, group
    # differenced: each step but the first pairs with its predecessor
    assert gns.num_updates == (STEPS - 1 if accum == 1 else STEPS)
    assert gns.gain(4.0) == pytest.approx((gns.var_avg() + gns.sqr_avg()) / (gns.var_avg() / 4 + gns.sqr_avg()))


@pytest.mark.parametrize("variant", ["measuring", "user_comm_hook", "detached"])
def test_grad_is_mean_over_micro_steps(process_group, variant):
    """After the synchronising backward, .grad is the mean gradient of all micro-batches
    (also with the user's own DDP communication hook, and after measurement is switched off)."""
    problem = Problem(seed=3)
    model = problem.model()
    optimizer = _two_groups(model)
    ddp = DistributedDataParallel(model)
    gns = GradientNoiseScale(optimizer)
    gns.attach(ddp)
    if variant == "user_comm_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    gns.set_batch_config(init_batch_size=LOCAL_BSZ, local_bsz=LOCAL_BSZ, accum_steps=3)
    if variant == "detached":
        gns.detach()
    reference = problem.model()
    gen = torch.Generator().manual_seed(0)
    batches = [problem.batch(gen, LOCAL_BSZ) for _ in range(3)]
    for micro, (x, y) in enumerate(batches):
        with (torch.enable_grad() if micro == 2 else ddp.no_sync()):
            (0.5 * ((ddp(x) - y) ** 2).mean()).backward()
    x, y = (torch.cat(v) for v in zip(*batches))
    (0.5 * ((reference(x) - y) ** 2).mean()).backward()
    for mine, theirs in zip(ddp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)
    optimizer.step()
    assert gns.num_updates == (0 if variant == "detached" else 1)


@pytest.mark.parametrize("accum", [1, 2], ids=["differenced", "accumulation"])
def test_adam_preconditioning_changes_estimate_as_expected(process_group, accum):
    """Statistics are measured in Adam's geometry: each squared element over sqrt(v_hat) + eps.
    (Tiny DDP buckets: one parameter per bucket after the first iteration.)"""
    scale = torch.cat([torch.full((D1,), 3.0), torch.full((D2,), 0.3)])
    problem = Problem(seed=4, feature_scale=scale)
    ddp, optimizer, gns = _setup(problem, accum=accum, optimizer_cls=torch.optim.Adam,
                                 gns_kwargs={"precondition_interval": 1}, ddp_kwargs={"bucket_cap_mb": 1e-5},
                                 betas=(0.9, 0.99), eps=1e-8)
    train(problem, ddp, optimizer, STEPS, accum=accum, seed=5)
    # Adam's v_hat tends to E[g_i^2] for the step's gradient (accum micro-batches): G_i^2 + Sigma_ii / (accum b).
    weight = 1.0 / ((problem.grad_mean ** 2 + problem.sigma_diag / (accum * LOCAL_BSZ)).sqrt() + 1e-8)
    sqr = float((weight * problem.grad_mean ** 2).sum())
    trace = float((weight * problem.sigma_diag).sum())
    assert relative_error(gns.sqr_avg(), sqr) < TOLERANCE
    assert relative_error(gns.var_avg() * LOCAL_BSZ, trace) < TOLERANCE
    preconditioned, plain = trace / sqr, problem.noise_scale()
    assert preconditioned > 1.5 * plain  # the test problem is built so that this matters
    assert relative_error(gns.noise_scale(), preconditioned) < TOLERANCE
    assert relative_error(gns.noise_scale(), plain) > 0.5
    # The first step had no second-moment estimate yet and was not measured (nor
    # kept as the differenced estimator's first partner).
    assert gns.num_updates == (STEPS - 1 if accum == 2 else STEPS - 2)


def test_nonfinite_gradients_are_skipped(process_group):
    problem = Problem(seed=6)
    ddp, optimizer, gns = _setup(problem, accum=2)
    train(problem, ddp, optimizer, 50, accum=2, seed=7)
    before = (gns.sqr_avg(), gns.var_avg(), gns.num_updates)
    train(problem, ddp, optimizer, 3, accum=2, seed=8, bad_steps=(0, 1, 2))
    assert (gns.sqr_avg(), gns.var_avg(), gns.num_updates) == before
    assert gns.num_skipped == 3
    train(problem, ddp, optimizer, 5, accum=2, seed=9)
    assert gns.num_updates == before[2] + 5
    assert math.isfinite(gns.noise_scale())


def test_amp_loss_scale_is_divided_out_and_overflow_skipped(process_group):
    problem = Problem(seed=10)
    results = []
    for init_scale in (None, 2.0 ** 12):
        ddp, optimizer, gns = _setup(problem, accum=1)
        scaler = None
        if init_scale is not None:
            scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3)
            gns.grad_scaler = scaler
        train(problem, ddp, optimizer, 40, accum=1, seed=11, scaler=scaler)
        results.append((gns.sqr_avg(), gns.var_avg(), gns.num_updates))
    assert results[1] == pytest.approx(results[0], rel=1e-4)

    ddp, optimizer, gns = _setup(problem, accum=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, backoff_factor=2.0 ** -100, growth_interval=10 ** 6)
    gns.grad_scaler = scaler
    train(problem, ddp, optimizer, 30, accum=2, seed=12, scaler=scaler)
    assert gns.num_skipped == 1 and gns.num_updates == 29
    assert math.isfinite(gns.noise_scale())


def test_measure_interval(process_group):
    problem = Problem(seed=13)
    for accum, expected in ((1, 9), (2, 10)):  # differenced: step 0 has no predecessor
        ddp, optimizer, gns = _setup(problem, accum=accum, gns_kwargs={"measure_interval": 3})
        train(problem, ddp, optimizer, 30, accum=accum, seed=14)
        assert gns.num_updates == expected


def test_a_regroup_folds_the_last_measurement_before_the_schedule_restarts(process_group):
    """After a membership change every member measures from step 0, as a joiner does.

    The step measured last before the change is still pending (it is folded
    when the next step starts); folded after the restart, its agreed
    interval would put the next measurement after its own step number, and
    this member would skip steps the joiner measures (a hang in live mode).
    """
    problem = Problem(seed=17)
    ddp, optimizer, gns = _setup(problem, accum=2, gns_kwargs={"measure_interval": 1})
    train(problem, ddp, optimizer, 6, accum=2, seed=18)  # steps 0-5 measured, step 5's record pending
    gns.follow_group(dist.group.WORLD, 1)
    gns.set_batch_config(init_batch_size=LOCAL_BSZ, local_bsz=LOCAL_BSZ, accum_steps=2)
    train(problem, ddp, optimizer, 3, accum=2, seed=19)
    assert gns.num_updates == 9  # every step measured, before and after the change


@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, torch.optim.Adam], ids=["plain", "preconditioned"])
@pytest.mark.parametrize("accum", [1, 2], ids=["differenced", "accumulation"])
def test_a_float64_model_is_measured(process_group, optimizer_cls, accum):
    """Norms of float64 gradients are summed in float64 (a float32 accumulation of them is an error in torch)."""
    problem = Problem(seed=21)
    model = problem.model().double()
    optimizer = _two_groups(model, optimizer_cls)
    ddp = DistributedDataParallel(model)
    gns = GradientNoiseScale(optimizer)
    gns.attach(ddp)
    gns.set_batch_config(init_batch_size=LOCAL_BSZ, local_bsz=LOCAL_BSZ, accum_steps=accum)
    gen = torch.Generator().manual_seed(22)
    for _ in range(4):
        optimizer.zero_grad()
        for micro in range(accum):
            x, y = problem.batch(gen, LOCAL_BSZ)
            with (torch.enable_grad() if micro == accum - 1 else ddp.no_sync()):
                (0.5 * ((ddp(x.double()) - y.double()) ** 2).mean()).backward()
        optimizer.step()
    assert gns.enabled and gns.num_updates > 0 and math.isfinite(gns.noise_scale())


def test_readouts_before_measurement_and_state_dict(process_group):
    problem = Problem(seed=15)
    ddp, optimizer, gns = _setup(problem, accum=2)
    assert gns.gain(8.0) == 1.0 and math.isnan(gns.noise_scale()) and gns.to_grad_params() is None
    train(problem, ddp, optimizer, 20, accum=2, seed=16)
    state = gns.state_dict()
    json.dumps(state)  # plain data
    fresh = GradientNoiseScale(_two_groups(problem.model()))
    fresh.load_state_dict(state)
    fresh.set_batch_config(init_batch_size=LOCAL_BSZ, local_bsz=LOCAL_BSZ)
    assert fresh.sqr_avg() == gns.sqr_avg() and fresh.var_avg() == gns.var_avg()
    assert fresh.noise_scale() == gns.noise_scale()
    params = fresh.to_grad_params()
    assert (params.sqr, params.var) == (gns.sqr_avg(), gns.var_avg())
    # A new reference batch re-expresses var at the new reference.
    fresh.set_batch_config(init_batch_size=2 * LOCAL_BSZ, local_bsz=LOCAL_BSZ)
    assert fresh.var_avg() == pytest.approx(gns.var_avg() / 2)
    assert fresh.noise_scale() == pytest.approx(gns.noise_scale())
    with pytest.raises(ValueError, match="parameter groups"):
        GradientNoiseScale(torch.optim.SGD(problem.model().parameters(), lr=0.1)).load_state_dict(state)
    # A version-1 state (unweighted averages) reads the same and takes new measurements.
    legacy = {key: value for key, value in state.items() if key != "magnitude"}
    legacy.update(version=1, sqr=[v * 1e3 for v in state["sqr"]], var=[v * 1e3 for v in state["var"]],
                  weight=state["weight"] * 1e3)
    old = GradientNoiseScale(_two_groups(problem.model()))
    old.load_state_dict(legacy)
    old.set_batch_config(init_batch_size=LOCAL_BSZ, local_bsz=LOCAL_BSZ)
    assert old.sqr_avg() == pytest.approx(gns.sqr_avg()) and old.noise_scale() == pytest.approx(gns.noise_scale())
    assert old.state_dict()["weight"] == pytest.approx(state["weight"] * 1e3 / (gns.sqr_avg() + gns.var_avg()))


def test_early_large_gradients_do_not_dominate_the_estimate(process_group):
    """Gradients that shrink (as early in training) must not pin the noise scale
    to its early value: 100 steps with 10x larger gradients (loss x 10) at one
    noise scale, then 400 steps at another.  Measurements count alike whatever
    their size, so the estimate lies mostly at the second value; plain averages
    of |G|^2 and tr(Sigma) would be 96% the first."""
    early, late = Problem(seed=24), Problem(seed=24)
    late.delta = early.delta / 6.0  # a smaller true gradient: a larger noise scale
    late.grad_mean = late.delta
    late.sigma_diag = (float(late.delta @ late.delta) + SIGMA ** 2) + late.delta ** 2
    ddp, optimizer, gns = _setup(early, accum=2)
    gen = torch.Generator().manual_seed(25)
    for problem, steps, loss_scale in ((early, 100, 10.0), (late, 400, 1.0)):
        with torch.no_grad():
            for param, value in zip(ddp.module.parameters(), problem.model().parameters()):
                param.copy_(value)
        for _ in range(steps):
            optimizer.zero_grad()
            for micro in range(2):
                x, y = problem.batch(gen, LOCAL_BSZ)
                with (torch.enable_grad() if micro == 1 else ddp.no_sync()):
                    (loss_scale * 0.5 * ((ddp(x) - y) ** 2).mean()).backward()
            optimizer.step()
    first, second, estimate = early.noise_scale(), late.noise_scale(), gns.noise_scale()
    assert second > 2 * first
    assert abs(math.log(estimate / second)) < 0.5 * abs(math.log(estimate / first))


def test_estimator_switch_keeps_a_usable_estimate(process_group):
    """Restarting from one replica's (differenced) estimate into accumulation: the
    old estimate is discounted, not dropped, so one new step does not replace it."""
    problem = Problem(seed=21)
    ddp, optimizer, gns = _setup(problem, accum=1)
    train(problem, ddp, optimizer, 100, accum=1, seed=22)
    state, old = gns.state_dict(), gns.sqr_avg()
    estimates = []
    for restored in (False, True):
        ddp, optimizer, fresh = _setup(problem, accum=2)
        if restored:
            fresh.load_state_dict(state)
        train(problem, ddp, optimizer, 1, accum=2, seed=23)
        estimates.append(fresh.sqr_avg())
    single, blended = estimates
    assert min(old, single) < blended < max(old, single)
    assert abs(blended - old) < abs(blended - single)


def test_adascale_uses_live_gain(process_group):
    """What the integrator wires up: the LR factor of every step is the gain at that step."""
    problem = Problem(seed=17)
    ddp, optimizer, gns = _setup(problem, accum=2)
    gns.set_batch_config(init_batch_size=LOCAL_BSZ // 2, local_bsz=LOCAL_BSZ, accum_steps=2)  # scale 4
    rule = AdaScale()
    rule.attach(optimizer, gns)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    for group in optimizer.param_groups:
        group["lr"] = 1.0
    train(problem, ddp, optimizer, 30, accum=2, seed=18)
    assert seen[-1] == pytest.approx(gns.gain(4.0), rel=0.05)
    assert 1.0 < rule.last_gain <= 4.0
    assert rule.progress == pytest.approx(sum(seen), rel=1e-9)
    assert optimizer.param_groups[0]["lr"] == 1.0


def test_validation(process_group):
    problem = Problem(seed=19)
    model = problem.model()
    optimizer = _two_groups(model)
    with pytest.raises(ValueError, match="smoothing"):
        GradientNoiseScale(optimizer, smoothing=1.0)
    with pytest.raises(ValueError, match="measure_interval"):
        GradientNoiseScale(optimizer, measure_interval=0)
    with pytest.raises(TypeError, match="optimizer"):
        GradientNoiseScale(model)
    gns = GradientNoiseScale(optimizer)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        gns.attach(model)
    gns.attach(DistributedDataParallel(model))
    with pytest.raises(ValueError, match="num_replicas"):
        gns.set_batch_config(init_batch_size=8, local_bsz=8, num_replicas=2)
    with pytest.raises(ValueError, match="group"):
        gns.sqr_avg(group=5)
    with pytest.raises(ValueError, match="scale"):
        gns.gain(0.0)


# ---------------------------------------------------------------- two replicas
def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    problem = Problem(seed=20)
    results = {}
    for accum, as_view in ((1, False), (2, False), (1, True)):
        model = problem.model()
        optimizer = _two_groups(model)
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=as_view)
        gns = GradientNoiseScale(optimizer)
        gns.attach(ddp)  # exactly as the integrator does
        gns.set_batch_config(init_batch_size=LOCAL_BSZ * world, local_bsz=LOCAL_BSZ, accum_steps=accum)
        train(problem, ddp, optimizer, REPLICA_STEPS, accum, seed=100 + rank)  # independent data per replica
        results[f"{accum}{'-view' if as_view else ''}"] = {"noise_scale": gns.noise_scale(), "sqr": [gns.sqr_avg(0), gns.sqr_avg(1)],
                               "var": [gns.var_avg(0), gns.var_avg(1)], "updates": gns.num_updates}
        del model, optimizer, ddp, gns
    results["auto"] = _auto_interval(problem, rank, world)
    # No DDP model may hold the group past its destruction: gloo's threads would outlive it and abort the
    # interpreter's finalisation now and then ("terminate called without an active exception").
    gc.collect()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(results))


def _auto_interval(problem: Problem, rank: int, world: int) -> dict:
    """``measure_interval="auto"`` where the replicas' measurements cost differently: rank 1's clock makes
    every timed piece of its measurement look 2 ms longer, so the two vote for different intervals."""
    from adaptive.batchsize.gns import _schedule

    if rank == 1:
        ticks = iter(range(10 ** 9))
        _schedule._clock = lambda: time.perf_counter() + 0.002 * next(ticks)
    model = problem.model()
    optimizer = _two_groups(model)
    ddp = DistributedDataParallel(model)
    gns = GradientNoiseScale(optimizer, measure_interval="auto")
    gns.attach(ddp)
    gns.set_batch_config(init_batch_size=LOCAL_BSZ * world, local_bsz=LOCAL_BSZ)
    intervals, updates = [], []
    for step in range(REPLICA_STEPS):
        train(problem, ddp, optimizer, 1, 1, seed=1000 * step + 100 + rank)
        gns.flush()
        intervals.append(gns.measure_interval)
        updates.append(gns.num_updates)
    return {"intervals": intervals, "updates": updates, "noise_scale": gns.noise_scale()}


@pytest.mark.distributed
def test_two_replicas_converge_to_truth(tmp_path):
    port = portpicker.pick_unused_port()
    root = str(Path(adaptive.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(port), str(outs[r])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    deadline = time.monotonic() + 180
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0].decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    ranks = [json.loads(out.read_text()) for out in outs]
    assert ranks[0] == ranks[1]  # replica-averaged statistics: identical everywhere
    problem = Problem(seed=20)
    # "auto": both replicas measured the same steps at the interval they agreed on (the votes' rounded mean),
    # longer than one step since rank 1's measurement looks expensive; a measured step was folded in at each
    # change of the interval
    auto = ranks[0]["auto"]
    assert max(auto["intervals"]) > 1 and auto["updates"][-1] < REPLICA_STEPS / 2
    measured = [step for step in range(1, REPLICA_STEPS) if auto["updates"][step] > auto["updates"][step - 1]]
    assert all(b - a <= max(auto["intervals"]) for a, b in zip(measured, measured[1:]))
    assert math.isfinite(auto["noise_scale"]) and auto["noise_scale"] > 0
    for accum in ("1", "2", "1-view"):  # 1-view: DDP(gradient_as_bucket_view=True)
        result = ranks[0][accum]
        assert result["updates"] == REPLICA_STEPS
        assert relative_error(result["noise_scale"], problem.noise_scale()) < TOLERANCE, accum
        for group, (sqr, trace) in enumerate(problem.truth()):
            assert relative_error(result["sqr"][group], sqr) < TOLERANCE, (accum, group)
            assert relative_error(result["var"][group] * 2 * LOCAL_BSZ, trace) < TOLERANCE, (accum, group)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
