"""The examples run: a short real run of each, as a newcomer would start it.

``examples/linear_regression.py`` and ``examples/elastic_demo.py`` are run
by the core and torchrun tests; this file runs the image-classification
example (which needs the ``examples`` extra, scikit-learn) for a few steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_example(script: str, folder: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                       ADAPTIVE_CHECKPOINT_PATH=str(folder / "checkpoints"), ADAPTIVE_SHARE_PATH=str(folder / "share"),
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", ADAPTIVE_METRICS_INTERVAL="1", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "ADAPTIVE_JOB_ID"):
        environment.pop(name, None)
    return subprocess.run([sys.executable, str(REPO / "examples" / script), *args], env=environment,
                          cwd=str(folder), capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_digits_cnn_trains_logs_accuracy_stops_at_max_steps_and_writes_metrics(tmp_path):
    """Two epochs with autoscale between 32 and 64 samples: epoch 0 ends by step 47 (1,500 samples at
    >= 32 per step) and epoch 1 not before step 58 (epoch 0 takes >= 20 steps at 32, then at most 64
    per step), so --max-steps 50 always stops inside epoch 1."""
    pytest.importorskip("sklearn", reason='the digits example needs pip install -e ".[examples]"')
    result = run_example("digits_cnn.py", tmp_path, "--epochs", "2", "--max-steps", "50", "--max-batch-size", "64")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    accuracies = [float(line.split("validation accuracy ")[1].split("%")[0])
                  for line in log.splitlines() if "validation accuracy" in line]
    assert len(accuracies) == 2, log[-4000:]
    assert accuracies[-1] > 40.0  # ten classes: chance is 10%; 50 steps reach 65-85%
    assert "stopping after 50 optimizer steps (--max-steps)" in log

    records = [json.loads(line) for line in (tmp_path / "share" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert steps and max(r["step"] for r in steps) <= 50
    # Only the training loader's steps belong in the metrics: the validation loader (no gradients)
    # must not interleave its own step counter and batch size with them.
    training = [r for r in steps if r.get("loader") in (None, steps[0].get("loader"))]
    ordered = [r["step"] for r in training]
    assert ordered == sorted(ordered), f"step records go backwards (another loader's records?): {ordered}"
    assert all(32 <= r["batch_size"] <= 64 for r in training)
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((tmp_path / "share" / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"


def test_digits_cnn_without_scikit_learn_says_what_to_install(tmp_path):
    """Hide sklearn with a module that fails to import, as on a machine without the extra."""
    blocker = tmp_path / "block"
    (blocker / "sklearn").mkdir(parents=True)
    (blocker / "sklearn" / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), str(REPO)]))
    result = subprocess.run([sys.executable, str(REPO / "examples" / "digits_cnn.py"), "--max-steps", "1"],
                            env=environment, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert 'pip install "adaptive-elastic[examples]"' in result.stderr
    assert 'pip install -e ".[examples]"' in result.stderr
    assert "Traceback" not in result.stderr
