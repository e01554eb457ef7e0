"""The job context (one object, one reset) and the versioned state protocol."""

from __future__ import annotations

import pytest
import torch

import adaptive
from adaptive.checkpoint import states
from adaptive.checkpoint.versions import StateFormatError, upgrade
from adaptive.elastic import sync_points
from adaptive.elastic.job import current_job, reset_job
from conftest import Indices, restart_process_state


def _model() -> adaptive.AdaptiveDataParallel:
    net = torch.nn.Linear(1, 1)
    return adaptive.AdaptiveDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_the_loader_and_the_model_reach_each_other_through_the_job(job):
    model = _model()
    loader = adaptive.AdaptiveDataLoader(Indices(8), batch_size=4)
    training = current_job().training
    assert training.model is model and model in training.models and training.loop is None
    for _ in loader:
        assert training.loop is loader
    assert training.loop is None


def test_reset_forgets_states_agreement_epoch_and_models(job):
    _model()
    adaptive.Accumulator()
    sync_points.request_stop()
    old = current_job()
    assert old.checkpoints.registry and old.agreement.stop_requested and old.training.model is not None
    new = reset_job()
    assert new is current_job() and new is not old
    assert not new.checkpoints.registry and not new.agreement.stop_requested and new.training.model is None
    assert not sync_points.stop_requested() and states.registered_states() == []


def test_a_reset_gives_back_the_signal_handlers(job):
    import signal

    before = signal.getsignal(signal.SIGTERM)
    sync_points.install_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) is not before
    reset_job()
    assert signal.getsignal(signal.SIGTERM) is before


def test_upgrade_migrates_step_by_step_and_refuses_newer_or_unknown_formats():
    steps = {1: lambda s: dict(s, b=0), 2: lambda s: dict(s, c=s["b"] + 1)}
    assert upgrade("thing", {"a": 1}, 1, 3, steps) == {"a": 1, "b": 0, "c": 1}
    assert upgrade("thing", {"a": 1}, 3, 3, steps) == {"a": 1}
    with pytest.raises(StateFormatError, match="thing was saved in format version 4.*reads up to version 3"):
        upgrade("thing", {}, 4, 3, steps)
    with pytest.raises(StateFormatError, match="no migration from format version 1"):
        upgrade("thing", {}, 1, 2, {})
    with pytest.raises(StateFormatError, match="integer >= 1"):
        upgrade("thing", {}, "2", 2, steps)


def test_checkpoints_record_state_versions_and_a_newer_one_is_a_clear_error(job):
    for _ in adaptive.remaining_epochs_until(1):
        pass
    latest = states._checkpoint_store().latest()
    assert latest.info.metadata["state_versions"]["adaptive.epoch"] == 2
    # The same checkpoint as a later release might write it: format 3 of the epoch state.
    store = states._checkpoint_store()
    content = {name: latest.load(name) for name in latest.names()}
    store.save(content, metadata=dict(latest.info.metadata, state_versions={"adaptive.epoch": 3}))
    restart_process_state()
    with pytest.raises(adaptive.CheckpointError, match="adaptive.epoch was saved in format version 3"):
        adaptive.finished_epochs()


def test_a_checkpoint_of_the_previous_release_still_resumes(job):
    """0.1 wrote no versions, and its epoch state had no "ended": migrated explicitly to format 2."""
    store = states._checkpoint_store()
    store.save({"adaptive.epoch": {"current": None, "finished": 2}}, metadata={"reason": "stop", "epoch": 2})
    restart_process_state()
    assert adaptive.finished_epochs() == 2 and not adaptive.training_finished()
    assert list(adaptive.remaining_epochs_until(3)) == [2]
