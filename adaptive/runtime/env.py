"""The job's environment, read from the variables torchrun sets.

Every function falls back to a single replica when a variable is missing, so
the same script runs with ``python train.py``, under ``torchrun`` and under the
project's scheduler (guarantee G1).

A restart is *not* detected from ``TORCHELASTIC_RESTART_COUNT``: that counter is
per agent and does not move on membership changes.  A job is resuming exactly
when a checkpoint exists (see :func:`adaptive.checkpoint.states.resumed_checkpoint`).

Variables of our own:

``ADAPTIVE_CHECKPOINT_PATH``
    Directory of the job's checkpoints.  Default ``./.adaptive/<job id>/checkpoints``
    relative to the working directory, so running the same command again in the
    same place resumes.  Must be shared by all nodes of a multi-node job.
``ADAPTIVE_SHARE_PATH``
    Directory for files the job shares between replicas and restarts (metrics,
    hints).  Default ``./.adaptive/<job id>/share``.
``ADAPTIVE_JOB_ID``
    Name of the job.  Default: the training script's file name without
    extension (not torchrun's run id: ``--standalone`` makes a new random one
    on every launch, and "run the same command again" must resume).
``ADAPTIVE_TENSORBOARD_PATH``
    Directory for the job's TensorBoard event files (:func:`tensorboard_path`).
    Default ``<ADAPTIVE_SHARE_PATH>/tensorboard``.
``ADAPTIVE_CHECKPOINT_INTERVAL``
    Seconds between periodic checkpoints (fractions allowed, 0 disables).
``ADAPTIVE_CHECKPOINT_KEEP``
    How many complete checkpoints to keep (default 2).
``ADAPTIVE_ASYNC_CHECKPOINT``
    Whether periodic checkpoints are written in the background: ``auto``
    (default: when a sharded state is registered), ``1`` or ``0``.
``ADAPTIVE_COLLECTIVE_TIMEOUT``
    Seconds after which a collective with a dead or stuck peer fails.
``ADAPTIVE_METRICS_INTERVAL``
    Optimizer steps between metrics records (default 10; 0 turns them off).
``ADAPTIVE_SUPERVISOR_URL``, ``ADAPTIVE_SUPERVISOR_TOKEN``
    Where rank 0 posts its scheduler hints, and the token it posts with.
``ADAPTIVE_LIVE_SECRET``, ``ADAPTIVE_LIVE_SECRET_FILE``
    Live mode: the job's secret (or a file holding it), which signs its
    membership records on the job's store (:func:`live_secret`).

Every variable the library reads is read here, and only here.
"""

from __future__ import annotations

import os
import re
import sys

__all__ = [
    "rank",
    "num_replicas",
    "local_rank",
    "num_local_replicas",
    "node_rank",
    "num_nodes",
    "master_addr",
    "master_port",
    "job_id",
    "checkpoint_path",
    "share_path",
    "tensorboard_path",
    "checkpoint_interval",
    "checkpoint_keep",
    "async_checkpoint",
    "collective_timeout",
    "torchelastic_restart_count",
    "progress_interval",
    "live_hang_timeout",
    "live_recovery",
    "LIVE_RECOVERIES",
    "live_store",
    "live_node",
    "live_size_bounds",
    "live_secret",
    "LIVE_SECRET_VAR",
    "LIVE_SECRET_FILE_VAR",
    "LIVE_SECRET_MIN_LENGTH",
    "DEFAULT_CHECKPOINT_INTERVAL",
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEFAULT_LIVE_HANG_TIMEOUT",
    "LIVE_STORE_VAR",
    "LIVE_NODE_VAR",
    "LIVE_MIN_VAR",
    "LIVE_MAX_VAR",
    "STATUS_DIR_VAR",
    "PARENT_PID_VAR",
    "job_id_given",
    "metrics_interval",
    "supervisor",
    "stop_status_dir",
    "parent_pid",
    "parse_endpoint",
]

