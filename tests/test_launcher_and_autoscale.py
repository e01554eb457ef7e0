"""The launcher's torchrun defaults, and the autoscale controller's choices."""

from __future__ import annotations

import pytest

from adaptive.elastic import launcher
from adaptive.batchsize.autoscale import AutoscaleConfig, BatchSizeController
from adaptive.goodput import GradParams, PerfParams


def test_launcher_adds_rendezvous_defaults_and_user_values_win():
    args = launcher.build_args(["--standalone", "--nproc-per-node=2", "--rdzv-conf", "last_call_timeout=9",
                                "train.py", "--lr", "1"])
    conf = dict(item.split("=") for item in args.rdzv_conf.split(","))
    assert conf == {"last_call_timeout": "9", "keep_alive_interval": "2", "keep_alive_max_attempt": "3"}
    assert args.training_script == "train.py" and args.training_script_args == ["--lr", "1"]


def test_launcher_rejects_malformed_rdzv_conf():
    with pytest.raises(SystemExit, match="key=value"):
        launcher.build_args(["--rdzv-conf", "oops", "train.py"])


@pytest.mark.parametrize("kwargs, error", [
    (dict(local_bsz_bounds=(0, 8)), "local_bsz_bounds"),
    (dict(local_bsz_bounds=(9, 8)), "local_bsz_bounds"),
    (dict(max_batch_size=8), "max_batch_size"),
    (dict(adapt_every=0), "adapt_every"),
    (dict(hysteresis=1.5), "hysteresis"),
])
def test_autoscale_config_names_the_bad_argument(kwargs, error):
    base = dict(init_batch_size=32, max_batch_size=1024, local_bsz_bounds=(8, 256))
    with pytest.raises(ValueError, match=error):
        AutoscaleConfig(**{**base, **kwargs})


def _controller(job, accumulation: bool) -> BatchSizeController:
    config = AutoscaleConfig(32, 4096, (16, 256), accumulation, adapt_every=1, hysteresis=0.0)
    controller = BatchSizeController("test", config)
    perf = PerfParams(alpha_c=0.01, beta_c=0.001, alpha_n=0.0, beta_n=0.0, alpha_r=0.0, beta_r=0.0, gamma=1.0)
    for local in (32, 64):  # measured at two sizes: no exploration needed
        for _ in range(3):
            controller.observe(local, 1, step_time=0.01 + 0.001 * local, compute_time=None, data_time=0.0)
    controller._state.perf_params = perf
    return controller


def test_controller_moves_to_the_goodput_optimum(job):
    controller = _controller(job, accumulation=False)
    grad = GradParams(sqr=1.0, var=200.0)  # a large noise scale favours big batches
    decision = controller.decide(grad)
    assert decision is not None and decision.local_bsz > 32 and decision.goodput > decision.previous_goodput
    assert controller.current() == (decision.local_bsz, 1)
    assert controller.decide(grad) is None  # already at the optimum: no flapping


def test_controller_keeps_small_batches_when_noise_is_small(job):
    controller = _controller(job, accumulation=False)
    decision = controller.decide(GradParams(sqr=1.0, var=0.01))
    assert decision is None or decision.local_bsz <= 32


def test_controller_grows_the_batch_in_measured_steps(job, monkeypatch):
    """Equal step times at two small sizes (fixed costs hide the compute) fit a model
    that predicts free larger batches: the choice stays within GROWTH_LIMIT times the
    largest size measured, and grows again once that size is measured."""
    import adaptive.batchsize.autoscale as autoscale

    monkeypatch.setattr(autoscale, "EVALUATION_BUDGET", 0)  # evaluate at every decision
    config = AutoscaleConfig(32, 4096, (16, 1024), False, adapt_every=1, hysteresis=0.0)
    controller = BatchSizeController("test", config)
    grad = GradParams(sqr=1.0, var=1e5)  # a huge noise scale: every batch size is efficient
    measured = [16, 32]
    for _ in range(2):
        for local in measured:
            for _ in range(3):  # (the first step at each size is not recorded)
                controller.observe(local, 1, step_time=0.013, compute_time=None, data_time=0.0)
        decision = controller.decide(grad)
        assert decision is not None and decision.local_bsz == autoscale.GROWTH_LIMIT * measured[-1]
        measured.append(decision.local_bsz)


