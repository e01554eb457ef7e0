"""The elastic runtime: one training process's place in its job.

The environment torchrun gives (:mod:`.env`), the process groups and
collectives (:mod:`.collectives`), the stop and checkpoint agreement at step
boundaries (:mod:`.sync_points`), the restartable epoch loop (:mod:`.epoch`),
replica-summed metrics that survive restarts (:mod:`.accumulator`), the job
context that holds a process's job state (:mod:`.job`), the ``adaptive-run``
launcher (:mod:`.launcher`), what workers report to it (:mod:`.launch_status`)
and the processes that end with their incarnation (:mod:`.process_tree`).
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "env": "adaptive.elastic.env",
    "init_process_group": "adaptive.elastic.collectives",
    "CollectiveError": "adaptive.elastic.collectives",
    "remaining_epochs_until": "adaptive.elastic.epoch",
    "current_epoch": "adaptive.elastic.epoch",
    "finished_epochs": "adaptive.elastic.epoch",
    "finish_training": "adaptive.elastic.epoch",
    "training_finished": "adaptive.elastic.epoch",
    "request_stop": "adaptive.elastic.sync_points",
    "stop_requested": "adaptive.elastic.sync_points",
    "GRACEFUL_EXIT_CODE": "adaptive.elastic.sync_points",
    "STOP_FAILED_EXIT_CODE": "adaptive.elastic.sync_points",
    "STALE_GENERATION_EXIT_CODE": "adaptive.elastic.sync_points",
    "Accumulator": "adaptive.elastic.accumulator",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