#: Seconds between periodic checkpoints when ``ADAPTIVE_CHECKPOINT_INTERVAL`` is unset.
DEFAULT_CHECKPOINT_INTERVAL = 300.0
#: Seconds a collective may wait for a peer when ``ADAPTIVE_COLLECTIVE_TIMEOUT`` is unset.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
#: Seconds without a sign of life after which a live member is taken for hung (``ADAPTIVE_LIVE_HANG_TIMEOUT``).
DEFAULT_LIVE_HANG_TIMEOUT = 10.0
#: Live mode: the variables ``adaptive-run --live`` sets for its workers (the store, the node, the size bounds).
LIVE_STORE_VAR, LIVE_NODE_VAR = "ADAPTIVE_LIVE_STORE", "ADAPTIVE_LIVE_NODE"
LIVE_MIN_VAR, LIVE_MAX_VAR = "ADAPTIVE_LIVE_MIN", "ADAPTIVE_LIVE_MAX"
#: Live mode: the job's secret, or the file that holds it (:func:`live_secret`).
LIVE_SECRET_VAR, LIVE_SECRET_FILE_VAR = "ADAPTIVE_LIVE_SECRET", "ADAPTIVE_LIVE_SECRET_FILE"
#: The fewest characters a live job's secret may have.
LIVE_SECRET_MIN_LENGTH = 16
#: The folder where a launcher's workers report how they stopped (:mod:`adaptive.runtime.launch_status`).
STATUS_DIR_VAR = "ADAPTIVE_STOP_STATUS_DIR"
#: The process a launcher's children die with (:mod:`adaptive.runtime.process_tree`).
PARENT_PID_VAR = "ADAPTIVE_PARENT_PID"


