"""What the corpus scripts record for the tests (does nothing when ``CORPUS_OUT`` is unset).

The scripts in this folder are ordinary training scripts; these few calls are
the only lines they carry for the tests.  Every file is written into
``$CORPUS_OUT``, per launch, torchrun attempt and rank, so that nothing a
later attempt writes hides what an earlier one did:

``progress.rank<R>.json``
    rewritten at every step and pause: pid, epoch, loop ("train", "valid",
    or a pause name), the loader's step, world size, attempt.  Tests poll it
    to time their signals.
``samples.<attempt>.rank<R>.jsonl``
    one line per step: epoch, loop, the loader's step (over the whole job),
    world size and the indices of the samples this rank trained on; also the
    pid, and under ``adaptive-run --live`` the live generation and whether
    the step was discarded (a member was lost before every member applied
    it: it is trained again), both read at the call, after the step's
    update (outside live mode: None and False).  ``<R>`` is the rank when
    the line was written: a live member's rank changes with the membership.
``totals.<attempt>.rank<R>.jsonl``
    one line per ``synchronized()`` block: epoch, block name, the totals.
``epochs.<attempt>.rank<R>.jsonl``
    one line per epoch end: learning rate and whatever the script adds.
``attempts.jsonl``
    one line per process start: attempt, rank, pid, the resumed checkpoint.
``restored.<attempt>.rank<R>.pt``
    on a resume, right after the wrappers were built: the model's
    parameters and the optimizer, LR scheduler and grad scaler states they
    hold (``torch.save``), to compare with the checkpoint that was resumed.
``done.<attempt>.rank<R>.json``
    at the end: the loaders' steps and the optimizers' step counters.

Knobs: ``CORPUS_LAUNCH`` (the test's launch number, default 0),
``CORPUS_PAUSE`` (seconds each :func:`pause` named in ``CORPUS_PAUSE_AT``
lasts, default 0 and "epoch-end": a slow log or save between loops), ``CORPUS_STEP_SLEEP`` (seconds added to every
step of a loop, ``"valid=0.05"``: a slower validation, so that a test can
signal the script inside it), ``CORPUS_STEP_SLEEP_UNTIL`` (a path: the steps sleep only until that file
exists, so that a test can slow a job down while it acts on it and let it finish at full speed).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from typing import Any, Mapping

import torch

OUT = os.environ.get("CORPUS_OUT")
PAUSE = float(os.environ.get("CORPUS_PAUSE", "0"))
PAUSE_AT = set(filter(None, os.environ.get("CORPUS_PAUSE_AT", "epoch-end").split(",")))
STEP_SLEEP = {loop: float(seconds) for loop, _, seconds in
              (item.partition("=") for item in os.environ.get("CORPUS_STEP_SLEEP", "").split(",") if item)}
STEP_SLEEP_UNTIL = os.environ.get("CORPUS_STEP_SLEEP_UNTIL")

if OUT is not None:  # under a test: SIGUSR1 writes every thread's Python stack to stderr (a hang's whereabouts)
    faulthandler.register(signal.SIGUSR1)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def attempt() -> str:
    """This process's attempt: the test's launch number and torchrun's restart count."""
    return f"L{int(os.environ.get('CORPUS_LAUNCH', '0')):02d}-R{int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')):02d}"


def _path(kind: str, suffix: str) -> str:
    return os.path.join(OUT, f"{kind}.{attempt()}.rank{_rank()}.{suffix}")


