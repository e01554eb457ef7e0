"""One command that checks the library on the GPUs of one machine: gradients, noise scale, overhead.

    python benchmarks/gpu_check.py [--json PATH]          # one NCCL process per visible GPU
    python benchmarks/gpu_check.py --cpu 2 [--quick]      # the same checks on 2 gloo CPU processes

Every process trains, in turn, with :class:`adaptive.AdaptiveDataParallel`
(DDP) and :class:`adaptive.AdaptiveFSDP` (FSDP2), one job context per phase
(``adaptive.runtime.job.reset_job()`` in between, a checkpoint directory of
its own, no checkpoint saved mid-run):

1. **gradients** (fp32, TF32 off): one optimizer step of 2 micro-steps of the
   transformer of ``_transformer.py`` through an ``AdaptiveDataLoader``
   (token budgets of equal-length sequences, ``accumulation_steps=2``), each
   micro-batch's summed loss times ``loader.loss_weight``.  The full reduced
   gradient must equal the one-process gradient of the mean loss over exactly
   the samples all replicas trained (the dataset yields indices; they are
   gathered): relative error per parameter below 1e-4 on GPU, 1e-5 on CPU.
2. **noise scale**: linear regression ``y = w* . x + eps`` at fixed weights
   (SGD, lr 0), where ``B = tr(Sigma) / |G|^2`` has a closed form (below);
   ``model.gns.noise_scale()`` after training through the loader with
   ``accumulation_steps=2`` and ``gns_interval=1`` must be within 15% of it.
3. **overhead** (information, not pass/fail): median step time of
   AdaptiveDataParallel against plain DDP and of AdaptiveFSDP against plain
   ``fully_shard``, Adam, bf16 autocast, same fixed batches, alternating
   blocks of steps (as ``bench_fsdp.py``); targets 1.03 and 1.05.

Each check prints one line, PASS/FAIL (INFO for overhead) with its numbers;
all numbers go to ``benchmarks/results/gpu_check.json`` (``--json``).  Exit
status 1 if any check fails or does not finish.  Nothing can hang: every
collective has a timeout and the whole run a deadline (``--timeout``), after
which the workers are killed.

The closed form (as in ``tests/test_gns.py``): ``x ~ N(0, I_d)``,
``eps ~ N(0, sigma^2)``, loss ``(w . x - y)^2 / 2``, ``w = w* + delta``.  The
per-sample gradient is ``g = (delta . x - eps) x``, so ``G = E[g] = delta``,
``Sigma = (|delta|^2 + sigma^2) I + delta delta^T`` (Isserlis) and
``B = (d (|delta|^2 + sigma^2) + |delta|^2) / |delta|^2``.
"""
from __future__ import annotations

import time

START = time.monotonic()  # the run's elapsed time counts from here (before torch is imported)

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass
from pathlib import Path

import portpicker
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _transformer  # noqa: E402

KINDS = ("ddp", "fsdp")
LABELS = {"ddp": "AdaptiveDataParallel", "fsdp": "AdaptiveFSDP"}
PLAIN = {"ddp": "DDP", "fsdp": "fully_shard"}
TARGETS = {"ddp": 1.03, "fsdp": 1.05}
PHASES = [f"{check}/{kind}" for check in ("gradients", "noise_scale", "overhead") for kind in KINDS]
GNS_TOLERANCE = 0.15
D1, D2, SIGMA = 12, 20, 1.0  # the regression: two parameter blocks, noise level


@dataclass
class Config:
    """Sizes of one run (GPU defaults, or CPU dry-run sizes)."""

    device: str  # "cuda" or "cpu"
    world: int
    dim: int
    layers: int
    length: int  # tokens per sequence
    grad_micro: int  # sequences per replica per micro-step in the gradient check
    grad_tolerance: float
    gns_steps: int  # optimizer steps of the noise-scale check
    gns_micro: int  # samples per replica per micro-step
    bench_batch: int  # sequences per replica per step in the overhead check
    bench_blocks: int
    bench_steps: int  # steps per block
    autocast: bool
    collective_timeout: float
    deadline: float  # seconds for the whole run


