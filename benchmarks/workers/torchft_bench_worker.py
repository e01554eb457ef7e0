"""Training script for bench_live.py's TorchFT column (benchmark only: the library never imports torchft).

Trains the model of ``live_bench_worker.py`` (the same ``build()``) as one
TorchFT replica group of one process, under its own ``torchrun``: a
``torchft.Manager`` that asks TorchFT's Lighthouse for a quorum every step,
torchft's ``DistributedDataParallel`` and ``OptimizerWrapper``, its
``ProcessGroupGloo`` across the groups, and ``PGTransport``: a group that
(re)joins copies the model and optimizer state from a live peer over that
process group. Logs the end of every step (time, group, participants in the
quorum, whether this group contributed, whether the step was committed, the
job's step count after it) to ``$WORKER_OUT/steps.<pid>.jsonl``, the time
just before its Manager starts (and with it the heartbeats to the Lighthouse)
to ``ready.<pid>``, and an exception that ends the training to
``error.<pid>.txt``.

``torchft_bench_worker.py lighthouse`` runs the Lighthouse instead, on
``127.0.0.1:$TORCHFT_LIGHTHOUSE_PORT``, until SIGTERM.

Environment: ``WORKER_OUT``, ``BENCH_WIDTH``, ``REPLICA_GROUP`` (0 or 1),
``TORCHFT_LIGHTHOUSE`` (its address), ``TORCHFT_LIGHTHOUSE_PORT`` and
``TORCHFT_HEARTBEAT_TIMEOUT_MS`` (the Lighthouse).
"""
import itertools
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch

from live_bench_worker import OUT, STEPS, build  # the same directory: the same model and data

GROUPS = 2
TIMEOUT = timedelta(seconds=10)


def lighthouse() -> None:
    """TorchFT's Lighthouse on 127.0.0.1: a quorum needs 1 replica group; a silent group is dead after the timeout."""
    from torchft._torchft import LighthouseServer

    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # before the server's threads start: they inherit it
    server = LighthouseServer(bind=f"127.0.0.1:{os.environ['TORCHFT_LIGHTHOUSE_PORT']}", min_replicas=1,
                              heartbeat_timeout_ms=int(os.environ["TORCHFT_HEARTBEAT_TIMEOUT_MS"]))
    signal.sigwait(stop)
    server.shutdown()


def _bind_manager_to_loopback() -> None:
    """torchft 0.2.0's Manager binds its server to ``[::]``; keep the port, bind it to 127.0.0.1 only."""
    import torchft.manager

    server = torchft.manager.ManagerServer

    def on_loopback(**kwargs: object) -> object:
        kwargs["bind"] = "127.0.0.1:" + str(kwargs["bind"]).rsplit(":", 1)[1]
        return server(**kwargs)

    torchft.manager.ManagerServer = on_loopback


def train() -> None:
    """One replica group of one process: the loop of torchft's ``train_ddp.py`` on the benchmark's model."""
    from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    _bind_manager_to_loopback()
    group = int(os.environ["REPLICA_GROUP"])
    model, inner_optimizer, data = build()
    with open(os.path.join(OUT, f"ready.{os.getpid()}"), "w") as handle:
        handle.write(str(time.time()))  # the Manager heartbeats to the Lighthouse: nothing before concerns the others
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    manager = Manager(
        pg=pg, min_replica_size=1, replica_id=f"bench_live_{group}", lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        hostname="127.0.0.1", timeout=TIMEOUT, quorum_timeout=timedelta(seconds=60), connect_timeout=TIMEOUT,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       inner_optimizer.load_state_dict(state["optimizer"])),
        state_dict=lambda: {"model": model.state_dict(), "optimizer": inner_optimizer.state_dict()},
        checkpoint_transport=PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu")))
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner_optimizer)
    sampler = DistributedSampler(data, replica_rank=group, num_replica_groups=GROUPS, group_rank=0, num_replicas=1,
                                 shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=64 // GROUPS, sampler=sampler)
    steps = 0
    with open(os.path.join(OUT, f"steps.{os.getpid()}.jsonl"), "a") as handle:
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()  # starts the quorum
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                loss.backward()
                committed = manager.current_step()
                optimizer.step()  # steps the optimizer only if every group in the quorum agrees
                handle.write(json.dumps({"time": time.time(), "group": group,
                                         "participants": manager.num_participants(),
                                         "participating": manager.is_participating(),
                                         "committed": manager.current_step() > committed,
                                         "step": manager.current_step()}) + "\n")
                handle.flush()
                steps += 1
                if steps >= STEPS:
                    manager.shutdown(wait=False)
                    return


if __name__ == "__main__":
    if sys.argv[1:] == ["lighthouse"]:
        lighthouse()
    else:
        try:
            train()
        except Exception:
            with open(os.path.join(OUT, f"error.{os.getpid()}.txt"), "w") as handle:
                handle.write(traceback.format_exc())
            raise
