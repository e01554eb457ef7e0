"""Ordinary training scripts (tests/corpus/) stopped, killed and rescaled under real torchrun.

The corpus holds AdaptDL's tutorial (MNIST step 5) and examples (pytorch-cifar,
linear regression, DCGAN), ported with the renames of docs/migration-adaptdl.md
and local data, PyTorch's own torchrun tutorial (a ``next(iter(loader))`` peek
every epoch, its own snapshot, dropout), and ``lr_schedules.py``: every LR scheduler of
``torch.optim.lr_scheduler`` with SGD (momentum), Adam, AdamW or Adagrad,
a GradScaler, clipping and an early ``break``.  Each test runs one script
through one sequence on 127.0.0.1 (gloo):

* ``term-train``, ``term-valid``, ``term-epoch-end``, ``term-between-loops``:
  SIGTERM to the launcher while rank 0 is in the training loop, in the
  validation loop, in plain code at an epoch end or between the loops; the
  launcher must exit 143 within ``STOP_BOUND_S``; the relaunch resumes;
* ``kill-worker``: SIGKILL of one worker; torchrun restarts the group
  (``--max-restarts``), which resumes the newest periodic checkpoint;
* ``rescale``: stopped on 2 replicas, relaunched on 1, stopped, relaunched on 3;
* ``gauntlet``: all of these in one job, then a relaunch of the finished job.

Checked each time (tests/corpus_harness.py): the exit statuses; every
resumed process held, right after building its wrappers, exactly the
parameters, optimizer, scheduler and scaler state of the checkpoint it
resumed; after graceful stops no step trained twice or skipped; every sample
once per epoch; the ``synchronized()`` totals equal an uninterrupted run's
(counts exactly, losses and accuracies close), and so do the learning rates
and step counters.  The measured stop latencies go to ``latencies.jsonl``
in each job folder and to the log.

The fast sample (a few minutes on 2 cores) runs by default; the full matrix
is marked ``slow`` (``pytest -m slow tests/test_corpus_torchrun.py``).
"""

from __future__ import annotations

import pytest

from corpus_harness import (PORTS, CorpusRun, Script, check_job, finish, kill_one_worker, relaunch_finished,
                            run_reference, scheduler_script, stop_at)
from elastic_harness import Jobs

pytestmark = pytest.mark.distributed


@pytest.fixture
def jobs(tmp_path):
    harness = Jobs(tmp_path)
    yield harness
    harness.cleanup()


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """The uninterrupted run of each script, run once per session when a test first needs it."""
    folder = tmp_path_factory.mktemp("corpus-references")
    harness = Jobs(folder)
    cache: dict[str, CorpusRun] = {}

    def get(script: Script) -> CorpusRun:
        if script.id not in cache:
            cache[script.id] = run_reference(harness, script, folder / script.id)
        return cache[script.id]

    yield get
    harness.cleanup()


# ---------------------------------------------------------------------- sequences


def term_in(where: str):
    """SIGTERM while rank 0 is at ``where`` in epoch 1 or later, then relaunch on as many replicas."""
    def sequence(run: CorpusRun, name: str) -> None:
        seq, _ = stop_at(run, 2, where, min_epoch=1, sequence=name)
        finish(run, 2, seq, name)
    return sequence


def kill_worker(run: CorpusRun, name: str) -> None:
    kill_one_worker(run, 2, min_epoch=1, sequence=name)


def rescale(run: CorpusRun, name: str) -> None:
    """2 replicas, stopped in training; 1 replica, stopped in validation (or training); 3 to the end."""
    seq, _ = stop_at(run, 2, "train", min_epoch=1, sequence=name)
    seq, _ = stop_at(run, 1, "valid" if "valid" in run.script.loops else "train", resume_seq=seq, sequence=name)
    finish(run, 3, seq, name)


def gauntlet(run: CorpusRun, name: str) -> None:
    """Every event in one job: SIGTERM in training, in validation, at an epoch end (on 1 replica), a
    SIGKILL on 3 replicas, then a relaunch of the finished job."""
    seq, _ = stop_at(run, 2, "train", min_epoch=1, sequence=name)
    seq, _ = stop_at(run, 2, "valid", resume_seq=seq, sequence=name)
    seq, _ = stop_at(run, 1, "epoch-end", resume_seq=seq, sequence=name)
    kill_one_worker(run, 3, seq, sequence=name)
    relaunch_finished(run, 2, name)