def test_controller_measures_a_better_size_beyond_those_measured(job, monkeypatch):
    """A predicted gain below the hysteresis still moves the batch when the better size
    lies beyond those measured (the model extrapolates there); within the measured
    range it does not."""
    import adaptive.batchsize.autoscale as autoscale

    monkeypatch.setattr(autoscale, "EVALUATION_BUDGET", 0)
    config = AutoscaleConfig(32, 4096, (16, 1024), False, adapt_every=1, hysteresis=0.5)
    controller = BatchSizeController("test", config)
    grad = GradParams(sqr=1.0, var=1e5)
    for local in (16, 32):  # per-sample time dominates: larger batches gain a few percent
        for _ in range(3):
            controller.observe(local, 1, step_time=0.001 + 0.001 * local, compute_time=None, data_time=0.0)
    decision = controller.decide(grad)
    assert decision is not None and decision.reason.startswith("exploring")
    assert autoscale.EXPLORATION_MARGIN * 32 < decision.local_bsz <= autoscale.GROWTH_LIMIT * 32
    assert decision.goodput < decision.previous_goodput * 1.5
    for _ in range(3):
        controller.observe(decision.local_bsz, 1, step_time=0.001 + 0.001 * decision.local_bsz,
                           compute_time=None, data_time=0.0)
    follow_up = controller.decide(grad)
    assert follow_up is None or follow_up.local_bsz > autoscale.EXPLORATION_MARGIN * decision.local_bsz


def test_controller_spends_at_most_one_percent_of_the_time_evaluating(job, monkeypatch, tmp_path):
    """Decisions due every step (adapt_every=1) are evaluated only once 100x the last
    evaluation's duration has passed; the hints file follows the evaluations."""
    import adaptive.batchsize.autoscale as autoscale
    from adaptive.runtime import env

    monkeypatch.setattr(env, "checkpoint_path", lambda: str(tmp_path))
    clock = {"now": 100.0}
    monkeypatch.setattr(autoscale.time, "monotonic", lambda: clock["now"])
    controller = _controller(job, accumulation=False)
    evaluations = []
    propose = controller._propose
    monkeypatch.setattr(controller, "_propose", lambda *a: evaluations.append(clock["now"]) or propose(*a))
    grad = GradParams(sqr=1.0, var=200.0)
    controller.decide(grad)
    controller.report_hints(grad, progress=1.0)
    written = (tmp_path / "hints.json").stat().st_mtime_ns
    controller._evaluation_cost = 0.01  # as if that evaluation took 10 ms
    for _ in range(5):  # 0.5 s later: not yet 100 x 10 ms
        clock["now"] += 0.1
        assert controller.decide(grad) is None
        controller.report_hints(grad, progress=1.0)
    assert len(evaluations) == 1 and (tmp_path / "hints.json").stat().st_mtime_ns == written
    clock["now"] += 0.6  # 1.1 s after the evaluation
    controller.decide(grad)
    assert len(evaluations) == 2
    controller.decide(grad, force=True)  # a new replica count is never put off
    assert len(evaluations) == 3


def test_controller_hints_carry_the_completed_fraction(job, monkeypatch, tmp_path):
    """The fraction the loader passes in reaches the hints file; without one it is null."""
    from adaptive.goodput import read_hints
    from adaptive.runtime import env

    monkeypatch.setattr(env, "checkpoint_path", lambda: str(tmp_path))
    controller = _controller(job, accumulation=False)
    grad = GradParams(sqr=1.0, var=200.0)
    assert controller.hints(grad, 1.0).completed_fraction is None
    assert controller.hints(grad, 1.0, completed_fraction=0.4).completed_fraction == 0.4
    controller.report_hints(grad, progress=1.0, completed_fraction=0.4)
    assert read_hints(tmp_path).completed_fraction == 0.4


def test_a_stop_signal_that_surfaced_as_another_error_is_still_a_stop():
    """SIGTERM landing inside torchrun's metrics wrapper, before its start time is set, surfaces as an
    UnboundLocalError raised while handling torchrun's SignalException (seen in CI): still a stop."""
    import signal as signals

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from adaptive.elastic.launcher import _signal_behind

    stop = SignalException("Process 1 got signal: 15", sigval=signals.SIGTERM)
    try:
        try:
            raise stop
        except SignalException:
            raise UnboundLocalError("cannot access local variable 'start' where it is not associated with a value")
    except UnboundLocalError as error:
        assert _signal_behind(error) is stop
    assert _signal_behind(stop) is stop
    assert _signal_behind(RuntimeError("a worker failed")) is None
