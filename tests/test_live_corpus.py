"""The corpus of ordinary training scripts (tests/corpus/) under ``adaptive-run --live``: a join, a leave, a kill.

``test_corpus_torchrun.py`` stops, kills and rescales these scripts under
plain torchrun, where every change restarts every worker from the
checkpoint.  Here the same scripts, unchanged, run as a live job, whose
members change while the others keep running in memory (docs/live.md).
Each case runs one script through one sequence on 127.0.0.1 (gloo), each
node an ``adaptive-run --live`` of one worker:

1. node 0 starts (its launcher hosts the job's store) and trains alone;
2. **join**: node 1 starts once node 0 trains; its worker takes the state
   from node 0's and trains with it;
3. **leave**: SIGTERM to node 1's launcher: its worker leaves at an agreed
   step and ends with 143 (so does the launcher); node 0 trains on alone;
4. node 2 starts and joins;
5. **kill**: SIGKILL of node 0's worker (rank 0) while it trains: node 2's
   worker re-forms alone and goes back to the last committed step; node 0's
   launcher starts its worker again, which joins; the job finishes.

Checked from what the scripts record (``tests/corpus/corpus_probe.py``:
every step's samples with the process's pid, its live generation and
whether the step was discarded; the totals of ``synchronized()`` blocks;
the learning rate at each epoch's end), not from log lines:

* PIDs: node 0's first worker took every step it took in one process until
  the kill and is gone after it; node 2's worker survived the kill in its
  process; node 1's worker is gone after the leave; nothing else was
  started (one process per launch, one restart on node 0);
* the launchers end with 0, node 1's with 143 (one worker per node: that is
  its worker's status), and no log holds a Python traceback;
* every step counts with the records of its newest generation, in which all
  the members of that generation trained it (a step discarded on the
  survivor, because not every member applied it, was trained again later:
  ``live_harness.check_after_rollbacks`` reads the live worker's records the
  same way); every sample once per epoch in every loop, training and
  validation (with ``drop_last``, less than one global batch dropped);
* the totals of the ``synchronized()`` blocks count exactly the samples the
  probe recorded for their loop and epoch, less at most what the killed
  worker counted in its last step (docs/live.md: a member killed after its
  last step was applied, before it published what it counted, takes that
  with it, and the library warns);
* the learning rate at every epoch's end is what the script's scheduler
  gives after that many epochs (or steps, for OneCycleLR stepped per batch)
  of an uninterrupted run: joiners received the scheduler's state, and a
  discarded step's scheduler step was undone.

Two allowances: the probe writes a step's record after its update, so a
worker killed between its update and its record leaves a step that counts
(every member applied it) without its record, whose samples may then be
missing; and with autoscale (mnist) ``drop_last`` drops less than the
largest global batch of the job, since the batch planned after an epoch's
last step taken may be larger than those taken.

Why each script (tests/corpus/README.md lists their patterns): mnist builds
its loaders, autoscale, model and scheduler before ``init_process_group``
and an accumulator in every epoch's ``test()``; cifar has rank 0 build its
loader before a ``dist.barrier()``, DataLoader workers, a validation loop,
AMP and MultiStepLR; linreg calls ``init_process_group`` at import and
drops the last batch; dcgan has two wrappers and two optimizers, autoscale,
DataLoader workers and ``b_size`` bound in the loop and used after it;
lr_schedules steps OneCycleLR per batch with AdamW, AMP, gradient clipping,
persistent DataLoader workers and an early ``break`` (``--max-steps``).

dcgan is killed between two of its steps (in the probe's pause after a
step), not at a random moment: a loss between the updates of its two
optimizers cannot be undone in memory and takes the restart path from the
checkpoint (docs/live.md, Limits), which is not what this test is about.

The steps sleep a little (``CORPUS_STEP_SLEEP``) until the killed worker's
restart trains, so that the job outlasts the sequence on a busy machine;
then they run at full speed to the end.

It found two library bugs, each with its own test now:
``test_a_joiner_admitted_after_a_loops_last_step_still_runs_the_loop_body``
checks the fix of another one this test found: a join agreed after a loop's
last step is made at the next loop's first boundary, so that the joiner
runs a loop body.

Every case is ``slow`` (17-35 s each on 2 cores, up to 55 s when other
jobs load them); CI runs two of the fastest (``ci_sample``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import portpicker
import pytest
import torch

from corpus_harness import PORTS, STEPS_PER_EPOCH, Script, scheduler_script
from elastic_harness import Jobs, live_pids, tail, wait_exit, wait_for
from live_harness import newest_records

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

#: Seconds a wait for one of the sequence's events may take (a node's start-up on a busy machine included).
EVENT_TIMEOUT_S = 90.0
#: Steps a process must train in a state before the test moves on.
SETTLE_STEPS = 3
#: Epochs of every script: at the slowed pace (CORPUS_STEP_SLEEP) 45-60 s, about twice what the sequence takes on
#: a busy machine (each node's start-up then takes 5-10 s); the epochs left after it run at full speed.
EPOCHS = 12

@dataclasses.dataclass(frozen=True)
class LiveCase:
    """A corpus script, how to run it for the sequence, and what its records must satisfy."""

    script: Script
    #: seconds each step of a loop sleeps until the sequence is done (CORPUS_STEP_SLEEP)
    step_sleep: str
    #: the ``synchronized()`` blocks that count their loop's samples: (block, loop, total)
    counted: tuple[tuple[str, str, str], ...] = ()
    #: the learning rate the probe records at the end of an epoch, as an uninterrupted run has it
    lr_after: Callable[[int], float] | None = None
    #: SIGKILL only in the probe's pause after a step (two optimizers per step: see the module docstring)
    kill_between_steps: bool = False


def _epochs(script: Script, *args: str) -> Script:
    """``script`` with other arguments and :data:`EPOCHS` epochs."""
    return dataclasses.replace(script, args=("--epochs", str(EPOCHS), *args), epochs=EPOCHS)


_MAX_STEPS = STEPS_PER_EPOCH * EPOCHS - STEPS_PER_EPOCH // 2  # lr_schedules breaks half-way into its last epoch


def _setting(args: tuple[str, ...], **values: int) -> tuple[str, ...]:
    """``args`` with the values of options replaced (``max_steps=`` for ``--max-steps``)."""
    replaced = list(args)
    for option, value in values.items():
        replaced[replaced.index("--" + option.replace("_", "-")) + 1] = str(value)
    return tuple(replaced)


_ONECYCLE = scheduler_script("onecyclelr", "adamw", amp=True, clip=True, max_steps=True)
_ONECYCLE = dataclasses.replace(_ONECYCLE, args=_setting(_ONECYCLE.args, epochs=EPOCHS, max_steps=_MAX_STEPS),
                                epochs=EPOCHS)


def _onecycle_lr(epoch: int) -> float:
    """lr_schedules' OneCycleLR (AdamW, lr 0.05 / 50) after the steps of epochs 0..epoch."""
    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.05 / 50)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05 / 50, total_steps=EPOCHS * STEPS_PER_EPOCH)
    for _ in range(min(STEPS_PER_EPOCH * (epoch + 1), _MAX_STEPS)):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


