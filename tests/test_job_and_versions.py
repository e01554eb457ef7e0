"""The job context (one object, one reset) and the versioned state protocol."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import adaptive
from adaptive.checkpoint import fencing, states
from adaptive.checkpoint.versions import UNVERSIONED, Format, StateFormatError, check_fields, read_state
from adaptive.elastic import stopping, sync_points
from adaptive.parallel._training import TrainedModels, trained_models
from adaptive.runtime.job import current_job, reset_job
from adaptive.runtime.step import StepContext, current_step
from adaptive.runtime.step import stream as step_stream
from conftest import Indices, restart_process_state


def _model() -> adaptive.AdaptiveDataParallel:
    net = torch.nn.Linear(1, 1)
    return adaptive.AdaptiveDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_the_loader_publishes_each_micro_step_and_the_models_are_on_the_job(job):
    model = _model()
    loader = adaptive.AdaptiveDataLoader(Indices(8), batch_size=4)
    loader.autoscale_batch_size(8, (1, 2), gradient_accumulation=True)  # 4 = 2 x 2 micro-steps on one replica
    models = trained_models()
    assert models.latest is model and model in models.every and step_stream().loop is None
    seen = []
    for _ in loader:
        context = current_step()
        assert step_stream().loop == loader.name and adaptive.data.current_dataloader() is loader
        assert isinstance(context, StepContext) and context.loader == loader.name
        assert (context.micro_step, context.num_micro_steps) == loader.micro_step
        assert context.planned_size == loader.batch_size and context.init_batch_size == 4
        assert context.loss_weight == loader.loss_weight and context.lr_scaling == "auto"
        model(torch.ones(2, 1)).sum().backward()  # the wrapper reads the step at its forward
        model.optimizer.step()
        assert model.gns.config is not None and model.gns.config.accum_steps == context.num_micro_steps
        assert model.require_backward_grad_sync is False  # one replica: nothing to reduce
        seen.append((context.index, context.micro_step, context.is_accumulation_step))
        with pytest.raises(dataclasses.FrozenInstanceError):
            context.size = 0  # one immutable message per micro-step
    assert step_stream().loop is None and current_step() is None
    assert seen and seen[0][:2] == (0, 0)
    assert step_stream().steps_committed == loader.step
    assert step_stream().optimizer_steps == sum(not accumulating for *_, accumulating in seen)  # skipped otherwise


def test_reset_forgets_states_agreement_epoch_and_models(job):
    _model()
    adaptive.Accumulator()
    sync_points.request_stop()
    old = current_job()
    assert old.part(states.CheckpointSession).registry and old.part(stopping.StopRequest).requested
    assert old.part(TrainedModels).latest is not None
    new = reset_job()
    assert new is current_job() and new is not old
    assert not new.part(states.CheckpointSession).registry and not new.part(stopping.StopRequest).requested
    assert new.part(TrainedModels).latest is None
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
    latest = fencing.checkpoint_store().latest()
    assert latest.info.metadata["state_versions"]["adaptive.epoch"] == 2
    # The same checkpoint as a later release might write it: format 3 of the epoch state.
    store = fencing.checkpoint_store()
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
    metadata = fencing.checkpoint_store().latest().info.metadata
    assert metadata["loader_steps"] == {"train": 2}
    assert metadata["state_versions"]["adaptive.dataloader.train"] == 1


def test_a_checkpoint_of_the_previous_release_still_resumes(job):
    """0.1 wrote no versions, and its epoch state had no "ended": migrated explicitly to format 2."""
    store = fencing.checkpoint_store()
    store.save({"adaptive.epoch": {"current": None, "finished": 2}}, metadata={"reason": "stop", "epoch": 2})
    restart_process_state()
    assert adaptive.finished_epochs() == 2 and not adaptive.training_finished()
    assert list(adaptive.remaining_epochs_until(3)) == [2]
