"""Step control: what keeps a job's replicas in step across stops, restarts and epochs.

The stop and checkpoint agreement at step boundaries (:mod:`.sync_points`),
the restartable epoch loop (:mod:`.epoch`), replica-summed metrics that
survive restarts (:mod:`.accumulator`), the checkpointed random generators
(:mod:`.random_state`), live membership changes (:mod:`.live`) and the
``adaptive-run`` launcher (:mod:`.launcher`, with its live agent in
:mod:`.live_agent`, which forks workers from a pre-warmed process:
:mod:`.warm_start`).
It stands on the runtime (:mod:`adaptive.runtime`: environment, job context,
collectives) and on the checkpoints (:mod:`adaptive.checkpoint`); ``env``,
``init_process_group`` and ``CollectiveError`` are handed on from the runtime.
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "env": "adaptive.runtime.env",
    "init_process_group": "adaptive.runtime.collectives",
    "CollectiveError": "adaptive.runtime.errors",
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
    "request_leave": "adaptive.elastic.live",
    "leave_requested": "adaptive.elastic.live",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
