"""The runtime: the ground floor every other layer of ``adaptive`` stands on.

What a training process is and whom it talks to, with no notion yet of
checkpoints, epochs or batch sizes: the environment torchrun gives
(:mod:`.env`), the job context that holds a process's job state
(:mod:`.job`), the process groups and collectives (:mod:`.collectives`),
the step the running loader publishes to the models and optimizers
(:mod:`.step`), the live job's generations of members (:mod:`.membership`,
``adaptive-run --live``), its collectives that outlast a lost peer
(:mod:`.fault_tolerant_group` for a sharded model's mesh, :mod:`.loss_watch`),
how a peer's death is reported (:mod:`.peer_failure`),
what workers report to ``adaptive-run`` (:mod:`.launch_status`) and the
processes that end with their incarnation (:mod:`.process_tree`).

Nothing here imports a module of a higher layer (``checkpoint``,
``elastic``, ``batchsize``, ``data``, ``parallel``); importing a module
touches no file.
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "env": "adaptive.runtime.env",
    "init_process_group": "adaptive.runtime.collectives",
    "CollectiveError": "adaptive.runtime.errors",
    "StepContext": "adaptive.runtime.step",
    "current_step": "adaptive.runtime.step",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
