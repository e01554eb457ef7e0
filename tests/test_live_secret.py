"""Live mode with a secret (``ADAPTIVE_LIVE_SECRET``) with real launchers and workers on 127.0.0.1: a plain
TCPStore client, which does not know the secret, writes every kind of membership record, and the job goes on
as if it had not.

The signing itself, and the protocol's answers to each forged record, are in ``test_signed_records.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import portpicker
import pytest

from elastic_harness import wait_exit
from live_harness import REPO, check_steps, exits, launch, logs, steps, wait_steps, worker_pids
from live_harness import jobs  # noqa: F401  (the fixture)

#: The job's name: its keys on the launchers' store are under it.
JOB = "live-secret"
PREFIX = f"adaptive/live/{JOB}"
SECRET = "live-secret-test-0123456789abcdef"
SETTINGS = {"WORKER_EPOCHS": "10", "WORKER_STEP_SLEEP": "0.08", "ADAPTIVE_CHECKPOINT_INTERVAL": "0",
            "ADAPTIVE_JOB_ID": JOB, "ADAPTIVE_LIVE_SECRET": SECRET}
EPOCHS = int(SETTINGS["WORKER_EPOCHS"])


def _clients(port: int):
    """A client of the launchers' store that does not know the secret, and its view of the job's keys."""
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    return client, dist.PrefixStore(PREFIX, client)


def _signed_value(raw: bytes) -> str:
    """The value of a signed record as the store holds it (``hmac1:<tag>:<value>``), read without verifying."""
    mark, _, rest = raw.partition(b":")
    assert mark == b"hmac1", raw
    return rest.partition(b":")[2].decode()


def _forge(port: int, generation: int) -> dict[str, str]:
    """Write every kind of membership record, none of them signed with the job's secret; returns the keys the
    members or launchers read while the job trains (each must be named in a warning), by what they forge."""
    from adaptive.runtime import signed_records
    from adaptive.runtime.live_protocol import (DRAINS_PENDING_KEY, HUNG, Generation, GenerationKeys, Member,
                                                agent_key, beat_key, dead_key, drain_key, worker_of_key)

    client, job = _clients(port)
    wids = [json.loads(_signed_value(job.get(worker_of_key(node, 0))))["wid"] for node in (1, 2)]
    keys, following = GenerationKeys(generation), GenerationKeys(generation + 1)
    job.set(keys.lost, job.get(keys.state))  # a valid record (the state's), copied to another key
    job.set(dead_key(wids[0]), "1")  # a launcher's report of a death, unsigned
    job.set(dead_key(wids[1]), signed_records.sign(b"another-secret-0123456789", f"{PREFIX}/{dead_key(wids[1])}",
                                                   HUNG))  # the others' hung verdict, signed with another secret
    for wid in wids:
        job.set(keys.alive(wid), "1")
        job.set(keys.here(wid), "1")
        job.add(beat_key(wid), 5)  # a counter: makes them look alive, which they are
    outsider = Member(999, 9, 0)
    job.add(keys.joins, 1)  # a join request
    job.set(keys.join(1), outsider.to_json())
    job.set(keys.join_waiting(1), repr(time.time() + 3600))
    proposal = Generation(generation + 1, (outsider,))  # a proposal, and the next generation, of an outsider
    job.set(keys.after_loss, proposal.to_json())
    job.set(keys.next, proposal.to_json())
    job.set(following.members, proposal.to_json())
    job.set(following.state, "running")
    job.add(DRAINS_PENDING_KEY, 1)  # drain requests for both nodes
    for node in (1, 2):
        job.set(drain_key(node), repr(time.time()))
        client.set(agent_key(node), "done")  # the launchers' signs of life: "done"
    return {"lost": keys.lost, "dead": dead_key(wids[0]), "hung": dead_key(wids[1]),
            "join request": keys.join_waiting(1), "drain": drain_key(1)}


def _drain(port: int, node: int, secret: str) -> subprocess.CompletedProcess[str]:
    """``adaptive drain`` of ``node`` with the job's ``secret``."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), "ADAPTIVE_LIVE_SECRET": secret}
    return subprocess.run([sys.executable, "-m", "adaptive", "drain", "--endpoint", f"127.0.0.1:{port}",
                           "--job-id", JOB, "--node", str(node)], capture_output=True, text=True, timeout=60,
                          env=environment)


