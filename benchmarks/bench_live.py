"""Live membership changes (``adaptive-run --live``): what a join, a leave and a lost worker cost.

One trial runs the model of ``bench_restart.py`` (a 2.1M-parameter MLP with
Adam; ``--quick``: 0.5M) on one live node, then:

1. **join**: a second node starts; measured are the survivor's pause (the
   longest step interval around the change, less the median step) and the
   joiner's first step counted from the moment its Python process had
   imported torch (a worker forked from the pre-warmed process has torch
   imported from its first instant), and counted from its launcher's start.
   The joiner is started ahead of the change (it asks to join once it is
   up), so *the change to the first step at the new size* is the planned
   rescale's cost: the gap in the survivor's steps;
2. **leave**: SIGTERM to the second node; the survivor's pause;
3. **lost worker**: SIGKILL of the second node's worker; the survivor's
   pause (it re-forms alone and goes back to the last committed step; the
   steps from the restart's join on, whose own pause is a join's, are not
   counted), the committed steps it trained again (goal: none) and the
   steps in flight it discarded (at most one), and the time until the killed
   worker's restart trains with it again; the bytes each member keeps for a
   lost peer (its live copies, ``State.live_copy``) against a copy of every
   state (what the in-memory snapshots of earlier versions held, every 2 s),
   as pickled bytes;
4. **steady state**: the median step time with two members against plain
   DDP with a plain DataLoader on ``torchrun`` (2 processes, gloo), and
   against the same script under plain ``torchrun`` without ``--live`` (so
   that what live mode adds is told apart from what the library's noise
   scale and loader cost), all measured in the same trial; the same ratios
   of the mean step times (the throughput: the steps that measure the noise
   scale, which a median leaves out, count there), and the noise-scale
   interval the members agreed (``gns_interval="auto"``).  The ratios are
   taken within each trial, then their median over the trials.  No periodic
   checkpoint is written in the windows measured (the default interval).

The workers read the library's modules compiled ahead, as an installed
package's are (the benchmark compiles them into a temporary
``PYTHONPYCACHEPREFIX``, also under ``PYTHONDONTWRITEBYTECODE=1``).

When ``import torchft`` works (a benchmark-only option: ``pip install
torchft``; the library never depends on it), each trial also trains the same
model under TorchFT (``workers/torchft_bench_worker.py``): two replica groups
of one process, each under its own ``torchrun --max-restarts=1``, TorchFT's
Lighthouse on 127.0.0.1 (a quorum needs one group; a group that stops
heartbeating is dead after ``TORCHFT_HEARTBEAT_TIMEOUT_MS``), its Manager,
``DistributedDataParallel``, ``OptimizerWrapper`` and ``ProcessGroupGloo``,
state copied from the live peer over that group on recovery (``PGTransport``);
its Rust logs at ``warn`` (``info`` writes several lines a step).  Measured
in the table's ``torchft`` column: the step time with both groups (and its
ratio to the plain DDP of the same trial), the survivor's pause when the
other group's worker is SIGKILLed, the kill to the restarted worker's first
step in the quorum (its torchrun restarts it; it heals from the survivor), and
the survivor's pause at that rejoin.  A survivor that crashes instead is
reported as such.

Live workers are forks of their node's pre-warmed process, as by default;
``--cold-start`` runs them as new interpreters, for comparison.

    python benchmarks/bench_live.py [--quick] [--trials N] [--json PATH] [--no-torchft] [--cold-start]
                                    [--loader-workers N] [--shard-size N] [--commit-cost]

``--commit-cost`` measures only what the step commit (a vote on the store
before every optimizer step, small copies after it) costs per step: live
jobs of two nodes with ``ADAPTIVE_LIVE_RECOVERY=memory`` against the same
with ``restart``, in pairs whose order alternates (goal: at most 1.02x).

``--shard-size N`` compares a join and a leave of the model under
``AdaptiveFSDP`` on ``sharding_mesh(N)`` with the same changes under
``AdaptiveDataParallel``, trials alternating (goal: the sharded pauses
within 2x of DDP's).

Prints a table; writes JSON (default ``benchmarks/results/bench_live.json``).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from adaptive.runtime.process_tree import kill_process_tree  # noqa: E402

WORKER = HERE / "workers" / "live_bench_worker.py"
TORCHFT_WORKER = HERE / "workers" / "torchft_bench_worker.py"
#: how long TorchFT's Lighthouse waits for a silent replica group before it forms a quorum without it (its
#: default is 5000 ms); a survivor cannot go on alone before that (half of the groups it knows are alive is no quorum)
TORCHFT_HEARTBEAT_TIMEOUT_MS = 500
#: the table's rows with a TorchFT figure: our measure -> TorchFT's comparable one
TORCHFT_ROWS = {"survivor pause at a join": "survivor pause at the restarted group's rejoin",
                "survivor pause at a lost worker": "survivor pause at a lost group",
                "lost worker: kill to its restart's first step": "lost group: kill to its restart's first step",
                "step time, 2 live members": "step time, 2 replica groups",
                "steady state live / plain DDP": "steady state torchft / plain DDP"}
#: TorchFT's kill-to-first-step when its survivor crashed: both groups were restarted, the state was lost
CRASHED_BACK = "survivor crashed: kill to both groups training again"
GOALS = {"survivor pause at a lost worker": 0.3, "joiner first step from import torch": 1.0,
         "planned rescale (change to first step at 2)": 1.0, "survivor pause at a leave": 0.3,
         "steady state live / plain DDP": 1.02, "steady state live / plain DDP (mean steps)": 1.02}


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _steps(out: Path) -> dict[int, list[dict]]:
    found = {}
    for path in out.glob("steps.*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
        found[int(path.name.split(".")[1])] = lines
    return found


def _environment(out: Path, width: int, **extra: str) -> dict[str, str]:
    """The workers' environment; gloo's traffic stays on the loopback interface."""
    return dict(os.environ, WORKER_OUT=str(out), ADAPTIVE_CHECKPOINT_PATH=str(out / "ckpt"), BENCH_WIDTH=str(width),
                OMP_NUM_THREADS="1", ADAPTIVE_COLLECTIVE_TIMEOUT="30", GLOO_SOCKET_IFNAME="lo",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **extra)


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as handle:
        return subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def _pause(times: list[float], at: float) -> tuple[float, float]:
    """(longest step interval within 3 steps of ``at``, less the median interval; that longest interval)."""
    intervals = [(b, b - a) for a, b in zip(times, times[1:])]
    median = statistics.median(d for _, d in intervals)
    near = [d for end, d in intervals if at - 3 * median <= end <= at + 3 * median + 2.0]
    longest = max(near) if near else float("nan")
    return longest - median, longest


def live_trial(width: int, cold_start: bool = False, shard_size: int = 0) -> dict:
    """One live trial (module docstring); ``shard_size``: the model under ``AdaptiveFSDP`` on
    ``sharding_mesh(shard_size)``, a join and a leave only (a lost member of a 1-D FSDP job restarts everyone)."""
    import portpicker

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = _environment(out, width, **({"BENCH_SHARD_SIZE": str(shard_size)} if shard_size else {}))
        port = portpicker.pick_unused_port()
        cmd = [sys.executable, "-m", "adaptive.elastic.launcher", "--live", "--nnodes", "1:2", "--nproc-per-node",
               "1", "--max-restarts", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
               *(["--cold-start"] if cold_start else []), str(WORKER)]
        first = _start(cmd, env, out / "first.log")
        second = None
        try:
            _wait(lambda: sum(len(v) for v in _steps(out).values()) >= 30, 120, "the first node to train")
            (survivor,) = _steps(out)
            launched = time.time()
            second = _start(cmd, env, out / "second.log")
            _wait(lambda: len([s for s in _steps(out).get(survivor, []) if s["world"] == 2]) >= 240, 120, "the join")
            steps = _steps(out)
            joiner = next(pid for pid in steps if pid != survivor)
            mine = steps[survivor]
            change = next(s["time"] for s in mine if s["world"] == 2)
            last_alone = max(s["time"] for s in mine if s["world"] == 1)
            join_pause, _ = _pause([s["time"] for s in mine], change)
            start = json.loads((out / f"start.{joiner}.json").read_text())
            joiner_first = steps[joiner][0]["time"] - start["torch"]
            joiner_launched = steps[joiner][0]["time"] - launched
            joiner_library = steps[joiner][0]["time"] - start["built"]
            two = [b["time"] - a["time"] for a, b in zip(mine, mine[1:]) if a["world"] == b["world"] == 2][40:]
            intervals = [s["gns_interval"] for s in mine if s["world"] == 2][40:]
            left_at = time.time()
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=60)
            _wait(lambda: len([s for s in _steps(out)[survivor] if s["time"] > left_at and s["world"] == 1]) >= 10,
                  60, "steps after the leave")
            mine = _steps(out)[survivor]
            after_leave = next(s["time"] for s in mine if s["time"] > left_at and s["world"] == 1)
            leave_pause, _ = _pause([s["time"] for s in mine], after_leave)
            if shard_size:
                return {"survivor pause at a join": join_pause, "survivor pause at a leave": leave_pause,
                        "planned rescale (change to first step at 2)": change - last_alone,
                        "step time, 2 live members": statistics.median(two)}
            # a lost worker: a third node joins, its worker is killed
            second = _start(cmd, env, out / "third.log")
            _wait(lambda: len([s for s in _steps(out)[survivor] if s["time"] > after_leave and s["world"] == 2])
                  >= 10, 120, "the second join")
            victim = next(pid for pid in _steps(out) if pid not in (survivor, joiner))
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            before = {survivor, joiner, victim}
            _wait(lambda: any(pid not in before and v for pid, v in _steps(out).items()), 120,
                  "the lost worker to be back")
            back = min(v[0]["time"] for pid, v in _steps(out).items() if pid not in before and v)
            mine = _steps(out)[survivor]
            after_kill = next(s["time"] for s in mine if s["time"] > killed)
            # the restart joins soon after (0.4 s when forked): the pause of its join is not the loss's
            alone = next((s["time"] for s in mine if s["time"] > killed and s["world"] == 1), None)
            rejoined = next((s["time"] for s in mine if alone and s["time"] > alone and s["world"] == 2), math.inf)
            loss_pause, _ = _pause([s["time"] for s in mine if s["time"] < rejoined], after_kill)
            trained = [s["step"] for s in mine if s["time"] <= killed and not s["discarded"]]
            again = [s for s in mine if s["time"] > killed and not s["discarded"] and s["step"] <= max(trained)]
            discarded = [s for s in mine if s["time"] > killed - 1.0 and s["discarded"]]
            memory = json.loads((out / f"memory.{survivor}.json").read_text())
            return {"survivor pause at a join": join_pause,
                    "joiner first step from import torch": joiner_first,
                    "joiner first step from its launcher's start": joiner_launched,
                    "joiner first step from its model and optimizer built": joiner_library,
                    "planned rescale (change to first step at 2)": change - last_alone,
                    "survivor pause at a leave": leave_pause,
                    "survivor pause at a lost worker": loss_pause,
                    "lost worker: committed steps trained again": len(again),
                    "lost worker: steps in flight discarded": len(discarded),
                    "bytes kept per member: a copy of every state": memory["whole state copy"],
                    "bytes kept per member: live copies": memory["live copies"],
                    "lost worker: kill to its restart's first step": back - killed,
                    "step time, 2 live members": statistics.median(two),
                    "mean step time, 2 live members": statistics.mean(two),
                    "noise-scale interval with 2 members (steps)": statistics.median(intervals)}
        except (RuntimeError, StopIteration) as error:  # a wait timed out, or no step of the survivor after a change
            return {"failed": str(error) or f"{type(error).__name__}: the survivor logged no step after a change",
                    "log": (out / "first.log").read_text(errors="replace")[-3000:]}
        finally:
            for proc in (first, second):
                if proc is not None:
                    kill_process_tree(proc.pid)
                    proc.wait()


def commit_cost_trial(width: int, recovery: str, steps: int = 300) -> float:
    """The median step time of a live job of two single-worker nodes formed together, with
    ``ADAPTIVE_LIVE_RECOVERY=recovery``: ``memory`` votes on the store before every optimizer step and keeps
    the live copies, ``restart`` does neither; everything else is the same."""
    import portpicker

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = _environment(out, width, ADAPTIVE_LIVE_RECOVERY=recovery,
                           BENCH_STEPS=str(steps))
        port = portpicker.pick_unused_port()
        cmd = [sys.executable, "-m", "adaptive.elastic.launcher", "--live", "--nnodes", "2", "--nproc-per-node",
               "1", "--rdzv-endpoint", f"127.0.0.1:{port}", str(WORKER)]
        nodes = [_start(cmd, env, out / f"node{i}.log") for i in range(2)]
        try:
            for node in nodes:
                node.wait(timeout=300)
        finally:
            for node in nodes:
                kill_process_tree(node.pid)
                node.wait()
        times = [s["time"] for s in min(_steps(out).values(), key=len)]
        return statistics.median([b - a for a, b in zip(times, times[1:])][40:])


def vote_round_trip(rounds: int = 2000) -> float:
    """Seconds per vote of two members on a store on 127.0.0.1, by the calls ``step_commit`` makes (one ``add``;
    then the last voter ``delete_key`` and ``compare_set``, the other ``wait`` and ``get``), each member a thread
    with its own connection: the vote's own cost, which the end-to-end pairs cannot resolve on a noisy machine."""
    import datetime
    import threading

    import portpicker
    import torch.distributed as dist

    port = portpicker.pick_unused_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False) for _ in range(2)]
    started = threading.Barrier(2)

    def member(store: dist.TCPStore) -> None:
        started.wait()
        for vote in range(1, rounds + 1):
            slot = f"decision/{vote % 2}"
            if store.add("votes", 1) == 2 * vote:
                store.delete_key(f"decision/{(vote + 1) % 2}")
                store.compare_set(slot, "", f"{vote}:commit")
            else:
                store.wait([slot], datetime.timedelta(seconds=5))
                store.get(slot)

    threads = [threading.Thread(target=member, args=(client,)) for client in clients]
    begun = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - begun
    del server
    return elapsed / rounds