def make_config(args: argparse.Namespace) -> Config:
    if args.cpu:
        quick = args.quick
        return Config(device="cpu", world=args.cpu, dim=32 if quick else 64, layers=2, length=16 if quick else 32,
                      grad_micro=4, grad_tolerance=1e-5, gns_steps=300 if quick else 400, gns_micro=16,
                      bench_batch=4, bench_blocks=4 if quick else 8, bench_steps=3 if quick else 5,
                      autocast=not args.no_cpu_autocast, collective_timeout=60.0,
                      deadline=args.timeout or (150.0 if quick else 300.0))
    world = torch.cuda.device_count()
    return Config(device="cuda", world=world, dim=256, layers=12, length=128, grad_micro=8,
                  grad_tolerance=1e-4, gns_steps=400, gns_micro=16,
                  bench_batch=16, bench_blocks=2 if args.quick else 8, bench_steps=5 if args.quick else 10,
                  autocast=True, collective_timeout=60.0, deadline=args.timeout or 280.0)


# ---------------------------------------------------------------- shared pieces
class IndexDataset(torch.utils.data.Dataset):
    """Yields its index: the step's samples can be gathered and the reference rebuilt from them."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def _synchronize(cfg: Config) -> None:
    if cfg.device == "cuda":
        torch.cuda.synchronize()


def _device(cfg: Config) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def _wrap(kind: str, net: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, **kwargs):
    import adaptive

    if kind == "ddp":
        if cfg.device == "cuda":
            kwargs["device_ids"] = [torch.cuda.current_device()]
        return adaptive.AdaptiveDataParallel(net, optimizer, **kwargs)
    return adaptive.AdaptiveFSDP(net, optimizer, **kwargs)


def _full_grad(kind: str, param: torch.nn.Parameter) -> torch.Tensor:
    grad = param.grad
    return grad.full_tensor() if kind == "fsdp" else grad


def _token_table(size: int, length: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, _transformer.VOCAB, (size, length + 1), generator=generator).to(device)


def _summed_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum")


# ---------------------------------------------------------------- 1. gradients
def check_gradients(kind: str, cfg: Config) -> dict:
    """One accumulated step through the loader against the one-process gradient of its samples."""
    import adaptive
    from adaptive.runtime import collectives

    device = _device(cfg)
    torch.manual_seed(0)
    net = _transformer.Transformer(dim=cfg.dim, layers=cfg.layers).to(device)
    reference = copy.deepcopy(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    model = _wrap(kind, net, optimizer, cfg, gns_interval=1)
    size = 4 * cfg.world * 2 * cfg.grad_micro
    table = _token_table(size, cfg.length, device)
    loader = adaptive.AdaptiveDataLoader(IndexDataset(size), max_tokens=cfg.grad_micro * cfg.length,
                                         lengths=[cfg.length] * size, accumulation_steps=2, shuffle=True, seed=5)
    seen: list[int] = []
    micro_steps = 0
    for index in loader:
        optimizer.zero_grad()
        (_summed_loss(model, table[index.to(device)]) * loader.loss_weight).backward()
        seen += index.tolist()
        micro_steps += 1
        if not loader.is_accumulation_step():
            grads = {name: _full_grad(kind, param).detach().clone() for name, param in model.module.named_parameters()}
            optimizer.step()
            break
    everyone = [i for part in collectives.allgather_object(seen) for i in part]
    result = {"samples": len(everyone), "unique": len(set(everyone)), "micro_steps": micro_steps,
              "tolerance": cfg.grad_tolerance, "parameters": _transformer.parameter_count(reference)}
    if dist.get_rank() == 0:
        _transformer.loss(reference, table[torch.tensor(everyone, device=device)]).backward()
        errors = {}
        diff_sq = ref_sq = 0.0
        for name, param in reference.named_parameters():
            diff = float((grads[name].float() - param.grad.float()).norm())
            norm = float(param.grad.float().norm())
            errors[name] = diff / max(norm, 1e-12)
            diff_sq, ref_sq = diff_sq + diff ** 2, ref_sq + norm ** 2
        worst = max(errors, key=errors.get)
        result.update(max_error=errors[worst], worst_parameter=worst, global_error=(diff_sq / ref_sq) ** 0.5,
                      errors=errors)
        result["passed"] = (result["max_error"] < cfg.grad_tolerance and micro_steps == 2
                            and result["unique"] == result["samples"] == 2 * cfg.world * cfg.grad_micro)
    return result


# ---------------------------------------------------------------- 2. noise scale
class _Part(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class SplitLinear(torch.nn.Module):
    """``x -> x[:, :D1] . a + x[:, D1:] . b``, the two blocks in a ModuleList (each its own FSDP unit)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList([_Part(weight[:D1]), _Part(weight[D1:])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts[0](x[:, :D1]) + self.parts[1](x[:, D1:])


def closed_form_noise_scale(delta: torch.Tensor) -> float:
    """``tr(Sigma) / |G|^2`` of the regression at ``w = w* + delta`` (module docstring)."""
    sqr = float(delta @ delta)
    return (delta.numel() * (sqr + SIGMA ** 2) + sqr) / sqr


def check_noise_scale(kind: str, cfg: Config) -> dict:
    """Noise scale measured while training at lr 0 through the loader, against the closed form."""
    import adaptive

    device = _device(cfg)
    generator = torch.Generator().manual_seed(20)
    w_star = torch.randn(D1 + D2, generator=generator)
    delta = 0.5 * torch.randn(D1 + D2, generator=generator)
    size = (cfg.gns_steps + 2) * cfg.world * 2 * cfg.gns_micro  # one epoch, every sample fresh
    x = torch.randn(size, D1 + D2, generator=generator)
    y = x @ w_star + SIGMA * torch.randn(size, generator=generator)
    x, y = x.to(device), y.to(device)
    net = SplitLinear(w_star + delta).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    model = _wrap(kind, net, optimizer, cfg, gns_interval=1)
    loader = adaptive.AdaptiveDataLoader(IndexDataset(size), max_tokens=cfg.gns_micro, lengths=[1] * size,
                                         accumulation_steps=2, shuffle=True, seed=6)
    steps = 0
    for index in loader:
        index = index.to(device)
        optimizer.zero_grad()
        (0.5 * ((model(x[index]) - y[index]) ** 2).sum() * loader.loss_weight).backward()
        optimizer.step()
        if not loader.is_accumulation_step():
            steps += 1
            if steps == cfg.gns_steps:
                break
    estimate, truth = float(model.gns.noise_scale()), closed_form_noise_scale(delta)
    error = abs(estimate / truth - 1.0)
    return {"noise_scale": estimate, "closed_form": truth, "relative_error": error, "tolerance": GNS_TOLERANCE,
            "steps": steps, "measurements": model.gns.num_updates, "global_batch": cfg.world * 2 * cfg.gns_micro,
            "passed": error < GNS_TOLERANCE and steps == cfg.gns_steps}


# ---------------------------------------------------------------- 3. overhead
def _build_overhead(kind: str, ours: bool, cfg: Config):
    device = _device(cfg)
    torch.manual_seed(0)
    net = _transformer.Transformer(dim=cfg.dim, layers=cfg.layers).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    if ours:
        model = _wrap(kind, net, optimizer, cfg)
        # What the loader tells the model before every step; set once (fixed batches, no loader).
        model.gns.set_batch_config(init_batch_size=cfg.world * cfg.bench_batch, local_bsz=cfg.bench_batch,
                                   accum_steps=1)
        return model, optimizer
    if kind == "ddp":
        ids = [torch.cuda.current_device()] if cfg.device == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(net, device_ids=ids), optimizer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(cfg.device, (cfg.world,))
    for layer in net.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters(), lr=1e-4)


def _timed_steps(model, optimizer, batches, steps: int, offset: int, cfg: Config) -> list[float]:
    times = []
    for i in range(steps):
        ids = batches[(offset + i) % len(batches)]
        _synchronize(cfg)
        start = time.perf_counter()
        with torch.autocast(cfg.device, dtype=torch.bfloat16, enabled=cfg.autocast):
            loss = _transformer.loss(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _synchronize(cfg)
        times.append(time.perf_counter() - start)
    return times


def check_overhead(kind: str, cfg: Config) -> dict:
    """Median step time, ours over plain, median of alternating block pairs (information only)."""
    built = {"plain": _build_overhead(kind, False, cfg), "ours": _build_overhead(kind, True, cfg)}
    batches = _transformer.batches(8, cfg.bench_batch, cfg.length, seed=dist.get_rank(), device=cfg.device)
    for name in ("plain", "ours"):  # warm-up: allocations, Adam state, the first noise measurements
        _timed_steps(*built[name], batches, 4, 0, cfg)
    times: dict[str, list[list[float]]] = {"plain": [], "ours": []}
    for block in range(cfg.bench_blocks):
        for name in (("plain", "ours") if block % 2 == 0 else ("ours", "plain")):
            times[name].append(_timed_steps(*built[name], batches, cfg.bench_steps, block * cfg.bench_steps, cfg))
    ratios = sorted(statistics.median(o) / statistics.median(p) for p, o in zip(times["plain"], times["ours"]))
    medians = {name: statistics.median(t for block in blocks for t in block) for name, blocks in times.items()}
    return {"ratio": statistics.median(ratios), "target": TARGETS[kind], "block_ratios": ratios,
            "median_ms": {name: 1e3 * value for name, value in medians.items()},
            "measurements": built["ours"][0].gns.num_updates, "autocast_bf16": cfg.autocast,
            "params": _transformer.parameter_count(_transformer.Transformer(dim=cfg.dim, layers=cfg.layers)),
            "tokens_per_replica": cfg.bench_batch * cfg.length, "passed": None}


CHECKS = {"gradients": check_gradients, "noise_scale": check_noise_scale, "overhead": check_overhead}


# ---------------------------------------------------------------- worker
def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def _worker(rank: int, cfg: Config, port: int, out: str, started: float) -> None:
    out_dir = Path(out)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(cfg.world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), ADAPTIVE_CHECKPOINT_INTERVAL="0", ADAPTIVE_METRICS_INTERVAL="0",
                      ADAPTIVE_PROGRESS_INTERVAL="0", ADAPTIVE_SHARE_PATH=str(out_dir / "share"),
                      ADAPTIVE_COLLECTIVE_TIMEOUT=str(cfg.collective_timeout))
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world))
    import adaptive
    from adaptive.runtime import collectives
    from adaptive.runtime.job import reset_job

    backend = "nccl" if cfg.device == "cuda" else "gloo"
    adaptive.init_process_group(backend, timeout=cfg.collective_timeout)
    results: dict[str, dict] = {}
    for number, phase in enumerate(PHASES):
        check, kind = phase.split("/")
        if number:  # one wrapper per job context: forget the previous phase's loaders and models
            reset_job()
            adaptive.init_process_group(backend)  # the new job's control groups (the default group stays)
        os.environ["ADAPTIVE_CHECKPOINT_PATH"] = str(out_dir / "checkpoints" / phase.replace("/", "-"))
        start = time.monotonic()
        try:
            result = CHECKS[check](kind, cfg)
        except Exception as error:  # the same failure on every rank (a symmetric one) lets the run go on
            result = {"passed": False, "error": f"{type(error).__name__}: {error}",
                      "traceback": traceback.format_exc()}
        result["seconds"] = time.monotonic() - start
        failures = [r for r in collectives.allgather_object(result.get("error")) if r]
        if failures and "error" not in result:
            result.update(passed=False, error=f"another rank failed: {failures[0]}")
        if rank == 0:
            results[phase] = result
            _write_json(out_dir / "results.json", results)
            print(f"  [{time.time() - started:6.1f} s] {phase} done in {result['seconds']:.1f} s", flush=True)
    collectives.barrier()
    dist.destroy_process_group()  # while the interpreter is intact (gloo aborts if left to teardown)


