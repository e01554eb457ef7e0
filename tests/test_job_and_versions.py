"""The job context (one object, one reset) and the versioned state protocol."""

from __future__ import annotations

import pytest
import torch

import adaptive
from adaptive.checkpoint import states
from adaptive.checkpoint.versions import UNVERSIONED, Format, StateFormatError, check_fields, read_state
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
    thing = Format("thing", version=3, migrations={1: lambda s: dict(s, b=0), 2: lambda s: dict(s, c=s["b"] + 1)})
    assert thing.readable == (1, 2, 3)
    assert thing.upgrade({"a": 1}, 1) == {"a": 1, "b": 0, "c": 1}
    assert thing.upgrade({"a": 1}, 3) == {"a": 1}
    with pytest.raises(StateFormatError, match="thing was saved in format version 4.*reads up to version 3"):
        thing.upgrade({}, 4)
    with pytest.raises(StateFormatError, match="no migration from format version 1 to 2; this release reads "
                                               "versions 2..2"):
        Format("thing", version=2).upgrade({}, 1)
    with pytest.raises(StateFormatError, match="integer >= 1"):
        thing.upgrade({}, "2")


def test_one_reader_for_a_versioned_dict_declared_by_a_format_or_by_a_class():
    """``Format.read`` takes the ``"version"`` key off and migrates; a class declares the same two names."""
    thing = Format("thing", version=2, migrations={1: lambda s: dict(s, b=0)})
    assert thing.read({"version": 1, "a": 1}) == {"a": 1, "b": 0}
    with pytest.raises(StateFormatError, match="thing: saved state has no 'version' key \\(format version 2"):
        thing.read({"a": 1})
    with pytest.raises(StateFormatError, match="thing: saved state must be a mapping \\(dict\\), got list"):
        thing.read([1])
    assert Format("thing", 2, thing.migrations, unversioned=UNVERSIONED).read({"a": 1}) == {"a": 1, "b": 0}

    class Thing:
        version = 2
        migrations = thing.migrations

    assert Format.of(Thing, "thing") == thing
    assert read_state("thing", {"version": 2, "a": 1, "b": 2}, Thing()) == {"a": 1, "b": 2}
    check_fields("thing", {"a": 1, "b": 2}, ("a",), optional=("b",))
    with pytest.raises(StateFormatError, match="thing is missing \\['a'\\]"):
        check_fields("thing", {"b": 2}, ("a",), optional=("b",))
    with pytest.raises(StateFormatError, match="thing has unknown keys \\['c'\\]"):
        check_fields("thing", {"a": 1, "c": 2}, ("a",))


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


def test_the_manifest_lists_the_steps_that_states_declare(job):
    """The checkpoint layer asks every state for its manifest entry (``State.manifest_step``): loaders give theirs."""
    loader = adaptive.AdaptiveDataLoader(Indices(8), batch_size=4, name="train")
    for _ in loader:
        pass
    adaptive.Accumulator()  # a state without a step
    states.save_all_states()
    metadata = states._checkpoint_store().latest().info.metadata
    assert metadata["loader_steps"] == {"train": 2}
    assert metadata["state_versions"]["adaptive.dataloader.train"] == 1


def test_a_checkpoint_of_the_previous_release_still_resumes(job):
    """0.1 wrote no versions, and its epoch state had no "ended": migrated explicitly to format 2."""
    store = states._checkpoint_store()
    store.save({"adaptive.epoch": {"current": None, "finished": 2}}, metadata={"reason": "stop", "epoch": 2})
    restart_process_state()
    assert adaptive.finished_epochs() == 2 and not adaptive.training_finished()
    assert list(adaptive.remaining_epochs_until(3)) == [2]
