"""``adaptive report``: splitting a metrics file into processes, the summary, the CLI and the PNG.

The last test trains a tiny model for real, stops it gracefully mid-run,
resumes it in a new process, and renders the report of that run.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive._utils.text import format_duration
from adaptive.observe import cli
from adaptive.observe import report
from adaptive.observe.report import _png, _runs

REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step(time_, pid, step_, **fields):
    record = {"time": time_, "pid": pid, "step": step_, "epoch": 0, "replicas": 1, "nodes": 1, "batch_size": 32,
              "local_bsz": 32, "accum_steps": 1, "samples_per_sec": 100.0, "noise_scale": 50.0, "gain": 1.0,
              "lr_factor": 1.0, "progress": float(step_), "goodput": 100.0}
    record.update(fields)
    return record


def write_metrics(folder: Path, records: list[dict], garbage: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "metrics.jsonl"
    lines = [json.dumps(record) for record in records]
    if garbage:
        lines.insert(1, '{"time": 1.0, "pid": 1, "ste')  # a line cut by a crash
    path.write_text("\n".join(lines) + "\n")
    return path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------------- splitting and summary


def test_restarts_are_new_pids_and_time_lost_is_the_gap_between_processes(tmp_path):
    records = [step(100.0, 11, 10), step(101.0, 11, 20), step(105.0, 22, 21, replicas=2, batch_size=64),
               step(106.0, 22, 30, replicas=2, batch_size=64),
               {"time": 106.5, "pid": 22, "event": "batch_size", "step": 31, "before": 64, "after": 128}]
    write_metrics(tmp_path / "share", records, garbage=True)
    run = report.load_run(str(tmp_path))  # the folder above share/ works
    summary = report.summarize(run)
    assert [p.pid for p in run.processes] == [11, 22]
    assert summary.restarts == 1
    assert summary.time_lost == pytest.approx(4.0)
    assert summary.wall_time == pytest.approx(6.5)
    assert [(c.step, c.before, c.after) for c in summary.replica_changes] == [(21, 1, 2)]
    assert (summary.initial_batch_size, summary.final_batch_size) == (32, 128)
    assert summary.batch_size_decisions == 1
    assert summary.step_records == 4


def test_a_start_event_begins_a_new_process_even_with_a_reused_pid(tmp_path):
    records = [{"time": 1.0, "pid": 7, "event": "start", "replicas": 2}, step(2.0, 7, 10, replicas=2),
               step(3.0, 7, 20, replicas=2), {"time": 9.0, "pid": 7, "event": "start", "replicas": 4},
               step(10.0, 7, 21, replicas=4)]
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, records))))
    assert summary.restarts == 1
    assert summary.time_lost == pytest.approx(6.0)
    # the change is seen at the start event, before the first step record of the new process
    assert [(c.time, c.before, c.after) for c in summary.replica_changes] == [(9.0, 2, 4)]


def test_goodput_gain_is_mean_goodput_over_the_first_records_at_the_initial_batch_size(tmp_path):
    records = [step(1.0, 1, 10, goodput=None), step(2.0, 1, 20, goodput=100.0), step(3.0, 1, 30, goodput=110.0),
               step(4.0, 1, 40, goodput=120.0), step(5.0, 1, 50, goodput=400.0, batch_size=128),
               step(6.0, 1, 60, goodput=400.0, batch_size=128)]
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, records))))
    assert summary.baseline_goodput == pytest.approx(110.0)
    assert summary.mean_goodput == pytest.approx(226.0)
    assert summary.goodput_gain == pytest.approx(226.0 / 110.0)
    assert "gain x2.05" in report.format_summary(summary)
    # no batch_size events: the summary says the gain is not a batch-size decision's
    assert "no batch-size decisions" in report.format_summary(summary)


def test_without_goodput_the_gain_is_not_invented(tmp_path):
    records = [step(1.0, 1, 10, goodput=None), step(2.0, 1, 20, goodput=None)]
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, records))))
    assert summary.goodput_gain is None
    assert "goodput: not measured" in report.format_summary(summary)


def test_records_of_other_loaders_are_left_out(tmp_path):
    train = [step(float(i), 1, i * 10, loader="0") for i in range(1, 6)]
    validation = [step(2.5, 1, 10, loader="1", batch_size=512), step(4.5, 1, 20, loader="1", batch_size=512)]
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, sorted(
        train + validation, key=lambda r: r["time"])))))
    assert summary.loader == "0"
    assert summary.step_records == 5
    assert summary.final_batch_size == 32


def test_missing_run_dir_and_missing_metrics_say_where_to_look(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        report.find_metrics_file(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="ADAPTIVE_SHARE_PATH"):
        report.find_metrics_file(str(tmp_path))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.floats(0.0, 50.0), st.integers(1, 3)), min_size=1, max_size=6))
def test_restart_count_and_time_lost_for_any_sequence_of_processes(spans):
    """Each tuple is one process: (records, gap in seconds before it, replicas)."""
    records, now, expected_lost, pid = [], 1000.0, 0.0, 100
    for index, (count, gap, replicas) in enumerate(spans):
        if index:
            now += gap
            expected_lost += gap
        pid += 1
        for k in range(count):
            records.append(step(now, pid, len(records) + 1, replicas=replicas))
            if k < count - 1:
                now += 1.0
    run = report.Run(path="m.jsonl", processes=tuple(_runs._split_processes(records, [])))
    summary = report.summarize(run)
    assert summary.restarts == len(spans) - 1
    assert summary.time_lost == pytest.approx(expected_lost)
    changes = sum(1 for a, b in zip(spans, spans[1:]) if a[2] != b[2])
    assert len(summary.replica_changes) == changes


# ---------------------------------------------------------------------- command line


def test_cli_without_matplotlib_prints_the_summary_and_says_what_to_install(tmp_path, monkeypatch, capsys):
    write_metrics(tmp_path, [step(1.0, 1, 10), step(2.0, 1, 20)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    status = cli.main(["report", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == cli.EXIT_MISSING_DEPENDENCY
    assert "restarts: 0" in out
    assert 'pip install "adaptive-elastic[report]"' in err
    assert not (tmp_path / "report.png").exists()


def test_cli_reports_a_missing_metrics_file_without_a_traceback(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_cli_json_summary(tmp_path, capsys):
    write_metrics(tmp_path, [step(1.0, 1, 10), step(5.0, 2, 11)])
    assert cli.main(["report", str(tmp_path), "--json", "--no-png"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["restarts"] == 1 and summary["time_lost"] == pytest.approx(4.0)


def test_python_dash_m_adaptive_runs_the_same_command(tmp_path):
    write_metrics(tmp_path, [step(1.0, 1, 10)])
    result = subprocess.run([sys.executable, "-m", "adaptive", "report", str(tmp_path), "--no-png"],
                            capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert result.returncode == 0, result.stderr
    assert "restarts: 0" in result.stdout


# ---------------------------------------------------------------------- a real run

TINY_JOB = textwrap.dedent("""
    import os
    import torch
    import adaptive

    torch.manual_seed(0)
    features = torch.randn(256, 8)
    dataset = torch.utils.data.TensorDataset(features, features.sum(dim=1, keepdim=True))
    adaptive.init_process_group("gloo")
    net = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.02)
    model = adaptive.AdaptiveDataParallel(net, optimizer)
    loader = adaptive.AdaptiveDataLoader(dataset, batch_size=16, shuffle=True)
    loader.autoscale_batch_size(64, local_bsz_bounds=(8, 64), adapt_every=5)
    stop_at = int(os.environ.get("STOP_AT_STEP", "0"))
    stats = adaptive.Accumulator()
    for epoch in adaptive.remaining_epochs_until(3):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stats["loss_sum"] += loss.item() * len(x)
            stats["n"] += len(x)
            if stop_at and loader.step >= stop_at:
                adaptive.request_stop()  # what SIGTERM does: checkpoint at an agreed step, exit 143
        with stats.synchronized():
            stats.clear()