def _run_commit_cost(args: argparse.Namespace) -> None:
    """``--commit-cost``: what the step commit costs a live job per step, ``memory`` against ``restart``
    recovery, in pairs of runs whose order alternates (machine noise hits both alike)."""
    width = 512 if args.quick else 1024
    pairs = []
    for trial in range(1 if args.quick else args.trials):
        order = ("memory", "restart") if trial % 2 == 0 else ("restart", "memory")
        pair = {recovery: commit_cost_trial(width, recovery) for recovery in order}
        pairs.append(pair)
    ratios = [pair["memory"] / pair["restart"] for pair in pairs]
    vote = vote_round_trip()
    print(f"step commit cost, live job of 2 single-worker nodes, gloo, MLP {width}: median step time with the "
          f"commit (ADAPTIVE_LIVE_RECOVERY=memory) / without (restart), {len(pairs)} alternating pairs")
    for pair, ratio in zip(pairs, ratios):
        print(f"  memory {1e3 * pair['memory']:.1f} ms, restart {1e3 * pair['restart']:.1f} ms: {ratio:.3f}")
    print(f"median ratio {statistics.median(ratios):.3f} (goal <= 1.02)")
    print(f"a vote of two members alone (the store calls of step_commit, 2 threads): {1e3 * vote:.3f} ms")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"pairs": pairs, "ratios": ratios, "vote_s": vote,
                                           "median ratio": statistics.median(ratios)}, indent=2))