CASES: dict[str, LiveCase] = {
    "mnist": LiveCase(_epochs(PORTS["mnist"], "--log-interval", "10"), "train=0.15,valid=0.05",
                      counted=(("test", "valid", "n"),), lr_after=lambda epoch: 0.7 ** (epoch + 1)),
    "cifar": LiveCase(_epochs(PORTS["cifar"], "--milestones", "1,3", "--mixed-precision"), "train=0.15,valid=0.05",
                      counted=(("train", "train", "total"), ("valid", "valid", "total")),
                      lr_after=lambda epoch: 0.1 * 0.1 ** sum(epoch + 1 >= m for m in (1, 3))),
    "linreg": LiveCase(dataclasses.replace(_epochs(PORTS["linreg"], "--size", "3000"), sizes=(("train", 3000),)),
                       "train=0.2", lr_after=lambda epoch: 0.1),  # its MultiStepLR is never stepped
    "dcgan": LiveCase(_epochs(PORTS["dcgan"]), "train=0.4", counted=(("train", "train", "n"),),
                      lr_after=lambda epoch: 0.0005,  # StepLR(15) stepped per epoch: not in 12 epochs
                      kill_between_steps=True),
    "lr_schedules": LiveCase(_ONECYCLE, "train=0.1,valid=0.05",
                             counted=(("train", "train", "n"), ("valid", "valid", "n")), lr_after=_onecycle_lr),
}
CI_SAMPLE = {"mnist", "lr_schedules"}  # 17-21 s each on 2 cores (linreg too): the two that carry the most patterns


