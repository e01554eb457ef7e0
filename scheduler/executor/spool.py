"""The executor's working folder: how the CLI talks to a running executor.

Layout of ``WORKDIR``::

    inbox/<name>.yaml     submitted, not yet picked up (written atomically)
    jobs/<name>.yaml      accepted job specs
    rejected/<file>       submissions the executor refused (with a .reason file)
    status.json           every job's state, rewritten atomically each step
    state.json            supervisor state (hints, allocations)
    logs/<job>/attempt-<k>.log

No sockets: submitting is a file rename, reading the status is a file read.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

import yaml

from adaptive.goodput import read_json, write_json_atomic
from scheduler.executor.jobspec import JobSpec, load_job_spec

logger = logging.getLogger(__name__)


class Spool:
    """Paths and file operations of one executor working folder."""

    def __init__(self, workdir: str):
        self.workdir = os.path.abspath(workdir)
        self.inbox = os.path.join(self.workdir, "inbox")
        self.accepted = os.path.join(self.workdir, "jobs")
        self.rejected = os.path.join(self.workdir, "rejected")
        self.status_path = os.path.join(self.workdir, "status.json")
        self.state_path = os.path.join(self.workdir, "state.json")
        self.log_dir = os.path.join(self.workdir, "logs")
        for folder in (self.inbox, self.accepted, self.rejected, self.log_dir):
            os.makedirs(folder, exist_ok=True)

    def submit(self, spec_path: str) -> JobSpec:
        """Validate a YAML spec and drop it (paths made absolute) into the inbox."""
        spec = load_job_spec(spec_path)
        if os.path.exists(os.path.join(self.accepted, spec.name + ".yaml")):
            raise ValueError(f"a job named {spec.name!r} was already submitted to {self.workdir}")
        fd, tmp = tempfile.mkstemp(prefix=".submit-", suffix=".tmp", dir=self.inbox)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yaml.safe_dump(spec.to_dict(), f, sort_keys=False)
        os.replace(tmp, os.path.join(self.inbox, spec.name + ".yaml"))
        return spec

    def take_new(self) -> list[JobSpec]:
        """Specs waiting in the inbox, moved to ``jobs/`` (bad ones to ``rejected/``)."""
        specs = []
        for fname in sorted(os.listdir(self.inbox)):
            if not fname.endswith(".yaml"):
                continue
            path = os.path.join(self.inbox, fname)
            try:
                spec = load_job_spec(path)
                target = os.path.join(self.accepted, spec.name + ".yaml")
                if os.path.exists(target):
                    raise ValueError(f"a job named {spec.name!r} already exists")
            except (OSError, ValueError) as exc:
                self._reject(path, str(exc))
                continue
            os.replace(path, target)
            specs.append(spec)
        return specs

    def accepted_specs(self) -> list[JobSpec]:
        """Every accepted spec (to resume after an executor restart)."""
        return [load_job_spec(os.path.join(self.accepted, f))
                for f in sorted(os.listdir(self.accepted)) if f.endswith(".yaml")]

    def _reject(self, path: str, reason: str) -> None:
        logger.error("rejected submission %s: %s", os.path.basename(path), reason)
        target = os.path.join(self.rejected, os.path.basename(path))
        shutil.move(path, target)
        with open(target + ".reason", "w", encoding="utf-8") as f:
            f.write(reason + "\n")

    def write_status(self, jobs: list[dict[str, Any]], **extra: Any) -> None:
        write_json_atomic(self.status_path, {"jobs": jobs, **extra})

    def read_status(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """``(jobs, extra fields)`` from the last status file (empty if none yet)."""
        if not os.path.exists(self.status_path):
            return [], {}
        data = read_json(self.status_path)
        jobs = data.pop("jobs", [])
        return jobs, data