def torchrun_trial(width: int, plain: bool) -> dict:
    """The median step time of 2 processes under plain torchrun: plain DDP, or the library without ``--live``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = _environment(out, width, BENCH_PLAIN="1" if plain else "0", BENCH_STEPS="240")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
        proc = _start(cmd, env, out / "log.txt")
        try:
            proc.wait(timeout=300)
        finally:
            kill_process_tree(proc.pid)
        steps = _steps(out)
        times = [s["time"] for s in min(steps.values(), key=len)]
        intervals = [b - a for a, b in zip(times, times[1:])][40:]
        key = "plain DDP" if plain else "2 members without --live"
        return {f"step time, {key}": statistics.median(intervals), f"mean step time, {key}": statistics.mean(intervals)}


#: The steady-state ratios: (name, numerator, denominator), of the median step time and of the mean one
RATIOS = [("steady state live / plain DDP", "2 live members", "plain DDP"),
          ("steady state without --live / plain DDP", "2 members without --live", "plain DDP"),
          ("steady state live / without --live", "2 live members", "2 members without --live")]


def _steady_state_ratios(run: dict) -> dict:
    """A trial's step-time ratios: of the median steps, and of the mean ones (the throughput's inverse:
    the measured steps of the noise scale, which the median leaves out, count there)."""
    ratios = {}
    for name, over, under in RATIOS:
        ratios[name] = run[f"step time, {over}"] / run[f"step time, {under}"]
        ratios[f"{name} (mean steps)"] = run[f"mean step time, {over}"] / run[f"mean step time, {under}"]
    return ratios


def torchft_status() -> str | None:
    """None when ``import torchft`` works in this interpreter, else why not (``"not installed"``, or its error)."""
    if importlib.util.find_spec("torchft") is None:
        return "not installed"
    probe = subprocess.run([sys.executable, "-c", "import torchft"], capture_output=True, text=True, timeout=300)
    return None if probe.returncode == 0 else "not importable: " + (probe.stderr.strip().splitlines() or ["?"])[-1]


def torchft_trial(width: int) -> dict:
    """The same model under TorchFT: steady state with 2 replica groups, then SIGKILL of group 1's worker."""
    import portpicker

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        port = portpicker.pick_unused_port()
        env = _environment(out, width, RUST_LOG="warn", TORCHFT_LIGHTHOUSE_PORT=str(port),
                           TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}",
                           TORCHFT_HEARTBEAT_TIMEOUT_MS=str(TORCHFT_HEARTBEAT_TIMEOUT_MS))
        procs = [_start([sys.executable, str(TORCHFT_WORKER), "lighthouse"], env, out / "lighthouse.log")]

        def group(number: int) -> dict[int, list[dict]]:
            return {pid: steps for pid, steps in _steps(out).items() if steps and steps[0]["group"] == number}

        try:
            for number in range(2):
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
                       "--max-restarts=1", "--master-addr=127.0.0.1", f"--master-port={portpicker.pick_unused_port()}",
                       str(TORCHFT_WORKER)]
                procs.append(_start(cmd, dict(env, REPLICA_GROUP=str(number)), out / f"group{number}.log"))
            _wait(lambda: len([s for v in group(0).values() for s in v if s["participants"] == 2]) >= 40, 120,
                  "both TorchFT replica groups to train")
            ((survivor, mine),) = group(0).items()
            (victim,) = group(1)
            both = [b["time"] - a["time"] for a, b in zip(mine, mine[1:])
                    if a["participants"] == b["participants"] == 2]
            result = {"step time, 2 replica groups": statistics.median(both[5:])}
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            crash = out / f"error.{survivor}.txt"

            def back() -> float | None:
                """The first step that the restarted worker trains in, with the survivor, in the quorum."""
                times = [s["time"] for pid, v in group(1).items() if pid != victim for s in v
                         if s["participating"] and s["committed"] and s["participants"] == 2]
                return min(times, default=None)

            rejoined = _wait(back, 120, "the lost TorchFT group to be back")
            if crash.exists():  # its torchrun restarted it too: both start again
                lines = crash.read_text().strip().splitlines()
                _, path, line = next(s for s in reversed(lines) if s.strip().startswith("File ")).split('"', 2)
                site = f"{lines[-1]} at `{lines[-2].strip()}`, {'/'.join(Path(path).parts[-2:])}{line}"
                first = min((s for pid, v in group(1).items() if pid != victim for s in v), key=lambda s: s["time"])
                return {**result, "survivor crashed": site, CRASHED_BACK: rejoined - killed,
                        "step at the kill": group(0)[survivor][-1]["step"],
                        "step the restarted groups went on from": first["step"], "log": "\n".join(lines[-4:])}
            _wait(lambda: len([s for s in group(0)[survivor] if s["time"] > rejoined]) >= 20, 60,
                  "steps after the rejoin")
            restarted = next(pid for pid in group(1) if pid != victim)
            ready = float((out / f"ready.{restarted}").read_text())
            mine = group(0)[survivor]
            times = [s["time"] for s in mine]
            lost, _ = _pause([t for t in times if t <= ready], next(t for t in times if t > killed))
            rejoin, _ = _pause(times, next(s["time"] for s in mine if s["time"] > ready and s["participants"] == 2))
            return {**result, "survivor pause at a lost group": lost,
                    "lost group: kill to its restart's first step": rejoined - killed,
                    "survivor pause at the restarted group's rejoin": rejoin}
        except (RuntimeError, ValueError, StopIteration) as error:  # a wait timed out, or a group restarted early
            return {"failed": f"{type(error).__name__}: {error}",
                    "log": (out / "group0.log").read_text(errors="replace")[-3000:]}
        finally:
            for proc in procs:
                kill_process_tree(proc.pid)
                proc.wait()


