"""Run the scripts of ``tests/corpus/`` under real torchrun, interrupt them, and read what they recorded.

A script records (``tests/corpus/corpus_probe.py``) the samples of every
step, the totals of every ``synchronized()`` block, the learning rate at
every epoch end, the state its wrappers hold right after a resume, and its
progress.  This module launches the scripts (through
:class:`elastic_harness.Jobs`: own sessions, bounded waits, cleanup by pid),
sends the signals, and checks what the records say against the checkpoints
and against an uninterrupted run of the same script.

Every launch ``k`` of a run sets ``CORPUS_LAUNCH=k``; every process of it
writes files tagged ``L<k>-R<torchrun restart>``, so the attempts of a run
are ordered by their tags.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from adaptive.checkpoint.store import CheckpointStore
from elastic_harness import REPO, Jobs, tail, wait_for

logger = logging.getLogger(__name__)

CORPUS = REPO / "tests" / "corpus"
#: Generous bound on signal -> exit 143 (the library aims at about max(1 s, two steps) plus the save).
STOP_BOUND_S = 10.0
START_TIMEOUT_S = 240.0  # torchrun + import torch on a loaded 2-core machine
RUN_TIMEOUT_S = 420.0


@dataclasses.dataclass(frozen=True)
class Ratio:
    """A total divided by a count, compared with the reference's within ``atol + rtol * |reference|``.

    ``better`` (``"higher"`` for accuracies, ``"lower"`` for losses) bounds
    only the worse side: for scripts whose batch sizes autoscale picks from
    measured timings, a run may legitimately end better than the reference,
    and that cannot be lost progress (the exact counts catch training twice).
    """

    key: str
    per: str
    rtol: float = 0.0
    atol: float = 0.0
    better: str | None = None

    def off_by(self, mine: float, theirs: float) -> float:
        """How far ``mine`` is from ``theirs`` on the side that counts."""
        if self.better == "higher":
            return theirs - mine
        if self.better == "lower":
            return mine - theirs
        return abs(mine - theirs)


@dataclasses.dataclass(frozen=True)
class Script:
    """A corpus script, how to run it, and what its records must satisfy."""

    id: str
    file: str
    args: tuple[str, ...]
    epochs: int
    loops: tuple[str, ...]  # loader loops per epoch, in the order they run
    drop_last: frozenset[str] = frozenset()  # loops whose last partial step is dropped
    models: tuple[str, ...] = ("model",)  # names of the AdaptiveDataParallel wrappers
    exact: tuple[str, ...] = ()  # totals equal to the reference's
    close: tuple[Ratio, ...] = ()  # totals per count close to the reference's
    fixed_batch: bool = True  # no autoscale: steps and per-sample counts equal the reference's exactly
    lr_exact: bool = True  # the LR schedule is a function of the step counts only
    partial_last_epoch: bool = False  # ``--max-steps`` ends the job inside its last epoch
    sizes: tuple[tuple[str, int], ...] = ()  # samples in each loop's dataset
    replay_exact: bool = False  # a step trained again after a crash gets the very loss it got the first time

    @property
    def dataset_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def path(self) -> Path:
        return CORPUS / self.file


@dataclasses.dataclass
class Launch:
    """One launcher process of a run."""

    index: int
    nproc: int
    proc: subprocess.Popen
    log: Path
    started: float


@dataclasses.dataclass
class Stop:
    """A signal sent to a launcher: its exit status, seconds from the signal to the exit, when it was
    sent (wall clock), and rank 0's progress record right after it was sent."""

    code: int
    seconds: float
    sent: float
    at: dict | None

    @property
    def landed(self) -> str:
        """Where rank 0 was when the signal was sent."""
        return self.at["loop"] if self.at else "?"


