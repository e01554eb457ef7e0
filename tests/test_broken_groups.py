"""A member that re-forms after a loss never waits for its old group's stuck collectives to time out.

Real gloo groups of three processes on 127.0.0.1 (``workers/broken_group_worker.py``):
one member stays silent, the other two hold an all-reduce that waits for it
until the 60 s collective timeout, then leave the group.  Dropped plainly,
the group's destructor joins its worker threads and so waits for that
timeout; kept (:mod:`adaptive.runtime.broken_groups`) it is neither waited
for when left nor at the process's exit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import portpicker
import pytest

from adaptive.runtime import broken_groups

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "broken_group_worker.py"
#: The collective timeout of the worker's group.
TIMEOUT = 60.0


def _run(tmp_path: Path, keep: bool) -> tuple[list[dict], dict[int, int], float]:
    """Start the three members; returns what ranks 0 and 1 logged, their exit statuses and the time they took."""
    port, out = portpicker.pick_unused_port(), tmp_path / "dropped.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo"}
    started = time.monotonic()
    procs = {rank: subprocess.Popen([sys.executable, str(WORKER), str(rank), str(port), str(out), str(int(keep))],
                                    env=env) for rank in range(3)}
    try:
        codes = {rank: procs[rank].wait(timeout=TIMEOUT + 40) for rank in (0, 1)}
        took = time.monotonic() - started
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return [json.loads(line) for line in out.read_text().splitlines()], codes, took


def test_a_kept_broken_group_is_left_at_once_and_does_not_hold_up_the_exit(tmp_path):
    records, codes, took = _run(tmp_path, keep=True)
    assert codes == {0: 0, 1: 0}
    assert sorted(r["rank"] for r in records) == [0, 1]
    assert all(r["held"] == 2 for r in records), records  # the group and its work, until their timeout
    assert all(r["dropped_in"] < TIMEOUT / 4 for r in records), records
    assert took < TIMEOUT / 2, f"the members exited only after {took:.0f} s: they waited for the stuck collective"


@pytest.mark.slow
def test_a_broken_group_dropped_plainly_waits_for_its_collective_timeout(tmp_path):
    """What the module prevents: the same members, dropping the group, wait in its destructor."""
    records, codes, took = _run(tmp_path, keep=False)
    assert codes == {0: 0, 1: 0}
    assert all(r["dropped_in"] > TIMEOUT / 2 for r in records), records


def test_kept_objects_are_released_once_their_timeout_and_the_margin_passed(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(broken_groups.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(broken_groups, "_kept", [])
    group, other = object(), object()
    broken_groups.keep(group, None, timeout=30.0)
    assert broken_groups.held() == 1  # None (a group that did not exist) is not held
    now[0] += 30.0 + broken_groups.MARGIN - 1
    broken_groups.keep(other, timeout=10.0)
    assert broken_groups.held() == 2
    now[0] += 2
    assert broken_groups.release_expired() == 1 and broken_groups.held() == 1
    now[0] += 10.0 + broken_groups.MARGIN
    assert broken_groups.release_expired() == 1 and broken_groups.held() == 0


def test_a_sharded_mesh_group_keeps_its_backend_when_closed_after_a_loss_not_when_shut_down(monkeypatch):
    """close() (every member left after a loss) keeps the gloo backend; torch's shutdown() at an agreed change,
    where every collective completed, drops it at once."""
    from adaptive.runtime.fault_tolerant_group import FaultTolerantGroup

    monkeypatch.setattr(broken_groups, "_kept", [])
    lost, changed = object(), object()
    after_loss = FaultTolerantGroup(lost, 0, 1, 30.0)
    after_loss.close()
    assert after_loss.closed and broken_groups.held() == 1 and broken_groups._kept[0].objects == (lost,)
    after_change = FaultTolerantGroup(changed, 0, 1, 30.0)
    after_change.shutdown()
    assert after_change.closed and broken_groups.held() == 1