class LiveJob:
    """The launchers (nodes) of one live job of a corpus script, and what its processes recorded."""

    def __init__(self, jobs: Jobs, case: LiveCase, out: Path) -> None:
        self.jobs, self.case, self.out = jobs, case, out
        self.port = portpicker.pick_unused_port()
        self.nodes: list[subprocess.Popen] = []
        self.ending: set[int] = set()  # nodes the test ends
        self.full_speed = out / "full-speed"  # CORPUS_STEP_SLEEP_UNTIL

    def start(self, restarts: int = 0) -> subprocess.Popen:
        """A node: ``adaptive-run --live`` of one worker; its processes write files tagged ``L<node>-R<start>``."""
        index, script = len(self.nodes), self.case.script
        cmd = [sys.executable, "-m", "adaptive.elastic.launcher", "--live", "--nnodes", "1:4", "--nproc-per-node",
               "1", "--max-restarts", str(restarts), "--rdzv-endpoint", f"127.0.0.1:{self.port}",
               str(script.path), *script.args]
        knobs = {"CORPUS_OUT": str(self.out), "CORPUS_LAUNCH": str(index), "ADAPTIVE_CHECKPOINT_INTERVAL": "0",
                 "ADAPTIVE_SHARE_PATH": str(self.out / "share"), "ADAPTIVE_PROGRESS_INTERVAL": "0",
                 "CORPUS_STEP_SLEEP": self.case.step_sleep, "CORPUS_STEP_SLEEP_UNTIL": str(self.full_speed)}
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.log(index), "ab") as log:
            proc = subprocess.Popen(cmd, env=self.jobs.env(self.out, **knobs), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=str(self.out))
        self.jobs.procs.append(proc)  # Jobs.cleanup kills it and its workers, by pid
        self.nodes.append(proc)
        return proc

    def log(self, index: int) -> Path:
        return self.out / f"node{index}.log"

    def logs(self) -> str:
        """The end of every node's log (for a failure's message)."""
        return "\n".join(f"--- node{i}.log\n{tail(self.log(i), 50)}" for i in range(len(self.nodes)))

    def log_text(self) -> str:
        return "\n".join(self.log(i).read_text(errors="replace") for i in range(len(self.nodes))
                         if self.log(i).exists())

    def samples(self) -> list[dict]:
        """Every step record of every process, oldest first; ``attempt`` is ``L<node>-R<start>``, ``rank`` the
        rank the process had when it wrote the record."""
        records = []
        for path in self.out.glob("samples.L*-R*.rank*.jsonl"):
            _, attempt, rank, _ = path.name.split(".")
            records += [{**record, "attempt": attempt, "rank": int(rank[len("rank"):])} for record in _lines(path)]
        return sorted(records, key=lambda r: r["time"])

    def records(self, kind: str) -> list[dict]:
        """Every ``kind`` record (totals, epochs) of every process."""
        return [record for path in self.out.glob(f"{kind}.L*-R*.rank*.jsonl") for record in _lines(path)]

    def wait(self, what: str, predicate: Callable[[list[dict]], object]) -> list[dict]:
        """Poll the step records until ``predicate(records)`` holds; fail at once when a node ended."""
        def check():
            for index, node in enumerate(self.nodes):
                if index not in self.ending and node.poll() is not None:
                    raise AssertionError(f"node {index} ended with {node.returncode} while waiting for {what}")
            records = self.samples()
            return records if predicate(records) else None

        try:
            return wait_for(check, EVENT_TIMEOUT_S, what, interval=0.02)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.logs()}") from None