# ---------------------------------------------------------------- parent
def _run_workers(cfg: Config, out: str) -> str | None:
    """Start one process per GPU (or CPU replica); None when all exited cleanly, else what went wrong."""
    from adaptive.runtime.process_tree import kill_process_tree

    started = time.time() - (time.monotonic() - START)  # wall clock at START, for the workers' progress lines
    context = mp.start_processes(_worker, args=(cfg, portpicker.pick_unused_port(), out, started),
                                 nprocs=cfg.world, join=False, start_method="spawn")
    deadline = START + cfg.deadline
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        kill_process_tree(process.pid)
                return f"the run passed its deadline of {cfg.deadline:.0f} s; workers killed"
    except Exception as error:  # a worker died or raised; join has already stopped the others
        return f"{type(error).__name__}: {error}"
    return None


def _report(phase: str, result: dict | None) -> tuple[str, str]:
    """(status, line) of one phase."""
    check, kind = phase.split("/")
    label = LABELS[kind]
    if result is None:
        return "FAIL", f"FAIL {check:<12}{label:<22}did not finish"
    status = "PASS" if result.get("passed") else ("INFO" if result.get("passed") is None else "FAIL")
    if "error" in result:
        return "FAIL", f"FAIL {check:<12}{label:<22}{result['error']}"
    seconds = f" [{result['seconds']:.1f} s]"
    if check == "gradients":
        line = (f"max relative error {result['max_error']:.2e} ({result['worst_parameter']}), overall "
                f"{result['global_error']:.2e}, tolerance {result['tolerance']:.0e}; {result['samples']} samples "
                f"({result['unique']} distinct), {result['micro_steps']} micro-steps, "
                f"{result['parameters'] / 1e6:.2f}M params")
    elif check == "noise_scale":
        line = (f"{result['noise_scale']:.2f} vs closed form {result['closed_form']:.2f}: error "
                f"{100 * result['relative_error']:.1f}% (tolerance {100 * result['tolerance']:.0f}%), "
                f"{result['steps']} steps of {result['global_batch']} samples, {result['measurements']} measurements")
    else:
        ms = result["median_ms"]
        quartiles = result["block_ratios"][len(result["block_ratios"]) // 4], \
            result["block_ratios"][(3 * len(result["block_ratios"])) // 4]
        line = (f"{result['ratio']:.3f}x {PLAIN[kind]} (target {result['target']:.2f}; quartiles "
                f"{quartiles[0]:.3f}-{quartiles[1]:.3f}); median {ms['ours']:.1f} vs {ms['plain']:.1f} ms, "
                f"{len(result['block_ratios'])} block pairs, {result['measurements']} noise measurements, "
                f"{'bf16 autocast' if result['autocast_bf16'] else 'no autocast (fp32)'}")
    return status, f"{status} {check:<12}{label:<22}{line}{seconds}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", type=int, default=0, metavar="N",
                        help="dry run on N gloo CPU processes (small model) instead of the GPUs")
    parser.add_argument("--quick", action="store_true", help="fewer steps and a smaller CPU model (a smoke run)")
    parser.add_argument("--no-cpu-autocast", action="store_true",
                        help="with --cpu: time the overhead in fp32 instead of CPU bf16 autocast")
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="seconds for the whole run before the workers are killed (default 280 GPU, 150 "
                             "CPU quick, 300 CPU)")
    parser.add_argument("--json", default=str(HERE / "results" / "gpu_check.json"))
    args = parser.parse_args()
    if args.cpu < 0:
        parser.error("--cpu must be >= 1")
    if not args.cpu and not torch.cuda.is_available():
        print("no GPU visible; run `python benchmarks/gpu_check.py --cpu 2` for the CPU dry run", file=sys.stderr)
        return 2
    cfg = make_config(args)
    where = f"{cfg.world} x {torch.cuda.get_device_name(0)} (NCCL)" if cfg.device == "cuda" \
        else f"{cfg.world} CPU processes (gloo)"
    print(f"gpu_check on {where}: transformer dim {cfg.dim} x {cfg.layers} layers, {cfg.length} tokens per "
          f"sequence; deadline {cfg.deadline:.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as out:
        problem = _run_workers(cfg, out)
        path = Path(out, "results.json")
        results = json.loads(path.read_text()) if path.exists() else {}
    statuses = []
    for phase in PHASES:
        status, line = _report(phase, results.get(phase))
        statuses.append(status)
        print(line)
    elapsed = time.monotonic() - START
    failed = problem is not None or "FAIL" in statuses
    if problem is not None:
        print(f"FAIL workers: {problem}")
    print(f"{'FAILED' if failed else 'PASSED'}: {statuses.count('PASS')} passed, {statuses.count('FAIL')} failed; "
          f"elapsed {elapsed:.1f} s (deadline {cfg.deadline:.0f} s)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    _write_json(Path(args.json), {"config": asdict(cfg), "device": where, "elapsed_s": elapsed,
                                  "passed": not failed, "workers_error": problem, "results": results})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