class CorpusRun:
    """One job of a corpus script: its folder and its launches (each a relaunch of the same command)."""

    def __init__(self, jobs: Jobs, script: Script, out: Path) -> None:
        self.jobs = jobs
        self.script = script
        self.out = out
        self.launches: list[Launch] = []

    def launch(self, nproc: int, max_restarts: int = 0, **env: str) -> Launch:
        """Start ``adaptive-run --standalone --nproc-per-node=nproc script args`` (the same command each time)."""
        index = len(self.launches)
        name = f"launch{index}-n{nproc}.log"
        knobs = {"CORPUS_OUT": str(self.out), "CORPUS_LAUNCH": str(index), "ADAPTIVE_CHECKPOINT_INTERVAL": "0",
                 "ADAPTIVE_CHECKPOINT_KEEP": "1000",  # keep every checkpoint a launch resumed, to compare
                 "ADAPTIVE_SHARE_PATH": str(self.out / "share"), "ADAPTIVE_PROGRESS_INTERVAL": "0", **env}
        cmd = [sys.executable, "-m", "adaptive.elastic.launcher", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", str(self.script.path), *self.script.args]
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / name, "ab") as log:
            proc = subprocess.Popen(cmd, env=self.jobs.env(self.out, **knobs), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=str(self.out))
        self.jobs.procs.append(proc)  # Jobs.cleanup kills it and its workers, by pid
        launch = Launch(index, nproc, proc, self.out / name, time.time())
        self.launches.append(launch)
        return launch

    def progress(self, rank: int = 0) -> dict | None:
        """The last progress record of ``rank`` in the current launch, or None."""
        try:
            record = json.loads((self.out / f"progress.rank{rank}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        current = f"L{len(self.launches) - 1:02d}-"
        return record if record["attempt"].startswith(current) else None

    def wait_progress(self, what: str, predicate: Callable[[dict], bool], rank: int = 0,
                      timeout: float = START_TIMEOUT_S) -> dict:
        """Poll ``rank``'s progress until ``predicate`` holds (bounded); fail with the log's tail."""
        launch = self.launches[-1]

        def check() -> dict | None:
            if launch.proc.poll() is not None:
                raise AssertionError(f"launch {launch.index} exited with {launch.proc.returncode} while waiting "
                                     f"for {what}\n{tail(launch.log)}")
            record = self.progress(rank)
            return record if record is not None and predicate(record) else None

        try:
            return wait_for(check, timeout, what, interval=0.02)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{tail(launch.log)}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90.0) -> Stop:
        """Signal the current launcher, as a scheduler does, and wait (bounded) for it to exit."""
        launch = self.launches[-1]
        start, wall = time.monotonic(), time.time()
        os.kill(launch.proc.pid, sig)
        at = self.progress(0)
        code = self.wait(timeout)
        return Stop(code, time.monotonic() - start, wall, at)

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        """Wait (bounded) for the current launcher to exit; its exit status."""
        launch = self.launches[-1]
        try:
            return launch.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launch {launch.index} did not exit within {timeout:.0f} s\n"
                                 f"{tail(launch.log)}") from None

    def kill_worker(self, rank: int) -> dict:
        """SIGKILL one worker of the current launch (by the pid it reported)."""
        record = self.progress(rank)
        os.kill(record["pid"], signal.SIGKILL)
        return record

    def log_text(self) -> str:
        return "\n".join(launch.log.read_text(errors="replace") for launch in self.launches if launch.log.exists())

    def last_log(self) -> str:
        return tail(self.launches[-1].log, 80)

    # ------------------------------------------------------------------ what the scripts recorded

    def records(self, kind: str) -> dict[str, list[dict]]:
        """``kind`` records (samples, totals, epochs) per attempt tag, attempts in order, ranks in order."""
        found: dict[str, list[dict]] = collections.defaultdict(list)
        for path in sorted(self.out.glob(f"{kind}.L*-R*.rank*.jsonl")):
            attempt, rank = path.name.split(".")[1], int(path.name.split(".")[2][len("rank"):])
            for line in path.read_text().splitlines():
                if line.strip():
                    found[attempt].append({**json.loads(line), "rank": rank, "attempt": attempt})
        return dict(sorted(found.items()))

    def attempts(self) -> list[dict]:
        path = self.out / "attempts.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def restored(self, attempt: str) -> dict[int, dict]:
        """What each rank of ``attempt`` held right after building its wrappers on a resume."""
        return {int(path.name.split(".")[2][len("rank"):]): torch.load(path, weights_only=False)
                for path in sorted(self.out.glob(f"restored.{attempt}.rank*.pt"))}

    def done(self) -> dict:
        """Rank 0's end-of-job record from the last attempt that wrote one."""
        paths = sorted(self.out.glob("done.L*-R*.rank0.json"))
        assert paths, f"no attempt finished the job\n{self.last_log()}"
        return json.loads(paths[-1].read_text())

    def store(self) -> CheckpointStore:
        return CheckpointStore(self.out / "checkpoints")


