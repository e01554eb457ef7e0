"""What a worker tells the ``adaptive-run`` that started it, through a folder the launcher owns.

``adaptive-run`` creates a private folder and names it in the workers'
environment (:data:`STATUS_DIR_VAR`). Workers write small JSON records
there, one file per local rank, and the launcher reads them:

* ``local-rank-<k>.json``: how this worker's graceful stop went (a durable
  checkpoint, or why not), so that ``adaptive-run`` exits 143 only when
  every local worker checkpointed (:func:`confirm_stop`, :func:`stop_problems`);
* ``stale-local-rank-<k>.json``: this worker's incarnation was fenced, a
  newer generation of the job took over the checkpoint folder
  (:func:`report_stale`). The launcher then ends the whole incarnation
  instead of letting torchrun restart the workers (a restart round would
  take a newer generation still and fence the incarnation that is
  legitimately running), and a worker of a later round refuses to take a
  generation (:func:`stale_report`).

Outside ``adaptive-run`` (plain ``python``, plain torchrun) the variable is
unset and every function here does nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from adaptive._utils.files import read_json, write_json_atomic
from adaptive._utils.types import JSON
from adaptive.runtime import env
from adaptive.runtime.job import current_job

__all__ = ["STATUS_DIR_VAR", "STALE_GENERATION_EXIT_CODE", "clear_earlier_reports", "confirm_stop", "forget_stop", "report_stale", "stale_report", "stop_problems"]

logger = logging.getLogger(__name__)

#: Environment variable naming the launcher's status folder.
STATUS_DIR_VAR = env.STATUS_DIR_VAR
#: Exit status of a worker, and of ``adaptive-run``, whose incarnation a newer generation fenced off.
STALE_GENERATION_EXIT_CODE = 3
_STOP_PREFIX = "local-rank-"
_STALE_PREFIX = "stale-local-rank-"


def _folder() -> str | None:
    return env.stop_status_dir()


def _own_file(prefix: str) -> str | None:
    folder = _folder()
    return None if folder is None else os.path.join(folder, f"{prefix}{env.local_rank()}.json")


def _write(prefix: str, record: JSON) -> None:
    path = _own_file(prefix)
    if path is None:
        return
    try:
        write_json_atomic(path, dict(record, rank=env.rank(), pid=os.getpid(), time=time.time()))
    except OSError as error:
        logger.warning("could not report to adaptive-run (%s): %s", path, error)


@dataclasses.dataclass
class _Reports:
    """Whether this worker cleared its local rank's earlier records (its record on the job context)."""

    cleared: bool = False


def clear_earlier_reports() -> None:
    """Once per worker, as it joins its job: forget what an earlier worker on this local rank confirmed.

    A confirmation in the launcher's folder is then always this worker's own.
    Called when the worker sets up its process group or its stop handling,
    whichever comes first, never at import.
    """
    reports = current_job().part(_Reports)
    if not reports.cleared:
        reports.cleared = True
        forget_stop()


def forget_stop() -> None:
    """A new worker clears what an earlier one on its local rank confirmed about a stop."""
    path = _own_file(_STOP_PREFIX)
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            logger.debug("could not remove %s: %s", path, error)


def confirm_stop(**status: object) -> None:
    """Tell ``adaptive-run`` how this worker's graceful stop went (``ok``, and ``seq`` or ``reason``)."""
    _write(_STOP_PREFIX, status)


def report_stale(mine: int, newest: int, message: str) -> None:
    """Tell ``adaptive-run`` that this incarnation (generation ``mine``) was fenced by generation ``newest``."""
    _write(_STALE_PREFIX, {"generation": mine, "newest": newest, "message": message})


def stale_report(folder: str | None = None) -> JSON | None:
    """A fencing record left in the launcher's folder by any local worker, or None.

    ``folder`` defaults to this process's launcher folder (None outside ``adaptive-run``).
    """
    folder = folder or _folder()
    if folder is None:
        return None
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return None
    for name in names:
        if name.startswith(_STALE_PREFIX) and name.endswith(".json"):
            try:
                return read_json(os.path.join(folder, name))
            except (OSError, ValueError):
                return {"message": f"a worker reported a stale generation ({name} is unreadable)"}
    return None


def stop_problems(folder: str, workers: int | None) -> list[str]:
    """What went wrong with the local workers' stop, from what they confirmed (empty: all checkpointed).

    ``workers`` is the number of local workers, when known.
    """
    found: dict[int, JSON] = {}
    problems = []
    for entry in sorted(os.listdir(folder)):
        if not (entry.startswith(_STOP_PREFIX) and entry.endswith(".json")):
            continue
        try:
            record = read_json(os.path.join(folder, entry))
            found[int(entry[len(_STOP_PREFIX):-len(".json")])] = record
        except (OSError, ValueError) as error:
            problems.append(f"{entry} is unreadable ({error})")
    for local_rank, record in sorted(found.items()):
        if not record.get("ok"):
            problems.append(f"worker {local_rank} (rank {record.get('rank')}): {record.get('reason')}")
    expected = range(workers) if workers is not None else sorted(found) or [0]
    missing = [rank for rank in expected if rank not in found]
    if missing:
        problems.append(f"worker(s) {', '.join(map(str, missing))} did not confirm a checkpoint (killed before "
                        "they reached a step boundary, or crashed)")
    return problems
