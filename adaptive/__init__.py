"""Elastic, adaptive-batch-size training for PyTorch, on torchrun.

Change a few lines of an ordinary training script::

    import adaptive

    adaptive.init_process_group("gloo")
    model = adaptive.AdaptiveDataParallel(model, optimizer, lr_scheduler)
    loader = adaptive.AdaptiveDataLoader(dataset, batch_size=256, shuffle=True)
    for epoch in adaptive.remaining_epochs_until(30):
        for x, y in loader:
            ...

and launch it with ``adaptive-run`` (torchrun with reliable elastic
defaults).  Killing workers, rescaling, or relaunching the same command
resumes from the last checkpoint with the new number of replicas.
"""

from adaptive.accumulator import Accumulator
from adaptive.checkpoint import CheckpointError, State, load_state, save_all_states
from adaptive.collectives import CollectiveError, init_process_group
from adaptive.dataloader import AdaptiveDataLoader
from adaptive.epoch import current_epoch, finish_training, finished_epochs, remaining_epochs_until, training_finished
from adaptive.parallel import AdaptiveDataParallel
from adaptive.rampup import ConstantSchedule, LinearRampup, StagedSchedule
from adaptive.sync_points import request_stop
from adaptive.token_batching import OversizeSampleError

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "AdaptiveDataLoader",
    "AdaptiveDataParallel",
    "CheckpointError",
    "CollectiveError",
    "ConstantSchedule",
    "LinearRampup",
    "OversizeSampleError",
    "StagedSchedule",
    "State",
    "current_epoch",
    "finish_training",
    "finished_epochs",
    "init_process_group",
    "load_state",
    "remaining_epochs_until",
    "request_stop",
    "save_all_states",
    "training_finished",
]