# ---------------------------------------------------------------------- reading the sample records


def _position(script: Script, record: dict) -> tuple[int, int, int]:
    """Where a step lies in the job: (epoch, loop in the epoch, the loader's step)."""
    return record["epoch"], script.loops.index(record["loop"]), record["step"]


def committed_steps(script: Script, by_attempt: dict[str, list[dict]]) -> tuple[list[dict], list[dict]]:
    """The steps that count, and those rolled back.

    Attempts run in order; an attempt resumes at its first step, so every
    step an earlier attempt recorded at or after that position was rolled
    back (a crash restarts from the last checkpoint) and trained again.
    """
    kept: list[dict] = []
    rolled_back: list[dict] = []
    for records in by_attempt.values():
        if records:
            resume_at = min(_position(script, r) for r in records)
            rolled_back += [r for r in kept if _position(script, r) >= resume_at]
            kept = [r for r in kept if _position(script, r) < resume_at]
        kept += records
    return kept, rolled_back


def sample_counts(steps: list[dict]) -> dict[tuple[int, str], collections.Counter]:
    """Per (epoch, loop): how often each sample was trained on, over all ranks."""
    counts: dict[tuple[int, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for record in steps:
        counts[record["epoch"], record["loop"]].update(record["idx"])
    return dict(counts)


def assert_exact_samples(script: Script, steps: list[dict], where: str) -> None:
    """Every epoch's loops saw every sample once (G2): fewer repeats than replicas at the last step;
    with ``drop_last``, fewer samples missing than the last step's batch; every recorded epoch there."""
    counts, sizes = sample_counts(steps), script.dataset_sizes
    expected_epochs = set(range(script.epochs))
    assert {epoch for epoch, _ in counts} == expected_epochs, \
        f"{where}: epochs with steps {sorted({e for e, _ in counts})}, expected {sorted(expected_epochs)}"
    for (epoch, loop), counter in sorted(counts.items()):
        records = [r for r in steps if (r["epoch"], r["loop"]) == (epoch, loop)]
        last = max(r["step"] for r in records)
        world = max(r["world"] for r in records if r["step"] == last)
        repeats = sum(c - 1 for c in counter.values() if c > 1)
        assert repeats < world, f"{where}: epoch {epoch} {loop}: {repeats} repeated samples " \
                                f"({[i for i, c in counter.items() if c > 1][:10]}...)"
        assert all(0 <= i < sizes[loop] for i in counter), f"{where}: epoch {epoch} {loop}: index out of range"
        partial = script.partial_last_epoch and epoch == script.epochs - 1 and loop == script.loops[0]
        if partial:
            continue
        missing = sizes[loop] - len(counter)
        step_batch = max(sum(len(r["idx"]) for r in records if r["step"] == s) for s in {r["step"] for r in records})
        allowed = step_batch - 1 if loop in script.drop_last else 0
        assert 0 <= missing <= allowed, f"{where}: epoch {epoch} {loop}: {missing} samples never seen " \
                                        f"(at most {allowed} may be dropped)"


def assert_same_samples(steps: list[dict], reference: list[dict], where: str) -> None:
    """Per epoch and loop, exactly the reference's samples, as often (same batch sizes, same order)."""
    ours, theirs = sample_counts(steps), sample_counts(reference)
    assert sorted(ours) == sorted(theirs), f"{where}: loops {sorted(ours)} vs the reference's {sorted(theirs)}"
    for key in sorted(theirs):
        assert ours[key] == theirs[key], f"{where}: epoch {key[0]} {key[1]} trained on other samples than the " \
                                         f"uninterrupted run ({len(ours[key])} vs {len(theirs[key])} distinct)"


def assert_steps_continue(script: Script, by_attempt: dict[str, list[dict]], where: str) -> None:
    """After graceful stops nothing is trained twice and nothing skipped: each loop's step numbers,
    over all attempts, are consecutive, and every rank of an attempt took the same steps."""
    per_loop: dict[str, list[int]] = collections.defaultdict(list)
    for attempt, records in by_attempt.items():
        ranks: dict[int, list[tuple]] = collections.defaultdict(list)
        for record in records:
            ranks[record["rank"]].append(_position(script, record))
        assert len({tuple(p) for p in ranks.values()}) == 1, f"{where}: the ranks of {attempt} took different steps"
        for record in records:
            if record["rank"] == 0:
                per_loop[record["loop"]].append(record["step"])
    for loop, steps in per_loop.items():
        assert len(steps) == len(set(steps)), \
            f"{where}: {loop} steps trained twice: {sorted(s for s, n in collections.Counter(steps).items() if n > 1)}"
        assert sorted(steps) == list(range(len(steps))), \
            f"{where}: {loop} steps skipped: {sorted(set(range(max(steps) + 1)) - set(steps))}"


# ---------------------------------------------------------------------- resumes and checkpoints


def _equal(a: Any, b: Any) -> bool:
    """Exact equality of nested state (tensors elementwise, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
                or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            return torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        return torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _differences(held: dict, saved: dict, prefix: str = "") -> list[str]:
    """Paths where two nested states differ (for a readable failure)."""
    if isinstance(held, dict) and isinstance(saved, dict):
        out = [f"{prefix}{k}: only in one" for k in held.keys() ^ saved.keys()]
        for key in held.keys() & saved.keys():
            out += _differences(held[key], saved[key], f"{prefix}{key}.")
        return out
    return [] if _equal(held, saved) else [prefix.rstrip(".")]


def assert_state_applied(run: CorpusRun, attempt: str, seq: int, where: str) -> None:
    """Right after the resume, every rank of ``attempt`` held exactly what checkpoint ``seq`` saved:
    parameters and buffers, optimizer state (momentum, Adam moments, steps), LR scheduler, grad scaler."""
    restored = run.restored(attempt)
    assert restored, f"{where}: {attempt} resumed but recorded no state"
    checkpoint = run.store().open(seq)
    for rank, payload in restored.items():
        assert payload["seq"] == seq, f"{where}: rank {rank} resumed checkpoint {payload['seq']}, not {seq}"
        for name in run.script.models:
            saved = checkpoint.load(f"adaptive.parallel.{name}")
            held = payload["states"][name]
            for key in held:
                assert key in saved, f"{where}: checkpoint {seq} has no {key} state of {name}"
                assert _equal(held[key], saved[key]), \
                    f"{where}: rank {rank}'s {name}.{key} right after the resume differs from checkpoint {seq} " \
                    f"at {_differences(held[key], saved[key])[:5]}"
            assert saved["optimizer"]["state"], f"{where}: checkpoint {seq} holds no optimizer state of {name}"


def assert_resumed(run: CorpusRun, attempt: str, nproc: int, seq: int | None, where: str) -> int:
    """Every process of ``attempt`` resumed the same checkpoint (``seq`` if given) and applied it."""
    started = [a for a in run.attempts() if a["attempt"] == attempt]
    assert len(started) == nproc, f"{where}: {len(started)} processes of {attempt} started, expected {nproc}"
    seqs = {a["resumed"] for a in started}
    assert len(seqs) == 1 and None not in seqs, f"{where}: {attempt} resumed checkpoints {seqs}\n{run.last_log()}"
    (resumed,) = seqs
    if seq is not None:
        assert resumed == seq, f"{where}: {attempt} resumed checkpoint {resumed}, not {seq} (the newest)"
    assert_state_applied(run, attempt, resumed, where)
    return resumed


def newest_seq(run: CorpusRun) -> int:
    """The newest checkpoint's number from the folder names (cheap enough to poll; 0 if none)."""
    return max((int(p.name.split("-")[1]) for p in (run.out / "checkpoints").glob("checkpoint-*")), default=0)


def newest_checkpoint(run: CorpusRun) -> tuple[int, dict]:
    """The newest verified checkpoint: its number and metadata."""
    latest = run.store().latest()
    assert latest is not None, f"no checkpoint\n{run.last_log()}"
    return latest.info.seq, dict(latest.info.metadata)


# ---------------------------------------------------------------------- totals and the end of the job


def totals_by_block(by_attempt: dict[str, list[dict]]) -> dict[tuple[int, str], list[dict]]:
    """Every record of every ``synchronized()`` block, per (epoch, block), in attempt order."""
    blocks: dict[tuple[int, str], list[dict]] = collections.defaultdict(list)
    for records in by_attempt.values():
        for record in records:
            blocks[record["epoch"], record["block"]].append(record)
    return dict(blocks)


def assert_totals_match(script: Script, ours: dict, reference: dict, where: str) -> None:
    """Each block's totals, on every rank and in every attempt that reached it, match the reference:
    counts exactly, losses and accuracies within their tolerance (for a script whose batch sizes autoscale
    picks from timings, in the last epoch only: earlier ones trained with other batch sizes than the
    reference's, and their accuracy moves by more than the tolerance from run to run)."""
    assert sorted(ours) == sorted(reference), f"{where}: blocks {sorted(ours)} vs the reference's {sorted(reference)}"
    last_epoch = max(epoch for epoch, _ in ours)
    for key, records in sorted(ours.items()):
        compared = script.close if script.fixed_batch or key[0] == last_epoch else ()
        ref = reference[key][-1]["values"]
        for record in records:
            values = record["values"]
            label = f"{where}: epoch {key[0]} {key[1]} totals on rank {record['rank']} of {record['attempt']}"
            for name in script.exact:
                assert values.get(name) == ref.get(name), f"{label}: {name} = {values.get(name)}, " \
                                                          f"uninterrupted {ref.get(name)}: {values}"
            assert values.keys() == ref.keys(), f"{label}: keys {sorted(values)}, uninterrupted {sorted(ref)}"
            for ratio in (r for r in compared if r.key in ref):
                mine, theirs = values[ratio.key] / values[ratio.per], ref[ratio.key] / ref[ratio.per]
                assert ratio.off_by(mine, theirs) <= ratio.atol + ratio.rtol * abs(theirs), \
                    f"{label}: {ratio.key}/{ratio.per} = {mine:.4f}, uninterrupted {theirs:.4f}"


def last_per_epoch(by_attempt: dict[str, list[dict]]) -> dict[int, dict]:
    """Rank 0's last epoch-end record per epoch."""
    epochs: dict[int, dict] = {}
    for records in by_attempt.values():
        for record in records:
            if record["rank"] == 0:
                epochs[record["epoch"]] = record
    return epochs


def assert_like_reference(run: CorpusRun, reference: CorpusRun, where: str) -> None:
    """What the whole job did equals the uninterrupted run's: samples, totals, LR, step counters."""
    script = run.script
    steps, _ = committed_steps(script, run.records("samples"))
    ref_steps, _ = committed_steps(script, reference.records("samples"))
    if script.fixed_batch:
        assert_same_samples(steps, ref_steps, where)
    assert_totals_match(script, totals_by_block(run.records("totals")),
                        totals_by_block(reference.records("totals")), where)
    ours, theirs = last_per_epoch(run.records("epochs")), last_per_epoch(reference.records("epochs"))
    assert sorted(ours) == sorted(theirs), f"{where}: epochs ended {sorted(ours)} vs {sorted(theirs)}"
    if script.lr_exact:
        for epoch in theirs:
            assert math.isclose(ours[epoch]["lr"], theirs[epoch]["lr"], rel_tol=1e-9, abs_tol=1e-15), \
                f"{where}: LR after epoch {epoch} is {ours[epoch]['lr']}, uninterrupted {theirs[epoch]['lr']}"
    if script.fixed_batch:
        done, ref_done = run.done(), reference.done()
        for key in ("loaders", "optimizer_steps", "scheduler_epochs"):
            assert done[key] == ref_done[key], f"{where}: at the end {key} = {done[key]}, uninterrupted {ref_done[key]}"


#: How a survivor's error reads when its peer was SIGKILLed (its collective fails; torchrun restarts the group).
PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "CollectiveError", "peer replica failed")


def assert_no_tracebacks(run: CorpusRun, where: str, *, peer_failures: bool = False) -> None:
    """No worker raised (a graceful stop is a SystemExit, which prints nothing); with ``peer_failures``,
    only for the reason that a peer was killed."""
    for launch in run.launches:
        lines = launch.log.read_text(errors="replace").splitlines()
        for number, line in enumerate(lines):
            if "Traceback (most recent call last)" not in line:
                continue
            prefix = line.split("Traceback")[0]
            block = [text for text in lines[number:number + 200] if text.startswith(prefix)]
            error = next((text for text in block[1:] if not text[len(prefix):].startswith((" ", "\t"))), "")
            if peer_failures and any(reason in error for reason in PEER_FAILURES):
                continue
            raise AssertionError(f"{where}: a worker raised in launch {launch.index}:\n" + "\n".join(block[:60]))


def record_latency(run: CorpusRun, sequence: str, where: str, stop: Stop, to_checkpoint: float) -> dict:
    """Log one measured stop and append it to the run folder's ``latencies.jsonl``."""
    record = {"script": run.script.id, "sequence": sequence, "where": where, "landed": stop.landed,
              "replicas": run.launches[-1].nproc, "to_checkpoint_s": round(to_checkpoint, 3),
              "to_exit_s": round(stop.seconds, 3), "code": stop.code}
    logger.info("%s %s: SIGTERM at %s (rank 0 at %s): checkpoint after %.2f s, exit %d after %.2f s",
                run.script.id, sequence, where, stop.landed, to_checkpoint, stop.code, stop.seconds)
    with open(run.out / "latencies.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


# ---------------------------------------------------------------------- the steps of a sequence

#: Knobs that keep a script long enough at a place for a test to signal it there.
PLACES: dict[str, dict[str, str]] = {
    "train": {},
    "valid": {"CORPUS_STEP_SLEEP": "valid=0.1"},  # a slower validation (1 s or more per epoch)
    "epoch-end": {"CORPUS_PAUSE": "2", "CORPUS_PAUSE_AT": "epoch-end"},  # plain code at the epoch end
    "between-loops": {"CORPUS_PAUSE": "2", "CORPUS_PAUSE_AT": "between-loops"},  # plain code between loops
}


def _attempt_tag(launch: Launch, restart: int = 0) -> str:
    return f"L{launch.index:02d}-R{restart:02d}"


def _check_started(run: CorpusRun, launch: Launch, resume_seq: int | None, where: str) -> None:
    """The launch's first attempt started fresh (``resume_seq`` None) or resumed exactly ``resume_seq``."""
    tag = _attempt_tag(launch)
    if resume_seq is None:
        started = [a for a in run.attempts() if a["attempt"] == tag]
        assert started and all(a["resumed"] is None for a in started), f"{where}: {tag} did not start fresh: {started}"
    else:
        assert_resumed(run, tag, launch.nproc, resume_seq, where)


def stop_at(run: CorpusRun, nproc: int, where: str, *, min_epoch: int = 0, resume_seq: int | None = None,
            sequence: str = "") -> tuple[int, dict]:
    """Launch on ``nproc`` replicas, SIGTERM the launcher while rank 0 is at ``where`` (a loop or a
    pause) in an epoch >= ``min_epoch``; check the stop (143, in time, a "stop" checkpoint) and the
    launch's start.  Returns the stop checkpoint's number and the measured latencies (``record_latency``)."""
    launch = run.launch(nproc, **PLACES[where])
    label = f"{run.script.id} {sequence} launch {launch.index} ({nproc} replicas)"
    first = run.wait_progress(f"rank 0 at {where} in epoch >= {min_epoch}",
                              lambda p: p["loop"] == where and p["epoch"] >= min_epoch)
    if where == "train":  # a few steps into the loop
        run.wait_progress("two more training steps", lambda p: p["loop"] != "train" or p["step"] >= first["step"] + 2)
    stop = run.stop()
    assert stop.code == 143, f"{label}: exit status {stop.code} after SIGTERM at {where}\n{run.last_log()}"
    latest = run.store().latest()
    assert latest is not None and latest.info.seq != resume_seq, f"{label}: the stop wrote no checkpoint"
    latency = record_latency(run, sequence, where, stop, latest.info.created - stop.sent)
    assert stop.seconds < STOP_BOUND_S, \
        f"{label}: SIGTERM at {where} took {stop.seconds:.1f} s to exit\n{run.last_log()}"
    _check_started(run, launch, resume_seq, label)
    assert latest.info.metadata.get("reason") == "stop", \
        f"{label}: the newest checkpoint {latest.info.seq} is not the stop's: {latest.info.metadata}"
    return latest.info.seq, latency


def finish(run: CorpusRun, nproc: int, resume_seq: int | None, sequence: str = "") -> None:
    """Launch on ``nproc`` replicas and let the job finish (exit 0), resuming ``resume_seq``."""
    launch = run.launch(nproc)
    label = f"{run.script.id} {sequence} launch {launch.index} ({nproc} replicas)"
    code = run.wait()
    assert code == 0, f"{label}: exit status {code}\n{run.last_log()}"
    _check_started(run, launch, resume_seq, label)


def kill_one_worker(run: CorpusRun, nproc: int, resume_seq: int | None = None, *, min_epoch: int = 0,
                    sequence: str = "") -> None:
    """Launch with periodic checkpoints and restarts, SIGKILL rank 1 while it trains after a periodic
    checkpoint; torchrun restarts the group, which resumes the newest checkpoint and finishes (exit 0)."""
    before = newest_seq(run)
    launch = run.launch(nproc, max_restarts=3, ADAPTIVE_CHECKPOINT_INTERVAL="0.5")
    label = f"{run.script.id} {sequence} launch {launch.index} ({nproc} replicas)"
    run.wait_progress(f"rank 1 training in epoch >= {min_epoch} after a periodic checkpoint",
                      lambda p: p["loop"] == "train" and p["epoch"] >= min_epoch and newest_seq(run) > before, rank=1)
    existing = newest_seq(run)
    run.kill_worker(1)
    code = run.wait()
    assert code == 0, f"{label}: exit status {code} after SIGKILL of rank 1 (--max-restarts=3)\n{run.last_log()}"
    _check_started(run, launch, resume_seq, label)
    tags = sorted({a["attempt"] for a in run.attempts() if a["attempt"].startswith(f"L{launch.index:02d}-")})
    assert len(tags) >= 2, f"{label}: torchrun did not restart the workers: attempts {tags}\n{run.last_log()}"
    for tag in tags[1:]:
        seq = assert_resumed(run, tag, nproc, None, f"{label} {tag}")
        assert seq >= existing, f"{label}: {tag} resumed checkpoint {seq}, older than {existing} (newest at the kill)"


def relaunch_finished(run: CorpusRun, nproc: int, sequence: str = "") -> None:
    """Relaunching a finished job resumes its last checkpoint, trains nothing and exits 0; that
    checkpoint says the job finished (reason "finished")."""
    seq, meta = newest_checkpoint(run)
    launch = run.launch(nproc)
    label = f"{run.script.id} {sequence} relaunch of the finished job"
    code = run.wait()
    assert code == 0, f"{label}: exit status {code}\n{run.last_log()}"
    tag = _attempt_tag(launch)
    assert_resumed(run, tag, nproc, seq, label)
    again = run.records("samples").get(tag, [])
    assert not again, f"{label}: {len(again) // nproc} steps run again " \
                      f"({sorted({(r['epoch'], r['loop']) for r in again})}) from checkpoint {seq}: {meta}"
    assert meta.get("reason") == "finished", f"{label}: the job's last checkpoint {seq} is not a 'finished' one: {meta}"


def run_reference(jobs: Jobs, script: Script, out: Path) -> CorpusRun:
    """The uninterrupted run on 2 replicas that the interrupted ones are compared with."""
    run = CorpusRun(jobs, script, out)
    finish(run, 2, None, "reference")
    assert_no_tracebacks(run, f"{script.id} reference")
    steps, rolled_back = committed_steps(script, run.records("samples"))
    assert not rolled_back
    assert_exact_samples(script, steps, f"{script.id} reference")
    return run


def check_job(run: CorpusRun, reference: CorpusRun, where: str, *, graceful: bool) -> None:
    """The whole interrupted job: no worker raised; after graceful stops no step twice or skipped;
    every sample once per epoch; totals, LR and step counters as in the uninterrupted run."""
    assert_no_tracebacks(run, where, peer_failures=not graceful)
    by_attempt = run.records("samples")
    steps, rolled_back = committed_steps(run.script, by_attempt)
    if graceful:
        assert not rolled_back, f"{where}: steps trained again after graceful stops: " \
                                f"{[(r['epoch'], r['loop'], r['step']) for r in rolled_back[:5]]}"
        assert_steps_continue(run.script, by_attempt, where)
    assert_exact_samples(run.script, steps, where)
    assert_like_reference(run, reference, where)
    if run.script.replay_exact:
        assert_replayed_exactly(run.script, steps, rolled_back, where)


def assert_replayed_exactly(script: Script, steps: list[dict], rolled_back: list[dict], where: str) -> None:
    """Every step trained again after a rollback (same replicas) got the same samples and the same loss,
    bit for bit: the random generators were restored with the model (dropout draws the same masks)."""
    kept = {(_position(script, r), r["rank"], r["world"]): r for r in steps}
    compared = 0
    for first in rolled_back:
        again = kept.get((_position(script, first), first["rank"], first["world"]))
        if again is None:
            continue
        assert again["idx"] == first["idx"], f"{where}: step {_position(script, first)} trained other samples again"
        assert again["loss"] == first["loss"], \
            f"{where}: step {_position(script, first)} on rank {first['rank']} replayed with loss {again['loss']!r}, " \
            f"first {first['loss']!r}: the replay is not bit-identical"
        compared += 1
    assert compared or not rolled_back, f"{where}: no replayed step to compare"


# ---------------------------------------------------------------------- the corpus

_LOSS = dict(rtol=0.35, atol=0.05)  # mean losses: dropout, per-process seeds and the replica count move them
PORTS: dict[str, Script] = {
    "mnist": Script(
        "mnist", "mnist_tutorial.py", ("--epochs", "4", "--log-interval", "10"), 4, ("train", "valid"),
        drop_last=frozenset({"train"}), exact=("n",),
        # autoscale picks other batch sizes in every run, from timings (and more replicas train with
        # larger ones): an early epoch's accuracy moves by 0.3 between runs, so only the last epoch's is
        # compared, and only on the worse side
        close=(Ratio("test_loss", "n", rtol=1.0, better="lower"), Ratio("correct", "n", atol=0.25, better="higher")),
        fixed_batch=False, sizes=(("train", 2560), ("valid", 640))),
    "cifar": Script(
        "cifar", "pytorch_cifar.py", ("--epochs", "4", "--milestones", "1,3", "--mixed-precision"), 4,
        ("train", "valid"), drop_last=frozenset({"train"}), exact=("total",),
        close=(Ratio("loss_sum", "total", **_LOSS), Ratio("correct", "total", atol=0.15)),
        sizes=(("train", 2560), ("valid", 1000))),
    "linreg": Script(
        "linreg", "linear_regression.py", ("--epochs", "4"), 4, ("train",), drop_last=frozenset({"train"}),
        sizes=(("train", 10000),)),
    "tutorial": Script(
        # PyTorch's torchrun tutorial: a next(iter(loader)) peek every epoch, its own snapshot, dropout
        "tutorial", "torchrun_tutorial.py", ("4", "1", "--batch_size", "32", "--size", "1024"), 4, ("train",),
        drop_last=frozenset({"train"}), exact=("n",), close=(Ratio("loss_sum", "n", **_LOSS),),
        sizes=(("train", 1024),), replay_exact=True),
    "dcgan": Script(
        # GAN losses swing by 2x from run to run: only the sample count is compared
        "dcgan", "dcgan.py", ("--epochs", "4"), 4, ("train",), models=("netD", "netG"), exact=("n",),
        fixed_batch=False, sizes=(("train", 2560),)),
}

SCHEDULER_EPOCHS = 6
STEPS_PER_EPOCH = 1920 // 64


def scheduler_script(scheduler: str, optimizer: str, *, amp: bool = False, clip: bool = False,
                     max_steps: bool = False) -> Script:
    """``lr_schedules.py`` with one scheduler and optimizer; ``max_steps``: break half-way into the last epoch."""
    args = ["--scheduler", scheduler, "--optimizer", optimizer, "--epochs", str(SCHEDULER_EPOCHS)]
    args += ["--amp"] * amp + ["--clip", "1.0"] * clip
    args += ["--max-steps", str(STEPS_PER_EPOCH * SCHEDULER_EPOCHS - STEPS_PER_EPOCH // 2)] * max_steps
    name = "-".join([scheduler, optimizer] + ["amp"] * amp + ["clip"] * clip + ["break"] * max_steps)
    return Script(name, "lr_schedules.py", tuple(args), SCHEDULER_EPOCHS, ("train", "valid"),
                  drop_last=frozenset({"train"}), exact=("n",),
                  close=(Ratio("loss_sum", "n", **_LOSS), Ratio("correct", "n", atol=0.1)),
                  lr_exact=scheduler != "reducelronplateau", partial_last_epoch=max_steps,
                  sizes=(("train", 1920), ("valid", 640)))