def _lines(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines file that a process may be appending to."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def _of(records: list[dict], attempt: str) -> list[dict]:
    return [r for r in records if r["attempt"] == attempt]


def _pid(records: list[dict], attempt: str) -> int:
    """The one process that wrote ``attempt``'s records."""
    pids = {r["pid"] for r in _of(records, attempt)}
    assert len(pids) == 1, f"{attempt}: recorded by the processes {pids}"
    return pids.pop()


def _trained(records: list[dict], attempt: str, *, world: int | None = None, after: float = 0.0) -> int:
    """Training steps ``attempt`` took (not discarded) after ``after``, in a world of ``world``."""
    return sum(r["loop"] == "train" and not r["discarded"] and r["time"] > after
               and (world is None or r["world"] == world) for r in _of(records, attempt))


def _kill_while_training(job: LiveJob, victim: int) -> float:
    """SIGKILL ``victim`` while the job trains early in an epoch (far from the loop's end: a loss in code between
    loops takes the restart path), with ``kill_between_steps`` right after it recorded a step (in the probe's
    pause); when it was sent."""
    def ready(records: list[dict]) -> bool:
        mine = [r for r in records if r["pid"] == victim]
        last = records[-1] if records else None
        if not mine or last is None or last["loop"] != "train" or last["discarded"]:
            return False
        seen = {i for r in records if (r["epoch"], r["loop"]) == (last["epoch"], "train") for i in r["idx"]}
        if len(seen) > 0.6 * job.case.script.dataset_sizes["train"]:
            return False
        return not job.case.kill_between_steps or time.time() - mine[-1]["time"] < 0.1

    job.wait(f"worker {victim} early in a training loop", ready)
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    return killed


def _counts(records: list[dict]) -> dict[tuple[int, str], collections.Counter]:
    """(epoch, loop) -> how often each sample was trained."""
    counts: dict[tuple[int, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for record in records:
        counts[record["epoch"], record["loop"]].update(record["idx"])
    return counts


def _check_steps(script: Script, records: list[dict], victim: int) -> None:
    """Every step was trained, in its newest generation, by all that generation's members (but for the killed
    worker's step after its last record); every sample once per epoch and loop."""
    newest = newest_records(records, key=lambda record: (record["epoch"], record["loop"], record["step"]))
    victim_last = [r for r in records if r["pid"] == victim][-1]
    unrecorded: dict[tuple[int, str], int] = collections.defaultdict(int)
    for (epoch, loop, step), group in sorted(newest.items()):
        worlds, ranks = {r["world"] for r in group}, sorted(r["rank"] for r in group)
        where = f"epoch {epoch} {loop} step {step} (generation {group[0]['generation']})"
        assert len(worlds) == 1, f"{where}: trained by members of different worlds: {group}"
        if ranks == list(range(worlds.pop())):
            continue
        # The one gap allowed: the killed worker's next step after its last record (the first of the next epoch,
        # may be), in its generation.
        assert not unrecorded and len(ranks) == len(set(ranks)) == group[0]["world"] - 1 \
            and group[0]["generation"] == victim_last["generation"] and victim_last["rank"] not in ranks \
            and (loop, step) == (victim_last["loop"], victim_last["step"] + 1), \
            f"{where}: trained by ranks {ranks} of {group[0]['world']}: {[(r['pid'], r['rank']) for r in group]}"
        unrecorded[epoch, loop] = max(len(r["idx"]) for r in group)
    kept = [r for group in newest.values() for r in group]
    counts = _counts(kept)
    assert sorted({epoch for epoch, _ in counts}) == list(range(script.epochs)), sorted(counts)
    for (epoch, loop), counter in sorted(counts.items()):
        where = f"epoch {epoch} {loop}"
        steps = {key[2]: group for key, group in newest.items() if key[:2] == (epoch, loop)}
        repeats = sum(count - 1 for count in counter.values())
        assert repeats < steps[max(steps)][0]["world"], \
            f"{where}: {repeats} samples trained twice: {sorted(i for i, c in counter.items() if c > 1)[:20]}"
        size = script.dataset_sizes[loop]
        assert all(0 <= i < size for i in counter), f"{where}: an index out of range"
        if script.partial_last_epoch and epoch == script.epochs - 1 and loop == "train":
            continue  # --max-steps: the job ends inside its last epoch
        # drop_last drops less than a global batch: this epoch's, or with autoscale any the job took (the batch
        # planned after the last step taken may have been larger)
        batches = {key: sum(len(r["idx"]) for r in group) for key, group in newest.items() if key[1] == loop
                   and (key[0] == epoch or not script.fixed_batch)}
        allowed = (max(batches.values()) - 1 if loop in script.drop_last else 0) + unrecorded[epoch, loop]
        missing = sorted(set(range(size)) - set(counter))
        assert len(missing) <= allowed, f"{where}: {len(missing)} samples never trained (at most {allowed} may " \
                                        f"be): {missing[:20]}"


def _check_totals(job: LiveJob, records: list[dict], victim: int) -> None:
    """Each ``synchronized()`` block's count equals the samples the probe recorded for its loop and epoch, on
    every member that ran it, less at most what the killed worker counted in its last recorded step."""
    newest = newest_records(records, key=lambda record: (record["epoch"], record["loop"], record["step"]))
    trained = {key: sum(counter.values()) for key, counter in
               _counts([r for group in newest.values() for r in group]).items()}
    victim_last = [r for r in records if r["pid"] == victim][-1]
    totals = collections.defaultdict(list)
    for record in job.records("totals"):
        totals[record["epoch"], record["block"]].append(record["values"])
    for block, loop, key in job.case.counted:
        for epoch in range(job.case.script.epochs):
            assert totals.get((epoch, block)), f"epoch {epoch}: no {block} totals"
            # A step the killed worker did not record is in neither count; one it recorded and did not publish
            # (killed before the loop's next step began) is in the probe's only.
            lost = {0, len(victim_last["idx"])} if (victim_last["epoch"], victim_last["loop"]) == (epoch, loop) \
                else {0}
            for values in totals[epoch, block]:
                assert trained[epoch, loop] - values[key] in lost, \
                    f"epoch {epoch} {block}: {key} = {values[key]}, but the probe recorded " \
                    f"{trained[epoch, loop]} samples (a shortfall of one of {sorted(lost)} allowed)"


def _check_learning_rates(job: LiveJob) -> None:
    """Every process that ended an epoch recorded the learning rate an uninterrupted run has there."""
    ends = job.records("epochs")
    assert sorted({r["epoch"] for r in ends}) == list(range(job.case.script.epochs))
    for record in ends:
        expected = job.case.lr_after(record["epoch"])
        assert math.isclose(record["lr"], expected, rel_tol=1e-9, abs_tol=1e-15), \
            f"LR after epoch {record['epoch']}: {record['lr']}, uninterrupted {expected}"


def _no_tracebacks(job: LiveJob) -> None:
    for index in range(len(job.nodes)):
        text = job.log(index).read_text(errors="replace")
        if "Traceback (most recent call last)" in text:
            at = text.index("Traceback (most recent call last)")
            raise AssertionError(f"node{index}.log holds a traceback:\n{text[max(0, at - 2000):at + 3000]}\n...\n"
                                 f"{text[-3000:]}")


@pytest.fixture
def jobs(tmp_path):
    started = Jobs(tmp_path)
    yield started
    started.cleanup()


@pytest.mark.parametrize("name", [pytest.param(name, marks=(pytest.mark.ci_sample,) if name in CI_SAMPLE else ())
                                  for name in CASES])
def test_a_corpus_script_joins_leaves_and_loses_a_worker_under_live(jobs, tmp_path, name):
    case = CASES[name]
    job = LiveJob(jobs, case, tmp_path / "job")
    # 1. node 0 trains alone.
    node0 = job.start(restarts=1)
    records = job.wait("node 0 to train", lambda rs: _trained(rs, "L00-R00") >= SETTLE_STEPS)
    first = _pid(records, "L00-R00")

    # 2. join: node 1's worker trains with node 0's.
    node1 = job.start()
    records = job.wait("node 1 to join", lambda rs: _trained(rs, "L01-R00", world=2) >= SETTLE_STEPS)
    joiner = _pid(records, "L01-R00")

    # 3. leave: SIGTERM to node 1's launcher; its worker ends with 143, node 0's trains on alone.
    job.ending.add(1)
    left = time.time()
    node1.send_signal(signal.SIGTERM)
    assert wait_exit(node1, 60, job.log(1)) == 143, job.logs()
    assert live_pids([joiner]) == [], "the leaver's worker still runs"
    job.wait("node 0 to train alone after the leave",
             lambda rs: _trained(rs, "L00-R00", world=1, after=left) >= 2)

    # 4. node 2 joins.
    node2 = job.start()
    records = job.wait("node 2 to join", lambda rs: _trained(rs, "L02-R00", world=2) >= SETTLE_STEPS)
    survivor = _pid(records, "L02-R00")

    # 5. kill: node 0's worker (rank 0); node 2's re-forms without it, node 0's launcher starts it again.
    killed = _kill_while_training(job, first)
    assert wait_for(lambda: live_pids([first]) == [], 10, "the killed worker to be gone")
    job.wait("node 0's restarted worker to join", lambda rs: _trained(rs, "L00-R01", world=2) >= 1)
    job.full_speed.touch()  # the sequence is done: the steps stop sleeping
    job.ending.update({0, 2})
    for index, node in ((0, node0), (2, node2)):
        assert wait_exit(node, 240, job.log(index)) == 0, job.logs()
    _no_tracebacks(job)

    records = job.samples()
    # PIDs, from the records: one process per launch, one restart on node 0, no other.
    assert sorted({r["attempt"] for r in records}) == ["L00-R00", "L00-R01", "L01-R00", "L02-R00"], job.logs()
    restarted = _pid(records, "L00-R01")
    assert _pid(records, "L00-R00") == first and _pid(records, "L01-R00") == joiner
    assert _pid(records, "L02-R00") == survivor and len({first, joiner, survivor, restarted}) == 4
    assert max(r["time"] for r in _of(records, "L00-R00")) < killed, "the killed worker trained after the kill"
    assert _trained(records, "L02-R00", after=killed) > 0, "the survivor trained nothing after the kill"
    worlds = [r["world"] for r in _of(records, "L00-R00") if not r["discarded"]]
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [1, 2, 1, 2], worlds
    assert live_pids([first, joiner, survivor, restarted]) == []
    # What was trained: every step by all its newest generation's members, every sample once per epoch.
    _check_steps(case.script, records, first)
    _check_totals(job, records, first)
    _check_learning_rates(job)


def test_a_joiner_admitted_after_a_loops_last_step_still_runs_the_loop_body(jobs, tmp_path):
    """dcgan with one step per epoch (128 pictures, batch 128): every boundary after a step is its loop's last,
    so every join is agreed there.  The joiner must still train (its loop body binds ``b_size``, which the code
    after the loop reads), both nodes finish, and no log holds a traceback.  Deterministic; about 20 s."""
    base = CASES["dcgan"]
    case = dataclasses.replace(base, script=dataclasses.replace(base.script, args=("--epochs", "200", "--size", "128"),
                                                                epochs=200, sizes=(("train", 128),)),
                               step_sleep="train=0.2")
    job = LiveJob(jobs, case, tmp_path / "job")
    nodes = [job.start()]
    job.wait("node 0 to train", lambda rs: _trained(rs, "L00-R00") >= 2)
    nodes.append(job.start())
    job.wait("node 1 to join", lambda rs: _trained(rs, "L01-R00", world=2) >= 2)
    job.full_speed.touch()
    job.ending.update({0, 1})
    for index, node in enumerate(nodes):
        assert wait_exit(node, 120, job.log(index)) == 0, job.logs()
    _no_tracebacks(job)
