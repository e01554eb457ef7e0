"""Shared fixtures: a fresh job (module state and environment) for in-process tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Every process the tests start talks over the loopback interface only (gloo picks the host's address otherwise).
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
             "ADAPTIVE_CHECKPOINT_PATH", "ADAPTIVE_SHARE_PATH", "ADAPTIVE_JOB_ID",
             "ADAPTIVE_CHECKPOINT_INTERVAL", "ADAPTIVE_CHECKPOINT_KEEP", "ADAPTIVE_COLLECTIVE_TIMEOUT",
             "ADAPTIVE_ASYNC_CHECKPOINT")


def restart_process_state() -> None:
    """Forget everything a job process holds in memory, as if the process restarted."""
    from adaptive.runtime.job import reset_job

    reset_job()


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A single-replica job whose checkpoints go to tmp_path/checkpoints."""
    for name in _JOB_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_INTERVAL", "0")
    restart_process_state()
    yield tmp_path
    restart_process_state()


@pytest.fixture(autouse=True)
def _no_stray_job_env(monkeypatch):
    """In-process tests never inherit a torchrun environment from the shell."""
    if os.environ.get("WORLD_SIZE") not in (None, "1"):
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("RANK", "0")


class Indices(torch.utils.data.Dataset):
    """A map-style dataset whose samples are their own indices: tests see exactly what was loaded."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index
