"""The examples run: a short real run of each, as a newcomer would start it.

``examples/linear_regression.py`` with one process (and once more, to see
that a finished run is not retrained), ``examples/elastic_demo.py`` as the
README's quick start runs it (2 replicas, SIGTERM, resume on 3, then
``adaptive report``), and the image-classification example (which needs the
``examples`` extra, scikit-learn) for a few steps.  ``token_lm.py`` is run by
``tests/test_token_loader.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive.checkpoint.store import CheckpointStore
from adaptive.runtime.process_tree import kill_process_tree

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
    # tensorboard is installed with the test requirements (the "tensorboard" extra): the scalars must be there
    assert importlib.util.find_spec("tensorboard") is not None, \
        'tensorboard is not installed: pip install -r requirements-test.txt (or pip install -e ".[tensorboard]")'
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


EPOCH_LINE = re.compile(r"epoch (\d+): loss (\d+\.\d+) \((\d+) replicas\)")


def _epochs(log: str) -> list[tuple[int, float, int]]:
    return [(int(e), float(loss), int(r)) for e, loss, r in EPOCH_LINE.findall(log)]


@pytest.mark.distributed
def test_linear_regression_trains_and_a_finished_run_is_not_retrained(tmp_path):
    result = run_example("linear_regression.py", tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    epochs = _epochs(log)
    assert [e for e, _, _ in epochs] == list(range(12)) and {r for _, _, r in epochs} == {1}, log[-4000:]
    assert epochs[-1][1] < 0.02 < epochs[0][1], epochs  # down to the noise (0.1 ** 2)
    # examples/README.md: "a finished run is not retrained" (also with ADAPTIVE_CHECKPOINT_INTERVAL=0)
    again = run_example("linear_regression.py", tmp_path)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-4000:]
    assert _epochs(log) == [], f"the finished run trained again:\n{log[-4000:]}"
    assert "nothing left to train" in log, log[-4000:]


@pytest.mark.distributed
def test_elastic_demo_stops_resumes_on_3_replicas_and_reports(tmp_path):
    """The README's quick start: ``python examples/elastic_demo.py --fresh && adaptive report runs/demo``."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "ADAPTIVE_JOB_ID", "ADAPTIVE_CHECKPOINT_PATH", "ADAPTIVE_SHARE_PATH", "ADAPTIVE_CHECKPOINT_INTERVAL"):
        environment.pop(name, None)
    run_dir = tmp_path / "runs" / "demo"
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "elastic_demo.py"), "--fresh",
                             "--run-dir", str(run_dir)], env=environment, cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)
        output, _ = proc.communicate(timeout=30)
        raise AssertionError(f"the demo did not finish in 480 s:\n{output[-4000:]}") from None
    assert proc.returncode == 0, output[-4000:]
    first, marker, second = output.partition("$ adaptive-run --standalone --nproc-per-node=3")
    assert marker, output[-4000:]
    assert ">>> the job exited with 143" in first, first[-4000:]  # stopped gracefully after a checkpoint
    before, after = _epochs(first), _epochs(second)
    assert [e for e, _, _ in before][:4] == [0, 1, 2, 3] and {r for _, _, r in before} == {2}, first[-4000:]
    assert "resuming from checkpoint" in second, second[-4000:]
    resumed = [e for e, _, _ in after]
    assert resumed and resumed == list(range(resumed[0], 12)) and resumed[0] >= 4, second[-4000:]
    assert resumed[0] <= before[-1][0] + 1, "epochs were skipped"
    assert {r for _, _, r in after} == {3} and after[-1][1] < 0.02, after
    assert ">>> the job exited with 0: finished" in second
    checkpoints = [info.metadata for info in CheckpointStore(run_dir / "checkpoints").list()]
    stops = [meta for meta in checkpoints if meta.get("reason") == "stop"]
    assert stops and stops[-1]["replicas"] == 2, checkpoints

    report = subprocess.run([sys.executable, "-m", "adaptive", "report", str(run_dir)], env=environment,
                            cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    assert (run_dir / "report.png").stat().st_size > 0  # where README.md and the quick start say