SEQUENCES = {
    "term-train": term_in("train"),
    "term-valid": term_in("valid"),
    "term-epoch-end": term_in("epoch-end"),
    "term-between-loops": term_in("between-loops"),
    "kill-worker": kill_worker,
    "rescale": rescale,
    "gauntlet": gauntlet,
}


def run_sequence(jobs: Jobs, references, tmp_path, script: Script, sequence: str) -> None:
    reference = references(script)
    run = CorpusRun(jobs, script, tmp_path / "job")
    SEQUENCES[sequence](run, sequence)
    check_job(run, reference, f"{script.id} {sequence}", graceful=sequence not in ("kill-worker", "gauntlet"))


# ---------------------------------------------------------------------- the ports of AdaptDL's scripts

FAST_PORTS = {("tutorial", "kill-worker")}
SAMPLED_PORTS = {("mnist", "term-epoch-end"), ("cifar", "term-valid")}  # 25-35 s each: CI runs them after the default suite


def _port_cases():
    for script in PORTS.values():
        names = ["term-train", "term-epoch-end", "kill-worker", "rescale"]
        if "valid" in script.loops:
            names.insert(1, "term-valid")
        if script.id == "cifar":
            names.append("term-between-loops")
        for name in names:
            marks = () if (script.id, name) in FAST_PORTS else (pytest.mark.slow,)
            if (script.id, name) in SAMPLED_PORTS:
                marks += (pytest.mark.ci_sample,)
            yield pytest.param(script.id, name, id=f"{script.id}-{name}", marks=marks)


@pytest.mark.parametrize("script_id, sequence", list(_port_cases()))
def test_adaptdl_port_survives(jobs, references, tmp_path, script_id, sequence):
    run_sequence(jobs, references, tmp_path, PORTS[script_id], sequence)


# ---------------------------------------------------------------------- every LR scheduler

SCHEDULERS = [
    ("steplr", "sgd", {}),
    ("multisteplr", "sgd", {"amp": True, "clip": True}),
    ("exponentiallr", "adam", {}),
    ("cosineannealinglr", "adamw", {"amp": True}),
    ("cosineannealingwarmrestarts", "adagrad", {"clip": True}),
    ("onecyclelr", "adamw", {"amp": True, "clip": True, "max_steps": True}),
    ("cycliclr", "sgd", {"max_steps": True}),
    ("reducelronplateau", "adam", {"clip": True}),
    ("lambdalr", "adagrad", {"amp": True}),
    ("multiplicativelr", "sgd", {}),
    ("constantlr", "adam", {"max_steps": True}),
    ("sequentiallr", "adamw", {"clip": True}),
    ("chainedscheduler", "sgd", {"amp": True}),
    ("polynomiallr", "adagrad", {"max_steps": True}),
    ("linearlr", "adam", {"amp": True, "clip": True}),
]
FAST_SCHEDULER = ("onecyclelr", "adamw")


@pytest.mark.parametrize("scheduler, optimizer, options",
                         [pytest.param(s, o, opts, id=scheduler_script(s, o, **opts).id, marks=pytest.mark.slow)
                          for s, o, opts in SCHEDULERS])
def test_every_scheduler_and_optimizer_survives_the_gauntlet(jobs, references, tmp_path, scheduler, optimizer,
                                                             options):
    run_sequence(jobs, references, tmp_path, scheduler_script(scheduler, optimizer, **options), "gauntlet")


@pytest.mark.slow
@pytest.mark.ci_sample  # about 25 s: CI runs it after the default suite
def test_scheduler_amp_clip_and_break_survive_a_rescale(jobs, references, tmp_path):
    """The fast sample's scheduler case: OneCycleLR stepped per step, AdamW, GradScaler, clipping, an
    early break in the last epoch; 2 -> 1 -> 3 replicas."""
    scheduler, optimizer, options = next(case for case in SCHEDULERS if case[:2] == FAST_SCHEDULER)
    run_sequence(jobs, references, tmp_path, scheduler_script(scheduler, optimizer, **options), "rescale")