def _int_var(name: str, default: int, minimum: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def _float_var(name: str, default: float, minimum: float = 0.0) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be a number of seconds") from None
    if not value >= minimum:  # also rejects NaN
        raise ValueError(f"environment variable {name}={raw!r} must be >= {minimum}")
    return value


def rank() -> int:
    """Global rank of this replica (``RANK``), 0 when unset."""
    return _int_var("RANK", 0)


def num_replicas() -> int:
    """Number of replicas in the job (``WORLD_SIZE``), 1 when unset."""
    return _int_var("WORLD_SIZE", 1, minimum=1)


def local_rank() -> int:
    """Rank of this replica on its node (``LOCAL_RANK``), 0 when unset."""
    return _int_var("LOCAL_RANK", 0)


def num_local_replicas() -> int:
    """Replicas on this node (``LOCAL_WORLD_SIZE``), 1 when unset."""
    return _int_var("LOCAL_WORLD_SIZE", 1, minimum=1)


def node_rank() -> int:
    """Rank of this node among the job's nodes (``GROUP_RANK``), 0 when unset."""
    return _int_var("GROUP_RANK", 0)


def num_nodes() -> int:
    """Number of nodes (torchrun agents) in the job (``GROUP_WORLD_SIZE``).

    Falls back to ``WORLD_SIZE / LOCAL_WORLD_SIZE`` for launchers that do not
    set ``GROUP_WORLD_SIZE``.
    """
    if os.environ.get("GROUP_WORLD_SIZE"):
        return _int_var("GROUP_WORLD_SIZE", 1, minimum=1)
    return max(1, -(-num_replicas() // num_local_replicas()))


def master_addr() -> str:
    """Address of the rank-0 host (``MASTER_ADDR``), ``127.0.0.1`` when unset."""
    return os.environ.get("MASTER_ADDR") or "127.0.0.1"


def master_port() -> int | None:
    """Port of the rank-0 store (``MASTER_PORT``), None when unset."""
    if not os.environ.get("MASTER_PORT"):
        return None
    return _int_var("MASTER_PORT", 0, minimum=1)


def _script_name() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    stem = os.path.splitext(os.path.basename(argv0))[0]
    if stem in ("", "-c", "-m", "__main__", "ipykernel_launcher"):
        return "default"
    return stem


def job_id() -> str:
    """Name of the job: ``ADAPTIVE_JOB_ID``, else the training script's name."""
    name = os.environ.get("ADAPTIVE_JOB_ID") or _script_name()
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def job_id_given() -> bool:
    """Whether ``ADAPTIVE_JOB_ID`` names the job (else the training script's name does)."""
    return bool(os.environ.get("ADAPTIVE_JOB_ID"))


def metrics_interval() -> int:
    """Optimizer steps between step records (``ADAPTIVE_METRICS_INTERVAL``, default 10; 0 = off)."""
    return _int_var("ADAPTIVE_METRICS_INTERVAL", 10)


def supervisor() -> tuple[str, str | None] | None:
    """The scheduler's supervisor that takes hints: ``ADAPTIVE_SUPERVISOR_URL`` and its
    ``ADAPTIVE_SUPERVISOR_TOKEN``; None when no URL is set."""
    url = os.environ.get("ADAPTIVE_SUPERVISOR_URL")
    return (url, os.environ.get("ADAPTIVE_SUPERVISOR_TOKEN") or None) if url else None


def stop_status_dir() -> str | None:
    """The folder where this launcher's workers report how they stopped (:data:`STATUS_DIR_VAR`), if any."""
    return os.environ.get(STATUS_DIR_VAR) or None


def parent_pid() -> int | None:
    """The process this one must die with (:data:`PARENT_PID_VAR`); None when unset.

    Raises:
        ValueError: when the variable is not a process id.
    """
    raw = os.environ.get(PARENT_PID_VAR)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {PARENT_PID_VAR}={raw!r} must be a process id") from None


def _job_dir() -> str:
    return os.path.join(os.getcwd(), ".adaptive", job_id())


def checkpoint_path() -> str:
    """Directory of this job's checkpoints (``ADAPTIVE_CHECKPOINT_PATH`` or the default)."""
    return os.path.abspath(os.environ.get("ADAPTIVE_CHECKPOINT_PATH") or os.path.join(_job_dir(), "checkpoints"))


def share_path() -> str:
    """Directory for metrics and hints (``ADAPTIVE_SHARE_PATH`` or the default)."""
    return os.path.abspath(os.environ.get("ADAPTIVE_SHARE_PATH") or os.path.join(_job_dir(), "share"))


def tensorboard_path() -> str:
    """Directory for this job's TensorBoard logs (``ADAPTIVE_TENSORBOARD_PATH``, default ``<share path>/tensorboard``).

    Pass it to ``SummaryWriter`` on rank 0 and run ``tensorboard --logdir``
    on it.  Like :func:`share_path` it is per job: it replaces AdaptDL's
    ``os.path.join(os.getenv("ADAPTDL_TENSORBOARD_LOGDIR"), job_id)``.  The
    folder is not created here (``SummaryWriter`` creates it).
    """
    return os.path.abspath(os.environ.get("ADAPTIVE_TENSORBOARD_PATH") or os.path.join(share_path(), "tensorboard"))


def checkpoint_interval() -> float:
    """Seconds between periodic checkpoints; 0 disables them."""
    return _float_var("ADAPTIVE_CHECKPOINT_INTERVAL", DEFAULT_CHECKPOINT_INTERVAL)


def checkpoint_keep() -> int:
    """How many complete checkpoints are kept on disk."""
    return _int_var("ADAPTIVE_CHECKPOINT_KEEP", 2, minimum=1)


def async_checkpoint() -> bool | None:
    """Whether periodic checkpoints are saved in the background (``ADAPTIVE_ASYNC_CHECKPOINT``).

    True for ``1``, False for ``0``, None for ``auto`` (the default): the
    checkpoint code then decides, asynchronous exactly when a sharded state
    (FSDP) is registered.
    """
    raw = os.environ.get("ADAPTIVE_ASYNC_CHECKPOINT")
    value = (raw or "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"environment variable ADAPTIVE_ASYNC_CHECKPOINT={raw!r} must be auto, 1 or 0")


def collective_timeout() -> float:
    """Seconds a collective waits for its peers before failing with an error."""
    value = _float_var("ADAPTIVE_COLLECTIVE_TIMEOUT", DEFAULT_COLLECTIVE_TIMEOUT)
    if value <= 0:
        raise ValueError("environment variable ADAPTIVE_COLLECTIVE_TIMEOUT must be > 0 seconds")
    return value


#: Live mode: what a live job does when a member is lost (``ADAPTIVE_LIVE_RECOVERY``).
LIVE_RECOVERIES = ("memory", "restart")


def live_recovery() -> str:
    """Live mode: what the members that are left do when a member is lost (``ADAPTIVE_LIVE_RECOVERY``):
    ``"memory"`` (the default) re-forms without it and trains on from the last committed step, at the cost of a
    vote on the job's store before every optimizer step; ``"restart"`` skips the votes and restarts every
    member from the checkpoint on disk instead (joins and leaves stay live)."""
    value = os.environ.get("ADAPTIVE_LIVE_RECOVERY") or "memory"
    if value not in LIVE_RECOVERIES:
        raise ValueError(f"environment variable ADAPTIVE_LIVE_RECOVERY={value!r} must be one of "
                         f"{', '.join(LIVE_RECOVERIES)}")
    return value


def live_hang_timeout() -> float:
    """Live mode: seconds a member may give no sign of life before the others take it out as hung
    (``ADAPTIVE_LIVE_HANG_TIMEOUT``, default 10; at least 1)."""
    return _float_var("ADAPTIVE_LIVE_HANG_TIMEOUT", DEFAULT_LIVE_HANG_TIMEOUT, minimum=1.0)


def live_store() -> tuple[str, int] | None:
    """Live mode: ``(host, port)`` of the launchers' TCPStore (``ADAPTIVE_LIVE_STORE``, set by
    ``adaptive-run --live``); None outside live mode."""
    raw = os.environ.get(LIVE_STORE_VAR) or ""
    if not raw:
        return None
    return parse_endpoint(f"environment variable {LIVE_STORE_VAR}", raw)


def parse_endpoint(name: str, value: str) -> tuple[str, int]:
    """``HOST:PORT`` (an endpoint given as ``name``) as ``(host, port)``; a ``ValueError`` naming ``name``."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{name} must be HOST:PORT, got {value!r}")
    return host, int(port)


def live_node() -> int:
    """Live mode: the number of this worker's launcher (node) in the job (``ADAPTIVE_LIVE_NODE``, default 0)."""
    return _int_var(LIVE_NODE_VAR, 0)


def live_size_bounds() -> tuple[int, int]:
    """Live mode: the fewest and the most members of a generation formed from disk
    (``ADAPTIVE_LIVE_MIN``, default 1; ``ADAPTIVE_LIVE_MAX``, default the minimum)."""
    smallest = _int_var(LIVE_MIN_VAR, 1, minimum=1)
    return smallest, max(smallest, _int_var(LIVE_MAX_VAR, smallest, minimum=1))


def live_secret() -> bytes | None:
    """Live mode: the job's secret, which signs its membership records on the job's store
    (``ADAPTIVE_LIVE_SECRET``, else the contents of the file named by ``ADAPTIVE_LIVE_SECRET_FILE`` without
    its trailing newline); None when neither is set (the records are not signed).

    Raises:
        ValueError: both variables are set, the file cannot be read, or the secret is shorter than
            :data:`LIVE_SECRET_MIN_LENGTH` characters.
    """
    given, path = os.environ.get(LIVE_SECRET_VAR) or "", os.environ.get(LIVE_SECRET_FILE_VAR) or ""
    if given and path:
        raise ValueError(f"environment variables {LIVE_SECRET_VAR} and {LIVE_SECRET_FILE_VAR} are both set; "
                         "set one of them")
    if not given and not path:
        return None
    name = LIVE_SECRET_VAR
    if path:
        name = f"the file {path!r} named by {LIVE_SECRET_FILE_VAR}"
        try:
            with open(path, encoding="utf-8") as file:
                given = file.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"environment variable {LIVE_SECRET_FILE_VAR}={path!r}: cannot read the secret "
                             f"({error})") from None
    if len(given) < LIVE_SECRET_MIN_LENGTH:
        raise ValueError(f"{name} must hold a secret of at least {LIVE_SECRET_MIN_LENGTH} characters, got "
                         f"{len(given)} (make one with: python -c 'import secrets; print(secrets.token_hex(32))')")
    return given.encode()


def progress_interval() -> float:
    """Seconds between progress lines in the log (``ADAPTIVE_PROGRESS_INTERVAL``, default 30; 0 = off)."""
    return _float_var("ADAPTIVE_PROGRESS_INTERVAL", 30.0)


def torchelastic_restart_count() -> int:
    """torchrun's per-agent restart counter; informational only (see module docstring)."""
    return _int_var("TORCHELASTIC_RESTART_COUNT", 0)
