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

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptive._utils.lazy import lazy_exports
from adaptive.runtime import process_tree as _process_tree

__version__ = "0.2.0"

#: Each public name and the module that defines it.  Imported on first use, so
#: that the torch-free parts (``adaptive.goodput``, ``adaptive.data.sampler``,
#: ...) import without torch.
_EXPORTS = {
    "Accumulator": "adaptive.elastic.accumulator",
    "AdaptiveDataLoader": "adaptive.data.dataloader",
    "AdaptiveDataParallel": "adaptive.parallel.data_parallel",
    "AdaptiveFSDP": "adaptive.parallel.fully_sharded",
    "CheckpointError": "adaptive.checkpoint.store",
    "CollectiveError": "adaptive.runtime.errors",
    "ConstantSchedule": "adaptive.batchsize.rampup",
    "LinearRampup": "adaptive.batchsize.rampup",
    "OversizeSampleError": "adaptive.data.tokens.lengths",
    "StagedSchedule": "adaptive.batchsize.rampup",
    "ShardedState": "adaptive.checkpoint.states",
    "State": "adaptive.checkpoint.states",
    "current_epoch": "adaptive.elastic.epoch",
    "env": "adaptive.runtime.env",
    "finish_training": "adaptive.elastic.epoch",
    "finished_epochs": "adaptive.elastic.epoch",
    "init_process_group": "adaptive.runtime.collectives",
    "load_state": "adaptive.checkpoint.states",
    "remaining_epochs_until": "adaptive.elastic.epoch",
    "request_stop": "adaptive.elastic.sync_points",
    "save_all_states": "adaptive.checkpoint.states",
    "training_finished": "adaptive.elastic.epoch",
    "wait_for_pending_save": "adaptive.checkpoint.states",
}

__all__ = sorted(_EXPORTS)

#: Subpackages reachable as ``adaptive.<name>`` after ``import adaptive`` (imported on first use).
_SUBPACKAGES = ("batchsize", "checkpoint", "data", "elastic", "goodput", "observe", "parallel")

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _SUBPACKAGES)

# A training worker that adaptive-run started dies with it (SIGKILL from the kernel), whatever kills
# the launcher: torchrun's workers live in sessions of their own, out of reach of a signal to the
# launcher's process group.  Nothing happens outside adaptive-run (see adaptive.runtime.process_tree).
_process_tree.bind_to_parent()

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from adaptive.batchsize.rampup import ConstantSchedule, LinearRampup, StagedSchedule
    from adaptive.checkpoint.states import ShardedState, State, load_state, save_all_states, wait_for_pending_save
    from adaptive.checkpoint.store import CheckpointError
    from adaptive.data.dataloader import AdaptiveDataLoader
    from adaptive.data.tokens.lengths import OversizeSampleError
    from adaptive.runtime import env
    from adaptive.elastic.accumulator import Accumulator
    from adaptive.runtime.collectives import init_process_group
    from adaptive.runtime.errors import CollectiveError
    from adaptive.elastic.epoch import (current_epoch, finish_training, finished_epochs, remaining_epochs_until,
                                        training_finished)
    from adaptive.elastic.sync_points import request_stop
    from adaptive.parallel.data_parallel import AdaptiveDataParallel
    from adaptive.parallel.fully_sharded import AdaptiveFSDP
