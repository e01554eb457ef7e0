"""Job specifications for the executor (YAML).

Example ``job.yaml``::

    name: cifar-small
    command: [examples/train.py, --epochs, "3"]   # script and its arguments
    min_replicas: 1
    max_replicas: 4
    checkpoint_dir: runs/cifar-small/checkpoints
    env: {OMP_NUM_THREADS: "1"}                    # optional
    preemptible: true                              # optional
    max_failures: 3                                # optional: crashes tolerated
    max_relaunches: 20                             # optional: relaunches after a lost node or store (exit 75)

``command`` is what follows the launcher (``adaptive-run --standalone
--nproc-per-node=N``): a Python script and its arguments, or a string that
is split like a shell would.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from scheduler.supervisor.state import validate_job_id

_KEYS = ("name", "command", "min_replicas", "max_replicas", "checkpoint_dir", "env", "preemptible",
         "max_failures", "max_relaunches")
#: Default of ``max_relaunches``: the relaunches after infrastructure failures (a lost node, a live job's lost
#: store: exit 75) a job gets before it is failed, so that a loss that repeats at every launch ends.
DEFAULT_MAX_RELAUNCHES = 20


@dataclass(frozen=True)
class JobSpec:
    """A job the executor runs: command, replica limits, checkpoint directory."""

    name: str
    command: tuple[str, ...]
    checkpoint_dir: str
    min_replicas: int = 1
    max_replicas: int = 1
    env: dict[str, str] = field(default_factory=dict)
    preemptible: bool = True
    max_failures: int = 3
    max_relaunches: int = DEFAULT_MAX_RELAUNCHES

    def __post_init__(self) -> None:
        validate_job_id(self.name)
        if not self.command or not all(isinstance(c, str) and c for c in self.command):
            raise ValueError(f"job {self.name!r}: command must be a non-empty list of non-empty strings")
        if not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir:
            raise ValueError(f"job {self.name!r}: checkpoint_dir must be a non-empty path")
        for key, low in (("min_replicas", 0), ("max_replicas", max(self.min_replicas, 1)), ("max_failures", 0),
                         ("max_relaunches", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"job {self.name!r}: {key} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.preemptible, bool):
            raise ValueError(f"job {self.name!r}: preemptible must be true or false, got {self.preemptible!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError(f"job {self.name!r}: env must map strings to strings")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base_dir: str | None = None) -> "JobSpec":
        """Validate a parsed spec; relative ``checkpoint_dir`` is resolved against ``base_dir``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"job spec must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise ValueError(f"unknown job spec field(s) {unknown}; allowed: {list(_KEYS)}")
        missing = [k for k in ("name", "command", "checkpoint_dir") if k not in data]
        if missing:
            raise ValueError(f"job spec is missing {missing}")
        command = data["command"]
        if isinstance(command, str):
            command = shlex.split(command)
        if not isinstance(command, (list, tuple)):
            raise ValueError(f"command must be a list or a string, got {type(command).__name__}")
        command = tuple(str(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else c
                        for c in command)
        checkpoint_dir = data["checkpoint_dir"]
        if isinstance(checkpoint_dir, str) and checkpoint_dir:
            checkpoint_dir = os.path.abspath(os.path.join(base_dir or os.getcwd(), checkpoint_dir))
        env = data.get("env") or {}
        if not isinstance(env, Mapping):
            raise ValueError(f"env must be a mapping, got {type(env).__name__}")
        min_replicas = data.get("min_replicas", 1)
        default_max = min_replicas if isinstance(min_replicas, int) and min_replicas > 1 else 1
        return cls(name=data["name"], command=command, checkpoint_dir=checkpoint_dir,
                   min_replicas=min_replicas, max_replicas=data.get("max_replicas", default_max),
                   env={str(k): str(v) for k, v in env.items()},
                   preemptible=data.get("preemptible", True), max_failures=data.get("max_failures", 3),
                   max_relaunches=data.get("max_relaunches", DEFAULT_MAX_RELAUNCHES))

    @property
    def share_dir(self) -> str:
        """Folder the job shares with the scheduler (``ADAPTIVE_SHARE_PATH``)."""
        return os.path.join(self.checkpoint_dir, "share")

    @property
    def hints_paths(self) -> tuple[str, str]:
        """Where the job may write its ``hints.json`` (checkpoint folder, share folder)."""
        return (os.path.join(self.checkpoint_dir, "hints.json"), os.path.join(self.share_dir, "hints.json"))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "command": list(self.command), "checkpoint_dir": self.checkpoint_dir,
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas, "env": dict(self.env),
                "preemptible": self.preemptible, "max_failures": self.max_failures,
                "max_relaunches": self.max_relaunches}


def load_job_spec(path: str) -> JobSpec:
    """Read and validate a YAML job spec (relative paths resolve next to the file)."""
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML ({exc})") from exc
    try:
        return JobSpec.from_dict(data, base_dir=os.path.dirname(os.path.abspath(path)))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