""")


def run_job(script: Path, folder: Path, **extra: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                       ADAPTIVE_CHECKPOINT_PATH=str(folder / "checkpoints"), ADAPTIVE_SHARE_PATH=str(folder / "share"),
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", ADAPTIVE_METRICS_INTERVAL="1", OMP_NUM_THREADS="1", **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "ADAPTIVE_JOB_ID"):
        environment.pop(name, None)
    return subprocess.run([sys.executable, str(script)], env=environment, cwd=str(folder), capture_output=True,
                          text=True, timeout=180)


@pytest.mark.distributed
def test_report_of_a_real_run_with_a_graceful_restart(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason='the PNG needs the report extra: pip install "adaptive-elastic[report]"')
    script = tmp_path / "tiny_job.py"
    script.write_text(TINY_JOB)
    first = run_job(script, tmp_path, STOP_AT_STEP="8")  # reached in epoch 0 whatever autoscale picks
    assert first.returncode == 143, first.stderr[-3000:]
    pause = 1.0
    time.sleep(pause)
    second = run_job(script, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]

    output = tmp_path / "out" / "report.png"
    assert cli.main(["report", str(tmp_path / "share"), "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "restarts: 1" in printed and str(output) in printed
    width, height = png_size(output)
    assert (width, height) == (1400, 1900)  # six rows: the script's own totals (mean loss) are the last
    assert output.stat().st_size > 30_000  # drawn panels, not an empty canvas

    run = report.load_run(str(tmp_path / "share"))
    summary = report.summarize(run)
    lines = [json.loads(line) for line in (tmp_path / "share" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "event" not in r]
    assert summary.restarts == 1 and len({r["pid"] for r in lines}) == 2
    assert summary.step_records == len(steps)
    before, after = run.processes
    assert before.last_step < after.first_step, "a graceful stop loses no steps and repeats none"
    assert summary.progress_losses == (), "a graceful stop loses no progress"
    assert after.start_time - before.end_time >= pause
    assert summary.time_lost == pytest.approx(after.start_time - before.end_time)
    assert summary.initial_batch_size == 16
    last_size = [r.get("after", r.get("batch_size")) for r in lines if r.get("event") in (None, "batch_size")][-1]
    assert summary.final_batch_size == last_size
    assert summary.batch_size_decisions == sum(1 for r in lines if r.get("event") == "batch_size")
    assert summary.goodput_gain is not None and summary.goodput_gain > 0
    totals = [r for r in lines if r.get("event") == "totals"]
    assert [r["epoch"] for r in totals] == [0, 1, 2] and all(r["values"]["n"] == 256 for r in totals), totals
    series = _png._totals_series(run)
    assert list(series) == ["loss_sum / n (0)"] and len(series["loss_sum / n (0)"]) == 3


# ---------------------------------------------------------------------- progress lost, replica-change steps


def start(time_, pid, replicas, resumed=None, **fields):
    """A ``start`` event as adaptive.checkpoint.states.resumed_checkpoint() writes it (resumed=None: from scratch)."""
    record = {"time": time_, "pid": pid, "event": "start", "replicas": replicas, "nodes": 1, "resumed": resumed,
              "epoch": None, "step": None, "replicas_before": None}
    record.update(fields)
    return record


def trained(pid, t0, steps, epochs_of, replicas, loader="0"):
    """Step records of one process: one per step in ``steps``, a second apart from t0."""
    return [step(t0 + k, pid, s, epoch=epochs_of(s), replicas=replicas, loader=loader) for k, s in enumerate(steps)]


def test_a_silent_restart_from_scratch_is_reported_as_progress_lost(tmp_path, capsys):
    """Issue 12 item 10: 2 replicas trained to step 630 (epoch 3), then a relaunch on 1 replica resumed nothing."""
    first = [start(100.0, 11, 2)] + trained(11, 101.0, range(10, 640, 10), lambda s: s // 200, replicas=2)
    second = [start(300.0, 22, 1)] + trained(22, 301.0, range(10, 60, 10), lambda s: 0, replicas=1)
    write_metrics(tmp_path, first + second)
    summary = report.summarize(report.load_run(str(tmp_path)))

    assert [(c.before, c.after, c.step) for c in summary.replica_changes] == [(2, 1, 0)]
    (loss,) = summary.progress_losses
    assert loss.from_scratch and loss.checkpoint is None
    assert (loss.process, loss.pid, loss.time) == (1, 22, 300.0)
    assert (loss.reached_step, loss.reached_epoch, loss.resumed_step, loss.resumed_epoch) == (630, 3, 0, 0)
    assert (loss.steps_lost, loss.epochs_lost) == (630, 3)
    assert summary.restarts_from_scratch == 1 and summary.steps_lost == 630

    text = report.format_summary(summary)
    assert "step None" not in text
    assert "changes: 2->1 at step 0 (started from scratch)" in text
    assert "restarts: 1 (time lost between processes:" in text and "; 1 started from scratch" in text
    assert ("PROGRESS LOST: process 2 (pid 22) started from scratch although earlier processes had trained to "
            "step 630 (epoch 3): 630 steps and 3 epochs lost") in text
    assert "ADAPTIVE_CHECKPOINT_PATH" in text

    assert cli.main(["report", str(tmp_path), "--json", "--no-png"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["restarts_from_scratch"] == 1 and printed["steps_lost"] == 630
    assert printed["progress_losses"] == [{"process": 1, "pid": 22, "time": 300.0, "from_scratch": True,
                                           "checkpoint": None, "reached_step": 630, "reached_epoch": 3,
                                           "resumed_step": 0, "resumed_epoch": 0, "steps_lost": 630,
                                           "epochs_lost": 3}]
    assert printed["replica_changes"][0]["step"] == 0


def test_a_graceful_resume_loses_nothing_and_the_change_is_at_the_checkpoint_step(tmp_path):
    first = [start(100.0, 11, 2)] + trained(11, 101.0, range(10, 640, 10), lambda s: s // 200, replicas=2)
    second = [start(300.0, 22, 3, resumed=4, epoch=3, step=634, replicas_before=2, loader="0")] + \
        trained(22, 301.0, range(640, 700, 10), lambda s: 3, replicas=3)
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, first + second))))
    assert [(c.before, c.after, c.step) for c in summary.replica_changes] == [(2, 3, 634)]
    assert summary.progress_losses == () and summary.steps_lost == 0
    text = report.format_summary(summary)
    assert text.splitlines()[2].endswith("changes: 2->3 at step 634")
    assert "PROGRESS LOST" not in text and "progress lost" not in text and "from scratch" not in text


def test_a_crash_that_rolls_back_to_an_older_checkpoint_reports_the_steps_trained_again(tmp_path):
    first = [start(100.0, 11, 2)] + trained(11, 101.0, range(10, 640, 10), lambda s: s // 200, replicas=2)
    second = [start(300.0, 22, 2, resumed=3, epoch=3, step=600, replicas_before=2, loader="0")] + \
        trained(22, 301.0, range(610, 700, 10), lambda s: 3, replicas=2)
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, first + second))))
    (loss,) = summary.progress_losses
    assert not loss.from_scratch and loss.checkpoint == 3
    assert (loss.reached_step, loss.resumed_step, loss.steps_lost, loss.epochs_lost) == (630, 600, 30, 0)
    assert summary.restarts_from_scratch == 0
    text = report.format_summary(summary)
    assert ("progress lost: process 2 (pid 22) resumed checkpoint 3 at step 600 (epoch 3) although step 630 "
            "(epoch 3) had been reached: 30 steps trained again") in text
    assert "PROGRESS LOST" not in text and "from scratch" not in text


def test_the_step_of_another_loader_in_the_start_event_is_not_taken_for_the_training_loaders(tmp_path):
    """A stop in the validation loop: the checkpoint's ``step`` is the validation loader's (loader "1")."""
    first = [start(100.0, 11, 2)] + trained(11, 101.0, range(10, 640, 10), lambda s: s // 200, replicas=2)
    resumed = start(300.0, 22, 1, resumed=5, epoch=3, step=40, replicas_before=2, loader="1")
    second = [resumed] + trained(22, 301.0, range(640, 700, 10), lambda s: 3, replicas=1)
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, first + second))))
    # not "at step 40", and no roll-back from 630 to 40: the first step record of loader "0" after the change
    assert [(c.before, c.after, c.step) for c in summary.replica_changes] == [(2, 1, 640)]
    assert summary.progress_losses == ()
    # with every loader's step in the event, the training loader's is used
    resumed["loader_steps"] = {"0": 632, "1": 40}
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, first + second))))
    assert [(c.before, c.after, c.step) for c in summary.replica_changes] == [(2, 1, 632)]
    assert summary.progress_losses == ()
    assert report.resumed_step(resumed, "1") == 40 and report.resumed_step(resumed, "2") is None


def test_a_resumed_checkpoint_without_a_step_takes_the_next_step_record(tmp_path):
    """save_all_states() called without metadata: the start event has no step."""
    first = [start(100.0, 11, 2)] + trained(11, 101.0, range(10, 110, 10), lambda s: 0, replicas=2)
    second = [start(300.0, 22, 4, resumed=2)] + trained(22, 301.0, range(110, 150, 10), lambda s: 0, replicas=4)
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, first + second))))
    assert [(c.before, c.after, c.step) for c in summary.replica_changes] == [(2, 4, 110)]
    assert summary.progress_losses == ()
    # a change in a process that ended before its first step record: the step is unknown, and said so
    third = [start(400.0, 33, 1, resumed=3)]
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, first + second + third))))
    assert [(c.after, c.step) for c in summary.replica_changes] == [(4, 110), (1, None)]
    assert "4->1 at an unknown step" in report.format_summary(summary)


def test_starting_from_scratch_is_no_loss_when_nothing_had_been_trained(tmp_path):
    """The first launch, and a relaunch after a process that crashed before its first step record."""
    records = [start(100.0, 11, 2), start(200.0, 22, 2)] + trained(22, 201.0, range(10, 50, 10), lambda s: 0, 2)
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, records))))
    assert summary.restarts == 1 and summary.progress_losses == ()
    assert "from scratch" not in report.format_summary(summary)


def test_a_restart_from_scratch_after_a_resume_counts_the_resumed_steps_too(tmp_path):
    """Process 2 resumed step 634 and crashed before its first record; process 3 started from scratch."""
    records = [start(100.0, 11, 2)] + trained(11, 101.0, range(10, 640, 10), lambda s: s // 200, replicas=2)
    records += [start(300.0, 22, 2, resumed=4, epoch=3, step=634, loader="0")]
    records += [start(400.0, 33, 2)] + trained(33, 401.0, range(10, 30, 10), lambda s: 0, replicas=2)
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, records))))
    (loss,) = summary.progress_losses
    assert (loss.process, loss.from_scratch, loss.reached_step, loss.steps_lost) == (2, True, 634, 634)


def test_without_start_events_a_step_counter_going_back_is_still_seen(tmp_path):
    records = [step(1.0, 11, 10), step(2.0, 11, 20), step(3.0, 11, 30), step(9.0, 22, 10), step(10.0, 22, 20)]
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, records))))
    (loss,) = summary.progress_losses
    assert (loss.from_scratch, loss.reached_step, loss.resumed_step, loss.steps_lost) == (False, 30, 10, 20)


def test_the_picture_marks_progress_lost(tmp_path):
    pytest.importorskip("matplotlib", reason='the PNG needs the report extra: pip install "adaptive-elastic[report]"')
    first = [start(100.0, 11, 2)] + trained(11, 101.0, range(10, 640, 10), lambda s: s // 200, replicas=2)
    second = [start(300.0, 22, 1)] + trained(22, 301.0, range(10, 60, 10), lambda s: 0, replicas=1)
    run = report.load_run(str(write_metrics(tmp_path, first + second)))
    summary = report.summarize(run)
    assert "PROGRESS LOST: 630 steps trained again (1 restart(s) from scratch)" in _png._title(run, summary)
    assert _png._loss_label(summary.progress_losses[0]) == "process 2 started from scratch: 630 steps lost"
    output = report.render_png(run, str(tmp_path / "report.png"), summary)
    assert png_size(Path(output)) == (1400, 1600)


@pytest.mark.distributed
def test_report_of_a_real_run_that_lost_its_checkpoints(tmp_path):
    """A real job stops gracefully, its checkpoints vanish, and the relaunch trains from scratch."""
    script = tmp_path / "tiny_job.py"
    script.write_text(TINY_JOB)
    first = run_job(script, tmp_path, STOP_AT_STEP="12")
    assert first.returncode == 143, first.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "share" / "metrics.jsonl").read_text().splitlines()]
    reached = max(r["step"] for r in lines if "event" not in r)
    for path in sorted((tmp_path / "checkpoints").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    second = run_job(script, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]

    summary = report.summarize(report.load_run(str(tmp_path / "share")))
    (loss,) = summary.progress_losses
    assert loss.from_scratch and loss.resumed_step == 0 and loss.reached_step == reached >= 12
    text = report.format_summary(summary)
    assert "started from scratch" in text and "PROGRESS LOST" in text and "step None" not in text


def test_a_loss_is_counted_once_and_later_resumes_follow_the_new_progress(tmp_path):
    """From scratch at pid 22, then a graceful resume of what pid 22 trained: one loss, not two."""
    records = [start(100.0, 11, 2)] + trained(11, 101.0, range(10, 640, 10), lambda s: s // 200, replicas=2)
    records += [start(300.0, 22, 2)] + trained(22, 301.0, range(10, 60, 10), lambda s: 0, replicas=2)
    records += [start(400.0, 33, 2, resumed=1, epoch=0, step=55, loader="0")]
    records += trained(33, 401.0, range(60, 100, 10), lambda s: 0, replicas=2)
    records += [start(500.0, 44, 2, resumed=2, epoch=0, step=70, loader="0")]  # a crash: 90 -> 70
    records += trained(44, 501.0, range(80, 100, 10), lambda s: 0, replicas=2)
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, records))))
    assert [(loss.process, loss.from_scratch, loss.reached_step, loss.resumed_step) for loss in
            summary.progress_losses] == [(1, True, 630, 0), (3, False, 90, 70)]
    assert summary.steps_lost == 630 + 20 and summary.restarts_from_scratch == 1


def test_a_start_event_that_names_no_loader_is_not_taken_for_the_training_loaders_step(tmp_path):
    """Today's start event has ``step`` but not ``loader``: the step may be a validation loop's."""
    first = [start(100.0, 11, 2)] + trained(11, 101.0, range(10, 640, 10), lambda s: s // 200, replicas=2)
    second = [start(300.0, 22, 3, resumed=5, epoch=3, step=40, replicas_before=2)] + \
        trained(22, 301.0, range(640, 700, 10), lambda s: 3, replicas=3)
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, first + second))))
    assert [(c.before, c.after, c.step) for c in summary.replica_changes] == [(2, 3, 640)]
    assert summary.progress_losses == ()
    # records that name no loader (one loader, an older writer): the event's step is the one there is
    for record in first + second:
        record.pop("loader", None)
    summary = report.summarize(report.load_run(str(write_metrics(tmp_path, first + second))))
    assert [(c.before, c.after, c.step) for c in summary.replica_changes] == [(2, 3, 40)]
    (loss,) = summary.progress_losses
    assert (loss.reached_step, loss.resumed_step) == (630, 40)


# ---------------------------------------------------------------------- durations

# Outputs of the two formatters this one replaces (report's ``_duration``, the
# data loader's ETA ``_duration``), recorded before the change.
@pytest.mark.parametrize(("seconds", "text"), [
    (0.0, "0.0 s"), (59.94, "59.9 s"), (119.9, "119.9 s"), (120.0, "2.0 min"), (7199.0, "120.0 min"),
    (7200.0, "2.00 h"), (90061.0, "25.02 h"), (-3.0, "-3.0 s"),
])
def test_durations_read_as_before(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0:00:00"), (-5, "0:00:00"), (59.9, "0:00:59"), (3661.7, "1:01:01"), (90061, "25:01:01"),
])
def test_clock_durations_read_as_the_loader_eta_did(seconds, text):
    assert format_duration(seconds, clock=True) == text
