"""Helpers for the live-membership tests (``adaptive-run --live``): launchers of one job, and checks of what
the workers logged (``tests/workers/live_worker.py``).

Used by ``test_live.py`` and ``test_live_faults.py``.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from elastic_harness import Jobs, tail, wait_for

REPO = Path(__file__).resolve().parent.parent
LIVE_WORKER = REPO / "tests" / "workers" / "live_worker.py"
SAMPLES, BATCH = 480, 24


@pytest.fixture
def jobs(tmp_path):
    started = Jobs(tmp_path)
    yield started
    started.cleanup()


def launch(jobs: Jobs, out: Path, port: int, name: str, per_node: int = 1, restarts: int = 0,
           script: Path = LIVE_WORKER, **extra: str):
    """One ``adaptive-run --live`` launcher (a node) of the job whose store is on ``port`` running ``script``;
    logs to ``name.log``."""
    args = ["--live", "--nnodes", "1:4", "--nproc-per-node", str(per_node), "--max-restarts", str(restarts),
            "--rdzv-endpoint", f"127.0.0.1:{port}"]
    settings = {"WORKER_SAMPLES": str(SAMPLES), "WORKER_BATCH": str(BATCH), **extra}
    return jobs.launch(args, out, f"{name}.log", script=script, **settings)


def worker_pids(launcher_pid: int, script: str = "live_worker") -> list[int]:
    """The PIDs of a launcher's training workers running ``script``: forks of its pre-warmed process (their
    process title is the script's command line), or its own children with ``--cold-start``."""
    import psutil

    parents = [psutil.Process(launcher_pid)]
    parents += [child for child in parents[0].children() if "_warm_server" in " ".join(child.cmdline())]
    return [child.pid for parent in parents for child in parent.children()
            if script in " ".join(child.cmdline())]


def steps(out: Path) -> list[dict]:
    """Every step record of every process, oldest first.

    A worker that writes its step before the update and ``{"ended": true, "discarded": ...}`` after it has
    the two merged; a step whose end was never written (the worker was killed after the update) counts as
    discarded exactly when its peers of the same generation discarded it (they agreed on it)."""
    records = []
    for path in out.glob("steps.*.jsonl"):
        for record in (json.loads(line) for line in path.read_text().splitlines() if line.strip()):
            if record.get("ended"):
                if records and records[-1].get("discarded") is None:
                    records[-1]["discarded"] = record["discarded"]
            else:
                records.append(dict(record, discarded=record.get("discarded")))
    ended = {(r["epoch"], r["step"], r["generation"]): r["discarded"] for r in records if r["discarded"] is not None}
    for record in records:
        if record["discarded"] is None:
            record["discarded"] = ended.get((record["epoch"], record["step"], record["generation"]), True)
    return sorted(records, key=lambda r: r["time"])


def exits(out: Path) -> dict[int, int]:
    """Each worker process's exit status, by PID."""
    path = out / "exits.jsonl"
    if not path.exists():
        return {}
    return {r["pid"]: r["code"] for r in map(json.loads, path.read_text().splitlines())}


def logs(out: Path) -> str:
    return "\n".join(f"--- {log.name}\n{tail(log, 40)}" for log in sorted(out.rglob("*.log")))


def wait_steps(out: Path, predicate, what: str, timeout: float = 90.0) -> list[dict]:
    return wait_for(lambda: (lambda records: records if predicate(records) else None)(steps(out)), timeout, what)


def newest_records(records: list[dict], key=lambda record: (record["epoch"], record["step"])) -> dict:
    """``key(record)`` (default: (epoch, step)) -> the records of the newest generation that trained that step
    without discarding it (a step discarded after a loss was trained again; within one run of the job)."""
    newest: dict = {}
    for record in records:
        if record["discarded"]:  # a member was lost before every member applied it: trained again
            continue
        group = newest.get(key(record), [])
        if group and record["generation"] > group[0]["generation"]:
            group = []
        if not group or record["generation"] == group[0]["generation"]:
            newest[key(record)] = group + [record]
    return newest


