"""Object collectives ride on torch.distributed; a dead or hung peer is an error, never a hang."""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys

import pytest

from adaptive.elastic import collectives
from adaptive.elastic.process_tree import kill_process_tree
from elastic_harness import REPO, tail, wait_for


def test_single_process_collectives_need_no_group(job):
    assert collectives.allreduce_object(3) == 3
    assert collectives.broadcast_object({"a": 1}) == {"a": 1}
    assert collectives.allreduce_async([1], operator.add).result(timeout=5) == [1]
    collectives.barrier()


def test_init_process_group_validates_arguments(job):
    with pytest.raises(ValueError, match="backend"):
        collectives.init_process_group("")
    with pytest.raises(ValueError, match="timeout"):
        collectives.init_process_group("gloo", timeout=0)


@pytest.mark.distributed
@pytest.mark.parametrize("mode, bound", [("die", 20.0), ("hang", 20.0)])
def test_a_dead_or_hung_peer_gives_a_clear_error_in_bounded_time(tmp_path, mode, bound):
    env = dict(os.environ, PYTHONPATH=str(REPO), ADAPTIVE_COLLECTIVE_TIMEOUT="3", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests" / "workers" / "peer_failure.py"), mode, str(tmp_path)]
    log = tmp_path / "log.txt"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (tmp_path / "result.json").exists() or proc.poll() is not None, 90, "rank 0's verdict")
    finally:
        kill_process_tree(proc.pid)
        proc.wait(timeout=30)
    assert (tmp_path / "result.json").exists(), tail(log)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"] == "CollectiveError"
    assert "peer replica died" in result["message"]
    assert result["seconds"] < bound