def _torchft_summary(trials: list[dict], plain: float | None) -> dict:
    """Medians over the TorchFT trials that measured each figure, in how many; how many crashed or failed."""
    good = [trial for trial in trials if "failed" not in trial]
    keys = list(dict.fromkeys(key for trial in good for key, value in trial.items() if isinstance(value, float)))
    median = {key: statistics.median(trial[key] for trial in good if key in trial) for key in keys}
    measured_in = {key: sum(key in trial for trial in good) for key in keys}
    if plain and "step time, 2 replica groups" in median:
        median["steady state torchft / plain DDP"] = median["step time, 2 replica groups"] / plain
        measured_in["steady state torchft / plain DDP"] = measured_in["step time, 2 replica groups"]
    return {"version": importlib.metadata.version("torchft"), "heartbeat_timeout_ms": TORCHFT_HEARTBEAT_TIMEOUT_MS,
            "trials": trials, "median": median, "measured in": measured_in,
            "survivor crashed": sum("survivor crashed" in t for t in good), "failed": len(trials) - len(good)}


def _torchft_cell(key: str, torchft: dict | str) -> str:
    """The table's torchft column for our measure ``key``."""
    if key not in TORCHFT_ROWS:
        return ""
    if isinstance(torchft, str):
        return torchft
    value = torchft["median"].get(TORCHFT_ROWS[key])
    if value is not None:
        measured, trials = torchft["measured in"][TORCHFT_ROWS[key]], len(torchft["trials"])
        return f"{value:.3f}" + ("" if measured == trials else f" ({measured} of {trials})")
    if key == "lost worker: kill to its restart's first step" and CRASHED_BACK in torchft["median"]:
        return f"{torchft['median'][CRASHED_BACK]:.3f}*"  # the footnote below the table says what happened
    return "survivor crashed" if torchft["survivor crashed"] else "failed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one trial, a smaller model")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", default=None,
                        help="default: results/bench_live.json (results/bench_live_shard.json with --shard-size)")
    parser.add_argument("--no-torchft", action="store_true", help="skip the TorchFT column even if it is installed")
    parser.add_argument("--cold-start", action="store_true",
                        help="live workers start as new interpreters, not forked from the pre-warmed process")
    parser.add_argument("--commit-cost", action="store_true",
                        help="only the step commit's cost per step: live jobs with and without it, in pairs")
    parser.add_argument("--shard-size", type=int, default=0, metavar="N",
                        help="live trials only: the model under AdaptiveFSDP on sharding_mesh(N); a join and a leave")
    parser.add_argument("--loader-workers", type=int, default=0, metavar="N",
                        help="persistent DataLoader worker processes in every job measured (as pytorch/examples' "
                             "mnist has one); default 0")
    args = parser.parse_args()
    os.environ["BENCH_LOADER_WORKERS"] = str(args.loader_workers)  # the workers inherit it
    with tempfile.TemporaryDirectory() as bytecode:
        _cache_bytecode(Path(bytecode))
        _run(args)


