"""Gradient noise scale estimate against the analytic truth, over replicas and accumulation.

Problem (as in tests/test_gns.py): linear regression ``y = w* . x + eps``,
``x ~ N(0, I_d)``, ``eps ~ N(0, sigma^2)``, loss ``(w . x - y)^2 / 2``, weights
fixed at ``w = w* + delta`` (learning rate 0).  Then ``|G|^2 = |delta|^2``
and ``tr(Sigma) = d (|delta|^2 + sigma^2) + |delta|^2``, so the true noise
scale is ``tr(Sigma) / |G|^2``.

For every (replicas, accumulation steps) cell, ``replicas`` gloo processes
train a plain DDP model with :class:`adaptive.batchsize.gns.GradientNoiseScale`
attached exactly as AdaptiveDataParallel does, and the estimate after
``--steps`` optimizer steps is compared with the truth (the baseline):
the table reports estimate / truth for the noise scale, ``|G|^2`` and
``tr(Sigma)``, averaged over ``--seeds`` independent data streams, with the
spread over seeds.  It also reports the wall time per step with and without
the estimator on this tiny model (so the ratio is the estimator's fixed
per-step cost, not a realistic overhead).

    python benchmarks/bench_gns_accuracy.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIM, SIGMA, LOCAL_BSZ = 32, 1.0, 16


def _problem():
    import torch

    gen = torch.Generator().manual_seed(0)
    w_star = torch.randn(DIM, generator=gen)
    delta = 0.5 * torch.randn(DIM, generator=gen)
    sqr = float(delta @ delta)
    trace = DIM * (sqr + SIGMA ** 2) + sqr
    return w_star, delta, sqr, trace


def _run_cell(ddp_cls, accum: int, steps: int, seed: int, rank: int, world: int, measure: bool) -> dict:
    import torch

    from adaptive.batchsize.gns import GradientNoiseScale

    w_star, delta, _, _ = _problem()
    model = torch.nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ddp = ddp_cls(model)
    gns = None
    if measure:
        gns = GradientNoiseScale(optimizer)
        gns.attach(ddp)
        gns.set_batch_config(init_batch_size=LOCAL_BSZ * world, local_bsz=LOCAL_BSZ, accum_steps=accum)
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        for micro in range(accum):
            x = torch.randn(LOCAL_BSZ, DIM, generator=gen)
            y = x @ w_star + SIGMA * torch.randn(LOCAL_BSZ, generator=gen)
            with (torch.enable_grad() if micro == accum - 1 else ddp.no_sync()):
                (0.5 * ((ddp(x).squeeze(1) - y) ** 2).mean()).backward()
        if gns is not None:
            gns.gain()  # what the scaling rule reads every step
        optimizer.step()
    seconds = (time.perf_counter() - start) / steps
    if gns is None:
        return {"ms_per_step": 1e3 * seconds}
    return {"ms_per_step": 1e3 * seconds, "noise_scale": gns.noise_scale(), "sqr": gns.sqr_avg(),
            "trace": gns.var_avg() * gns.config.init_batch_size, "updates": gns.num_updates}


def worker(rank: int, world: int, port: int, out: str, steps: int, seeds: int, accums: list) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = {}
    for accum in accums:
        runs = []
        for seed in range(seeds):
            plain = _run_cell(DistributedDataParallel, accum, steps, seed, rank, world, measure=False)
            measured = _run_cell(DistributedDataParallel, accum, steps, seed, rank, world, measure=True)
            measured["plain_ms_per_step"] = plain["ms_per_step"]
            runs.append(measured)
        results[str(accum)] = runs
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(results))


def _launch(world: int, steps: int, seeds: int, accums: list, timeout: float) -> dict:
    import portpicker

    port = portpicker.pick_unused_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(world)]
        cmd = [sys.executable, __file__, "--worker", "--steps", str(steps), "--seeds", str(seeds),
               "--accums", ",".join(map(str, accums))]
        procs = [subprocess.Popen(cmd + ["--rank", str(r), "--world", str(world), "--port", str(port),
                                         "--result", str(outs[r])], env=env) for r in range(world)]
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"workers for {world} replicas failed: {[p.returncode for p in procs]}")
        return json.loads(outs[0].read_text())


def _summary(runs: list, sqr: float, trace: float) -> dict:
    truth = trace / sqr

    def stats(values):
        return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)

    ns_mean, ns_std = stats([r["noise_scale"] / truth for r in runs])
    sqr_mean, _ = stats([r["sqr"] / sqr for r in runs])
    tr_mean, _ = stats([r["trace"] / trace for r in runs])
    ms = statistics.fmean(r["ms_per_step"] for r in runs)
    plain = statistics.fmean(r["plain_ms_per_step"] for r in runs)
    return {"noise_scale_ratio": ns_mean, "noise_scale_ratio_std": ns_std, "sqr_ratio": sqr_mean,
            "trace_ratio": tr_mean, "max_abs_noise_scale_error": max(abs(r["noise_scale"] / truth - 1) for r in runs),
            "estimate_mean": statistics.fmean(r["noise_scale"] for r in runs), "truth": truth,
            "updates": runs[0]["updates"], "ms_per_step": ms, "plain_ms_per_step": plain,
            "time_ratio": ms / plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and seeds, replicas 1 and 2 only")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gns_accuracy.json"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--replicas", default=None, help="comma-separated replica counts (default 1,2,4)")
    parser.add_argument("--accums", default="1,2,4")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    accums = [int(v) for v in args.accums.split(",")]
    steps = args.steps or (150 if args.quick else 500)
    seeds = args.seeds or (1 if args.quick else 3)
    if args.worker:
        worker(args.rank, args.world, args.port, args.result, steps, seeds, accums)
        return
    replicas = [int(v) for v in (args.replicas or ("1,2" if args.quick else "1,2,4")).split(",")]
    _, _, sqr, trace = _problem()
    rows = []
    for world in replicas:
        started = time.perf_counter()
        results = _launch(world, steps, seeds, accums, args.timeout)
        for accum in accums:
            row = {"replicas": world, "accum_steps": accum, "estimator":
                   "differenced" if world * accum == 1 else "replicas+micro-steps"}
            row.update(_summary(results[str(accum)], sqr, trace))
            rows.append(row)
        print(f"# {world} replica(s) done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    header = (f"{'replicas':>8} {'accum':>5} {'estimator':>20} {'B_est/B':>9} {'+-':>6} {'|G|^2':>7} "
              f"{'trSig':>7} {'max|err|':>8} {'ms/step':>8} {'plain':>7} {'ratio':>6}")
    print(f"GNS accuracy vs analytic truth (B = {trace / sqr:.2f} samples; {steps} steps, {seeds} seed(s), "
          f"local batch {LOCAL_BSZ}, reference batch {LOCAL_BSZ} x replicas)")
    print(header)
    for r in rows:
        print(f"{r['replicas']:>8} {r['accum_steps']:>5} {r['estimator']:>20} {r['noise_scale_ratio']:>9.3f} "
              f"{r['noise_scale_ratio_std']:>6.3f} {r['sqr_ratio']:>7.3f} {r['trace_ratio']:>7.3f} "
              f"{r['max_abs_noise_scale_error']:>8.3f} {r['ms_per_step']:>8.2f} {r['plain_ms_per_step']:>7.2f} "
              f"{r['time_ratio']:>6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "gns_accuracy", "steps": steps, "seeds": seeds, "dim": DIM,
                               "sigma": SIGMA, "local_bsz": LOCAL_BSZ, "true_noise_scale": trace / sqr,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
