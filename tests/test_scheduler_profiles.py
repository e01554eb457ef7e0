"""Measured profiles: interpolation of step times, gradient statistics, progress."""

import math
import os

import pytest

from scheduler.profiles import (DEFAULT_TRACES_DIR, ModelProfile, ModelSettings, canonical_placement,
                                load_profiles)
from scheduler.sim.workload import load_workload


def write_trace(root, name="toy", placements=None, scalability=None, validation=None):
    """A synthetic model trace folder; returns its path."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    placements = placements or [("1", 10, 1.0, 0.0), ("1", 30, 3.0, 0.0),
                                ("2", 10, 1.2, 0.2), ("2", 30, 3.2, 0.2),
                                ("11", 10, 1.5, 0.5), ("11", 30, 3.5, 0.5)]
    with open(os.path.join(path, "placements.csv"), "w") as f:
        f.write("placement,local_bsz,step_time,sync_time\n")
        f.writelines(f"{p},{b},{s},{y}\n" for p, b, s, y in placements)
    with open(os.path.join(path, "scalability.csv"), "w") as f:
        f.write("num_nodes,num_replicas,local_bsz,step_time,sync_time\n")
        f.writelines(f"{n},{r},{b},{s},{y}\n" for n, r, b, s, y in (scalability or []))
    validation = validation or {10: [(100.0, 1.0, 0.0), (200.0, 1.0, 0.0)],
                                40: [(110.0, 2.0, 4.0), (190.0, 3.0, 6.0)]}
    for batch, rows in validation.items():
        with open(os.path.join(path, f"validation-{batch}.csv"), "w") as f:
            f.write("progress,iteration,metric,grad_sqr,grad_var\n")
            f.writelines(f"{p},0,0,{s},{v}\n" for p, s, v in rows)
    return path


def test_canonical_placement_is_smallest_rotation():
    assert canonical_placement((4, 2)) == (2, 4)
    assert canonical_placement((0, 3, 1, 0, 4)) == (1, 4, 3)
    assert canonical_placement([1, 3, 2, 4]) == (1, 3, 2, 4)
    with pytest.raises(ValueError, match="at least one GPU"):
        canonical_placement((0, 0))


def test_exact_placement_interpolates_and_extends_linearly(tmp_path):
    prof = ModelProfile("toy", write_trace(str(tmp_path)))
    assert prof.step_time((1,), 20) == pytest.approx((2.0, 0.0))
    assert prof.step_time((1, 1), 10) == pytest.approx((1.5, 0.5))
    assert prof.step_time((2,), 50) == pytest.approx((5.2, 0.2))  # end slope 0.1 s per sample
    assert prof.step_time((1,), 0.5)[0] == pytest.approx(0.5)  # floored at half the first point


def test_unmeasured_placement_interpolates_over_nodes_then_replicas(tmp_path):
    scal = [(4, 8, 10, 4.0, 1.0), (4, 12, 10, 6.0, 1.0), (8, 8, 10, 8.0, 3.0), (8, 12, 10, 10.0, 3.0)]
    prof = ModelProfile("toy", write_trace(str(tmp_path), scalability=scal))
    # 6 nodes, 10 replicas: halfway between 4 and 8 nodes, each halfway between 8 and 12 replicas.
    assert prof.step_time((2, 2, 2, 2, 1, 1), 10) == pytest.approx((7.0, 2.0))
    # Node counts outside the data use the nearest measured ones.
    assert prof.step_time((1,) * 9 + (3,), 10) == pytest.approx((10.0, 3.0))


def test_grad_stats_interpolate_between_validated_batches(tmp_path):
    prof = ModelProfile("toy", write_trace(str(tmp_path)))
    assert prof.grad_stats(10, 0) == (1.0, 0.0)
    assert prof.grad_stats(25, 1) == pytest.approx((2.0, 3.0))
    assert prof.grad_stats(4000, 0) == (2.0, 4.0)  # clamped to the largest validated batch
    assert prof.grad_stats(40, 99) == (3.0, 6.0)  # clamped to the last epoch


def test_gain_follows_the_trace_definition(tmp_path):
    prof = ModelProfile("toy", write_trace(str(tmp_path)))
    sqr, var = prof.grad_stats(40, 0)
    scale = 40 / prof.init_batch_size
    assert prof.gain(40, 0) == pytest.approx((var + sqr) / (var / scale + sqr))
    assert prof.gain(10, 0) == pytest.approx(1.0)


def test_progress_is_the_minimum_over_batch_sizes(tmp_path):
    prof = ModelProfile("toy", write_trace(str(tmp_path)))
    assert prof.init_batch_size == 10 and prof.max_batch_size == 40 and prof.max_epochs == 2
    assert [prof.progress_at_epoch(e) for e in range(3)] == [0.0, 100.0, 190.0]
    assert prof.total_progress == 190.0
    with pytest.raises(ValueError, match="epoch must be in"):
        prof.progress_at_epoch(3)


def test_settings_override_and_validate(tmp_path):
    path = write_trace(str(tmp_path))
    prof = ModelProfile("toy", path, ModelSettings(max_epochs=1, max_local_bsz=20))
    assert prof.max_epochs == 1 and prof.max_local_bsz == 20 and prof.min_local_bsz == 10
    with pytest.raises(ValueError, match="exceeds"):
        ModelProfile("toy", path, ModelSettings(max_epochs=5))


def test_bad_trace_files_give_clear_errors(tmp_path):
    path = write_trace(str(tmp_path))
    with open(os.path.join(path, "placements.csv"), "w") as f:
        f.write("placement,local_bsz\n1,10\n")
    with pytest.raises(ValueError, match="missing columns"):
        ModelProfile("toy", path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no model traces"):
        load_profiles(str(empty))
    with pytest.raises(FileNotFoundError):
        load_profiles(str(tmp_path / "missing"))


def test_bundled_reference_data_loads():
    profiles = load_profiles(DEFAULT_TRACES_DIR)
    assert sorted(profiles) == ["bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"]
    epochs = {name: p.max_epochs for name, p in profiles.items()}
    assert epochs == {"bert": 2, "cifar10": 100, "deepspeech2": 80, "imagenet": 90, "ncf": 10, "yolov3": 50}
    assert {n: p.init_batch_size for n, p in profiles.items()} == {
        "bert": 12, "cifar10": 128, "deepspeech2": 20, "imagenet": 200, "ncf": 256, "yolov3": 8}
    cifar = profiles["cifar10"]
    # Placements are measured up to 4 nodes, so (4, 2) is exact and 6 x 4 GPUs is interpolated.
    assert cifar.step_time((4, 2), 342) == cifar.step_time((2, 4), 342)
    assert all(math.isfinite(t) and t > 0 for t in cifar.step_time((4,) * 6, 171))


def test_workload_files_validate(tmp_path):
    good = tmp_path / "w.csv"
    good.write_text("name,time,application,num_replicas,batch_size\nb,20,toy,2,64\na,10,toy,1,32\n")
    jobs = load_workload(str(good), applications=["toy"])
    assert [j.name for j in jobs] == ["a", "b"]
    with pytest.raises(ValueError, match="unknown application"):
        load_workload(str(good), applications=["other"])
    bad = tmp_path / "bad.csv"
    bad.write_text("name,time,application,num_replicas,batch_size\na,10,toy,0,32\n")
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        load_workload(str(bad))
    dup = tmp_path / "dup.csv"
    dup.write_text("name,time,application,num_replicas,batch_size\na,1,toy,1,1\na,2,toy,1,1\n")
    with pytest.raises(ValueError, match="duplicate"):
        load_workload(str(dup))
    cols = tmp_path / "cols.csv"
    cols.write_text("name,time\na,1\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_workload(str(cols))