def without_debug_traceback(log: str) -> str:
    """``log`` without the traceback the worker keeps at DEBUG for a peer failure (live_worker turns that
    logger's DEBUG on: it is not something a user sees)."""
    kept, skipping = [], False
    for line in log.splitlines():
        if "adaptive.runtime.peer_failure: the failed collective" in line:
            skipping = True
        elif line.startswith(("[pid ", "adaptive-run")):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def check_after_rollbacks(out: Path, epochs: int) -> None:
    """Like :func:`check_steps` for a job that lost members (live, or back to a checkpoint): a step trained
    again counts with the records of its newest generation, which must be one consistent set of members from
    one state.

    The epoch's Accumulator totals are exact, except that a worker killed after its last step's update was
    applied everywhere, and before that step ended, takes what it alone counted in that step with it (the
    library warns): the shortfall must then be exactly such steps' samples."""
    newest = newest_records(steps(out))
    for (epoch, step), records in newest.items():
        assert len(records) == records[0]["world"] and len({r["digest"] for r in records}) == 1, \
            f"epoch {epoch} step {step}: {[(r['pid'], r['generation'], r['world']) for r in records]}"
    for epoch in range(epochs):
        seen = collections.Counter(i for (e, _), records in newest.items() if e == epoch
                                   for r in records for i in r["indices"])
        assert set(seen) == set(range(SAMPLES)) and sum(seen.values()) - SAMPLES < 4, epoch
    last = {r["epoch"]: r for r in map(json.loads, (out / "epochs.jsonl").read_text().splitlines())}
    assert sorted(last) == list(range(epochs))
    shortfalls = _killed_last_steps(out, newest)
    for epoch, record in last.items():
        allowed = _subset_sums(shortfalls.get(epoch, []))
        assert record["missing"] in allowed and record["extra"] < record["world"], (record, sorted(allowed))
    if any(record["missing"] for record in last.values()):
        assert "after it last published its private state" in "".join(
            log.read_text(errors="replace") for log in out.rglob("*.log")), "a shortfall without its warning"
    # A member that trained the step in flight again drew what it drew the first time.
    replayed = replayed_draws(out)
    assert all(len(set(values)) == 1 for values in replayed.values()), replayed


def _killed_last_steps(out: Path, newest: dict[tuple[int, int], list[dict]]) -> dict[int, list[int]]:
    """epoch -> the sample counts of the last committed steps of workers that never recorded an exit (killed)."""
    exited, last_of = set(exits(out)), {}
    for record in steps(out):
        if record["pid"] not in exited:
            last_of[record["pid"]] = record
    counts: dict[int, list[int]] = collections.defaultdict(list)
    for record in last_of.values():
        if record in newest.get((record["epoch"], record["step"]), []):
            counts[record["epoch"]].append(len(record["indices"]))
    return counts


def _subset_sums(values: list[int]) -> set[int]:
    sums = {0}
    for value in values:
        sums |= {total + value for total in sums}
    return sums


def replayed_draws(out: Path) -> dict[tuple[int, int, int], list[float]]:
    """The random numbers each process drew at the steps it trained more than once (after a rollback), by
    (pid, epoch, step), in the order it trained them."""
    draws: dict[tuple[int, int, int], list[float]] = collections.defaultdict(list)
    for record in steps(out):
        draws[(record["pid"], record["epoch"], record["step"])].append(record["draw"])
    return {key: values for key, values in draws.items() if len(values) > 1}


def check_steps(out: Path, epochs: int) -> dict[tuple[int, int], list[dict]]:
    """Every step was trained by exactly its world's members from one state, and each epoch saw every
    sample once; returns the records by (epoch, step)."""
    by_step: dict[tuple[int, int], list[dict]] = collections.defaultdict(list)
    for record in steps(out):
        by_step[(record["epoch"], record["step"])].append(record)
    for (epoch, step), records in by_step.items():
        worlds = {r["world"] for r in records}
        assert len(worlds) == 1 and len(records) == worlds.pop(), \
            f"epoch {epoch} step {step} was trained by {[(r['pid'], r['rank'], r['world']) for r in records]}"
        assert sorted(r["rank"] for r in records) == list(range(len(records)))
        assert len({r["digest"] for r in records}) == 1, \
            f"the members of epoch {epoch} step {step} held different states: {[r['pid'] for r in records]}"
    for epoch in range(epochs):
        seen = collections.Counter(i for (e, _), records in by_step.items() if e == epoch
                                   for r in records for i in r["indices"])
        assert set(seen) == set(range(SAMPLES)), f"epoch {epoch} missed {sorted(set(range(SAMPLES)) - set(seen))}"
        repeated = sum(count - 1 for count in seen.values())
        assert repeated < 4, f"epoch {epoch} repeated {repeated} samples"
    records = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(epochs))
    assert all(r["missing"] == 0 and r["extra"] < r["world"] for r in records), records
    done = json.loads((out / "done.json").read_text())
    assert done["model_steps"] == done["step"] == len(by_step), done
    return by_step