def _append(path: str, record: Mapping[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _write_json(path: str, payload: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically: the tests read it while the script runs."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def _plain(value: Any) -> Any:
    """A number, list or string for JSON (tensors and numpy values become numbers)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def progress(epoch: int | None, loop: str, step: int | None = None) -> None:
    """Say where this rank is now (tests time their signals with it)."""
    if OUT is None:
        return
    _write_json(os.path.join(OUT, f"progress.rank{_rank()}.json"),
                {"pid": os.getpid(), "epoch": epoch, "loop": loop, "step": step, "world": _world(),
                 "attempt": attempt(), "time": time.time()})


def step(epoch: int, loop: str, loader: Any, index: torch.Tensor, **values: float) -> None:
    """Record the samples of this step (``index``: what the dataset returned as indices), and ``values``
    such as the step's loss (the tests compare them between a run and its replay)."""
    if OUT is None:
        return
    _append(_path("samples", "jsonl"), {"epoch": epoch, "loop": loop, "step": loader.step, "world": _world(),
                                         "time": time.time(),
                                         "idx": [int(i) for i in index.reshape(-1).tolist()],
                                         **_live_step(),
                                         **{key: float(value) for key, value in values.items()}})
    progress(epoch, loop, loader.step)
    if STEP_SLEEP.get(loop) and not (STEP_SLEEP_UNTIL and os.path.exists(STEP_SLEEP_UNTIL)):
        time.sleep(STEP_SLEEP[loop])


def _live_step() -> dict:
    """This process's pid, its live generation (None outside ``adaptive-run --live``) and whether the step in
    flight is discarded (``adaptive.runtime.step.discarded()``: it lost a member before every member applied its
    update, and is trained again after the members re-form)."""
    from adaptive.runtime import membership
    from adaptive.runtime import step as step_records

    return {"pid": os.getpid(), "generation": membership.generation_number(),
            "discarded": step_records.discarded()}


def totals(epoch: int, block: str, values: Mapping[str, Any]) -> None:
    """Record an accumulator's totals (call inside its ``synchronized()`` block)."""
    if OUT is None:
        return
    _append(_path("totals", "jsonl"), {"epoch": epoch, "block": block,
                                        "values": {str(k): _plain(v) for k, v in values.items()}})


def epoch_end(epoch: int, **info: Any) -> None:
    """Record the end of an epoch's work (learning rate, ...)."""
    if OUT is None:
        return
    _append(_path("epochs", "jsonl"), {"epoch": epoch, **{k: _plain(v) for k, v in info.items()}})


def pause(epoch: int, where: str) -> None:
    """Plain code between loops or epochs that takes a while (a slow log or save): ``CORPUS_PAUSE`` s
    if ``where`` is one of ``CORPUS_PAUSE_AT``."""
    if OUT is None:
        return
    progress(epoch, where)
    if PAUSE and where in PAUSE_AT:
        time.sleep(PAUSE)


def _wrapper_state(model: Any) -> dict:
    """What an AdaptiveDataParallel holds: the same keys as its checkpointed state."""
    state = {"model": model.module.state_dict(), "optimizer": model.optimizer.state_dict()}
    if model.lr_scheduler is not None:
        state["lr_scheduler"] = model.lr_scheduler.state_dict()
    if model.scaler is not None:
        state["scaler"] = model.scaler.state_dict()
    return state


def started(models: Mapping[str, Any]) -> None:
    """Call right after building the wrappers (``{name: AdaptiveDataParallel}``, ``name`` as given to it)."""
    if OUT is None:
        return
    from adaptive.checkpoint import states

    resumed = states.resumed_checkpoint()
    record = {"attempt": attempt(), "rank": _rank(), "pid": os.getpid(), "world": _world(),
              "resumed": None if resumed is None else resumed.info.seq, "time": time.time()}
    if resumed is not None:
        torch.save({"seq": resumed.info.seq, "metadata": dict(resumed.info.metadata or {}),
                    "states": {name: _wrapper_state(model) for name, model in models.items()}},
                   _path("restored", "pt"))
    _append(os.path.join(OUT, "attempts.jsonl"), record)


def _optimizer_steps(optimizer: torch.optim.Optimizer) -> int | None:
    """The step counter Adam-like optimizers keep per parameter (None for SGD and the like)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return None


def done(loaders: Mapping[str, Any], models: Mapping[str, Any], **info: Any) -> None:
    """Record the end of the job: each loader's step and each optimizer's and scheduler's counter."""
    if OUT is None:
        return
    record = {"loaders": {name: loader.step for name, loader in loaders.items()},
              "optimizer_steps": {name: _optimizer_steps(m.optimizer) for name, m in models.items()},
              "scheduler_epochs": {name: getattr(m.lr_scheduler, "last_epoch", None) for name, m in models.items()},
              **{k: _plain(v) for k, v in info.items()}}
    _write_json(_path("done", "json"), record)

