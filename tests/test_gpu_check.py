"""benchmarks/gpu_check.py's CPU dry run: the GPU check's gradient and noise-scale checks pass on gloo.

The same script runs on the GPUs of one machine (NCCL, bf16 autocast); here
its ``--cpu 2 --quick`` mode spawns two gloo processes with a small model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive.runtime.process_tree import kill_process_tree

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 35 s: CI runs it after the default suite
def test_cpu_dry_run_passes(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--cpu", "2", "--quick", "--json", str(out)],
                            cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        output, _ = proc.communicate(timeout=240)  # the script's own deadline is 150 s
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)
        output, _ = proc.communicate(timeout=30)
        pytest.fail(f"gpu_check did not finish within 240 s:\n{output}")
    assert proc.returncode == 0, output
    for check in ("gradients", "noise_scale"):
        for wrapper in ("AdaptiveDataParallel", "AdaptiveFSDP"):
            assert re.search(rf"^PASS {check}\s+{wrapper}\s", output, re.MULTILINE), output
    for wrapper in ("AdaptiveDataParallel", "AdaptiveFSDP"):
        assert re.search(rf"^INFO overhead\s+{wrapper}\s+[0-9.]+x ", output, re.MULTILINE), output
    assert "FAIL" not in output and re.search(r"^PASSED: 4 passed, 0 failed; elapsed", output, re.MULTILINE)

    report = json.loads(out.read_text())
    assert report["passed"] and report["config"]["world"] == 2 and report["workers_error"] is None
    results = report["results"]
    for wrapper in ("ddp", "fsdp"):
        grads, noise, overhead = (results[f"{check}/{wrapper}"] for check in ("gradients", "noise_scale", "overhead"))
        assert grads["max_error"] < 1e-5 and grads["micro_steps"] == 2 and grads["unique"] == grads["samples"] == 16
        assert abs(noise["noise_scale"] / noise["closed_form"] - 1) < 0.15 and noise["measurements"] > 0
        assert overhead["ratio"] > 0 and overhead["median_ms"]["plain"] > 0 and overhead["measurements"] > 0