def _cache_bytecode(folder: Path) -> None:
    """The workers read the library's compiled modules from ``folder``, compiled now, as an installed package's.

    An interpreter run with ``PYTHONDONTWRITEBYTECODE=1`` (as in some
    containers) compiles every module of the library from source in every
    process, which a deployed job does not: the joiner's start-up would count
    about 0.15 s of it.
    """
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "adaptive"), str(WORKER),
                    str(TORCHFT_WORKER)], env=os.environ, check=True, stdout=subprocess.DEVNULL, timeout=600)


#: With ``--shard-size``: the figures compared between the DDP and the sharded job (goal: within 2x of DDP).
SHARDED_ROWS = ("survivor pause at a join", "survivor pause at a leave", "planned rescale (change to first step at 2)",
                "step time, 2 live members")


def _run_sharded(args: argparse.Namespace) -> None:
    """``--shard-size N``: a join and a leave of the model under ``AdaptiveFSDP`` against the same changes under
    ``AdaptiveDataParallel``, trials alternating, in one run."""
    trials = 1 if args.quick else args.trials
    width = 512 if args.quick else 1024
    runs = {"ddp": [], "sharded": []}
    for _ in range(trials):
        runs["ddp"].append(live_trial(width, args.cold_start))
        runs["sharded"].append(live_trial(width, args.cold_start, args.shard_size))
    good = {kind: [run for run in trials_of if "failed" not in run] for kind, trials_of in runs.items()}
    median = {kind: {key: statistics.median(run[key] for run in good[kind]) for key in SHARDED_ROWS}
              for kind in runs if good[kind]}
    print(f"live join and leave, 2 processes, gloo, AdaptiveDataParallel against AdaptiveFSDP on "
          f"sharding_mesh({args.shard_size}); median of {len(good['ddp'])} and {len(good['sharded'])} of {trials} "
          f"trials (seconds)")
    print(f"{'measure':<48}{'DDP':>10}{'FSDP':>10}{'ratio':>8}")
    for key in SHARDED_ROWS:
        ddp, sharded = (median.get(kind, {}).get(key, math.nan) for kind in ("ddp", "sharded"))
        print(f"{key:<48}{ddp:>10.3f}{sharded:>10.3f}{sharded / ddp if ddp else math.nan:>8.2f}")
    for kind, trials_of in runs.items():
        for run in trials_of:
            if "failed" in run:
                print(f"failed {kind} trial: {run['failed']}\n{run.get('log', '')}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"trials": runs, "median": median, "shard size": args.shard_size},
                                          indent=2))


