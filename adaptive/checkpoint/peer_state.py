"""The training state handed from the running members to joiners, over the process group (live mode).

When a live generation admits new members (see
:mod:`adaptive.runtime.membership`), the joiners do not read the checkpoint
on disk: the new rank 0, a member that kept running, serialises every
registered state exactly as a checkpoint would hold it (after each state's
``sync()``, which the old generation ran) and broadcasts it on the control
group; each joiner keeps it as a :class:`PeerCheckpoint`, which its states
restore from as they are created, the way they restore from a checkpoint
after a restart (:func:`adaptive.checkpoint.states.load_state`).  The bytes
are loaded weights-only, like a file (guarantee G4).
"""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adaptive.checkpoint import _safe_load
from adaptive.checkpoint._reading import Checkpoint, CheckpointError, CheckpointInfo
from adaptive.runtime import collectives

__all__ = ["PeerCheckpoint", "send_states", "pass_states", "receive_states"]

logger = logging.getLogger(__name__)

#: Where a :class:`PeerCheckpoint` says it came from (it has no folder).
FROM_PEERS = Path("<peers>")


class PeerCheckpoint(Checkpoint):
    """The states rank 0 sent, in memory, read like a checkpoint (no sharded part)."""

    def __init__(self, info: CheckpointInfo, contents: dict[str, Any]) -> None:
        super().__init__(info, ())
        self._contents = contents

    def __repr__(self) -> str:
        return f"PeerCheckpoint(seq={self.info.seq}, states={len(self._contents)})"

    def names(self) -> list[str]:
        return list(self._contents)

    def __contains__(self, name: object) -> bool:
        return name in self._contents

    def load(self, name: str) -> Any:
        if name not in self._contents:
            raise KeyError(f"the state sent by the running members has no state named {name!r}; it has: "
                           f"{', '.join(map(repr, self._contents)) or 'none'}")
        return self._contents[name]

    def sharded_names(self) -> list[str]:
        return []

    def read_sharded(self, name: str, target: Any) -> Any:
        raise CheckpointError(f"state {name!r} has a sharded part, which is not sent between peers")


def send_states(contents: dict[str, Any], seq: int, metadata: dict[str, Any]) -> int:
    """On the new rank 0: broadcast ``contents`` (state name -> state dict) to the joiners; the bytes sent.

    Collective on the control group: every member calls :func:`send_states`
    (the survivors; only rank 0's arguments are used) or
    :func:`receive_states` (the joiners).
    """
    buffer = io.BytesIO()
    torch.save({"seq": seq, "metadata": metadata, "states": contents}, buffer)
    data = buffer.getbuffer()
    _broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8))
    return len(data)


def pass_states() -> None:
    """On a survivor that is not rank 0: take part in the broadcast and drop what arrives."""
    _broadcast(None)


def receive_states() -> PeerCheckpoint:
    """On a joiner: the states rank 0 broadcast, as a checkpoint to restore from."""
    started = time.perf_counter()
    tensor = _broadcast(None)
    payload = _safe_load.load_item(io.BytesIO(tensor.numpy().tobytes()), "the state sent by the running members")
    info = CheckpointInfo(seq=int(payload["seq"]), path=FROM_PEERS, created=time.time(),
                          metadata=dict(payload["metadata"]), size=int(tensor.numel()))
    logger.info("received the training state from the running members: %d states, %.1f MB in %.3f s",
                len(payload["states"]), tensor.numel() / 1e6, time.perf_counter() - started)
    return PeerCheckpoint(info, dict(payload["states"]))


def _broadcast(tensor: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's ``tensor`` (uint8) on every member of the control group."""
    group = collectives.control_group()
    size = torch.tensor([-1 if tensor is None else tensor.numel()], dtype=torch.int64)
    try:
        dist.broadcast(size, src=0, group=group)
        out = tensor if tensor is not None else torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(out, src=0, group=group)
    except (RuntimeError, dist.DistError) as error:
        raise collectives.CollectiveError(f"handing the training state to the joiners failed: {error}") from error
    return out