@pytest.mark.slow
@pytest.mark.ci_sample  # about 30-40 s: CI runs it after the default suite
def test_forged_membership_records_change_nothing_in_a_job_with_a_secret(jobs, tmp_path):
    """Two single-worker nodes of a job with a secret train; a client without it writes a loss, deaths, a hung
    verdict, signs of life and presence, a join request, a proposal and a next generation, drain requests and
    launchers' "done", then one worker is held still for 1.5 s so that the other waits in a collective, reading
    the forged loss and deaths.  Nothing changes: the same two workers (PIDs) train on in the same generation,
    every sample once per epoch, and the logs name the forged keys read.  A launcher with another secret is
    refused with 2.  Then ``adaptive drain`` with the secret drains node 2 (its request replaces the forged
    one): its worker leaves with 143, the other finishes with 0."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    launchers = {name: launch(jobs, out, port, name, **SETTINGS) for name in ("first", "second")}
    records = wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 6, "both nodes to train")
    both = [r for r in records if r["world"] == 2]
    generation, pids = both[-1]["generation"], {r["pid"] for r in both}
    assert len(pids) == 2, both
    forged_at = time.time()
    forged = _forge(port, generation)
    stranger = launch(jobs, out, port, "stranger", **{**SETTINGS, "ADAPTIVE_LIVE_SECRET": "another-secret-0123456789"})
    rank1 = next(r["pid"] for r in reversed(both) if r["rank"] == 1)
    os.kill(rank1, signal.SIGSTOP)  # rank 0 waits for it in a collective, and looks for a loss meanwhile
    try:
        time.sleep(1.5)
    finally:
        os.kill(rank1, signal.SIGCONT)
    wait_steps(out, lambda rs: sum(r["time"] > forged_at + 2 and r["world"] == 2 for r in rs) >= 10,
               "the job to train on after the forged records")
    assert wait_exit(stranger, 60, out / "stranger.log") == 2, logs(out)
    assert "cannot authenticate" in (out / "stranger.log").read_text(errors="replace")
    drained_at = time.time()
    _, job = _clients(port)
    drained = json.loads(_signed_value(job.get("worker_of/2/0")))["pid"]
    owner = next(name for name, launcher in launchers.items() if drained in worker_pids(launcher.pid))
    asked = _drain(port, 2, SECRET)
    assert asked.returncode == 0, asked.stderr
    for name, launcher in launchers.items():
        assert wait_exit(launcher, 120, out / f"{name}.log") == (143 if name == owner else 0), logs(out)

    check_steps(out, epochs=EPOCHS)
    between = [r for r in steps(out) if forged_at < r["time"] < drained_at]
    assert {r["pid"] for r in steps(out) if r["world"] == 2} == pids and {r["pid"] for r in between} == pids
    assert {r["generation"] for r in between} == {generation} and {r["world"] for r in between} == {2}, \
        sorted({(r["generation"], r["world"]) for r in between})
    assert {r["pid"] for r in steps(out)} == pids and exits(out) == {pid: 143 if pid == drained else 0 for pid in pids}
    assert steps(out)[-1]["world"] == 1 and steps(out)[-1]["pid"] != drained  # node 2 was drained
    said = "".join(Path(log).read_text(errors="replace") for log in (out / "first.log", out / "second.log"))
    for what, key in forged.items():
        assert f"'{PREFIX}/{key}'" in said and "fails authentication" in said, f"no warning for the forged {what}"