def _run(args: argparse.Namespace) -> None:
    if args.json is None:
        name = "bench_live_commit" if args.commit_cost else "bench_live_shard" if args.shard_size else "bench_live"
        args.json = str(HERE / "results" / f"{name}.json")
    if args.commit_cost:
        _run_commit_cost(args)
        return
    if args.shard_size:
        _run_sharded(args)
        return
    trials = 1 if args.quick else args.trials
    width = 512 if args.quick else 1024
    missing = "not run" if args.no_torchft else torchft_status()
    runs, torchft_runs = [], []
    for _ in range(trials):
        runs.append({**torchrun_trial(width, plain=True), **torchrun_trial(width, plain=False),
                     **live_trial(width, args.cold_start)})
        if missing is None:
            torchft_runs.append(torchft_trial(width))
    good = [run for run in runs if "failed" not in run]
    for run in good:  # ratios within a trial (its runs follow one another), then their median over trials
        run.update(_steady_state_ratios(run))
    keys = [key for key in (good[0] if good else {}) if key != "log"]
    median = {key: statistics.median(run[key] for run in good) for key in keys}
    plain = [run["step time, plain DDP"] for run in runs if "step time, plain DDP" in run]
    torchft = missing or _torchft_summary(torchft_runs, statistics.median(plain) if plain else None)
    params = 2 * width * width + 10 * width + 2 * width + 10
    starts = "new interpreters (--cold-start)" if args.cold_start else "forks of the pre-warmed process"
    print(f"live membership changes, 2 processes, gloo, model {params / 1e6:.1f}M params + Adam; median of "
          f"{len(good)} of {trials} trials (seconds, or a ratio); live workers start as {starts}")
    if isinstance(torchft, dict):
        print(f"torchft {torchft['version']}: 2 replica groups of 1 process, Lighthouse heartbeat timeout "
              f"{TORCHFT_HEARTBEAT_TIMEOUT_MS} ms; median of {len(torchft_runs) - torchft['failed']} of "
              f"{len(torchft_runs)} trials, its survivor crashed in {torchft['survivor crashed']}; a lost worker is "
              f"a lost replica group")
    print(f"{'measure':<48}{'median':>10}{'goal':>8}{'torchft':>18}")
    for key, value in median.items():
        goal = GOALS.get(key)
        goal_cell = "" if goal is None else f"{goal:>8.2f}"
        print(f"{key:<48}{value:>10.3f}{goal_cell:<8}{_torchft_cell(key, torchft):>18}".rstrip())
    for run in runs:
        if "failed" in run:
            print(f"failed trial: {run['failed']}\n{run.get('log', '')}")
    if isinstance(torchft, str):
        print(f"torchft: {torchft}" + ("; `pip install torchft` adds its figures on the same model (benchmark only)"
                                       if torchft == "not installed" else ""))
    crashed = [run for run in torchft_runs if "survivor crashed" in run]
    if crashed:
        sites = "; ".join(dict.fromkeys(run["survivor crashed"] for run in crashed))
        went_on = ", ".join(f"{run['step the restarted groups went on from']} (at the kill: {run['step at the kill']})"
                            for run in crashed)
        print(f"* torchft: the survivor crashed when its peer was killed, in {len(crashed)} of {len(torchft_runs)} "
              f"trials ({sites}); both torchruns restarted their workers, which trained on from step {went_on}")
    for run in torchft_runs:
        if "failed" in run:
            print(f"failed torchft trial: {run['failed']}\n{run.get('log', '')}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"trials": runs, "median": median, "goals": GOALS, "params": params,
                                           "cold start": args.cold_start, "torchft": torchft}, indent=2))


if __name__ == "__main__":
    main()
