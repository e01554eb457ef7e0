"""Live mode: what one member alone holds of the states, kept off the member so that its loss does not take it.

Every member of a live job holds the same weights and optimizer state (a
step commits on every member or on none, :mod:`adaptive.runtime.step_commit`),
so a lost member takes nothing of those with it.  Some state is private to
one member though: an :class:`~adaptive.Accumulator`'s increments since its
last ``synchronized()`` count the samples that member trained, and those
steps are not trained again after a loss.  Each state says what it holds
privately (:meth:`adaptive.checkpoint.states.State.private_part`); each
member publishes its parts on the job's store at every committed step when
they changed (:func:`pack`, :mod:`adaptive.elastic.live`), and after a loss
the new rank 0 folds the lost members' parts into its own states
(:func:`adopt`).

A record carries the number of steps its generation had committed
(:func:`adaptive.runtime.step_commit.commits`); a member lost after a
step committed but before it published its parts for that step is one step
behind the others, and a warning says that what it counted in that step is
lost.  Records are read weights-only (guarantee G4): a process that writes
to the store cannot make a member run code.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from adaptive.checkpoint import _flat_state, states

__all__ = ["pack", "unpack", "adopt"]

logger = logging.getLogger(__name__)


#: The first byte of a record: JSON (plain numbers and strings, the usual metrics: about 10x faster to write
#: than the other), or the hand-over's flat format (tensors, arrays, keys that are not strings).
_JSON, _FLAT = b"J", b"F"


def pack(parts: dict[str, object], generation: int, commits: int) -> bytes:
    """The record of a member's private ``parts`` (state name -> part) after ``commits`` committed steps of
    live ``generation``."""
    record = {"generation": generation, "commits": commits, "parts": parts}
    if _is_plain(record):
        return _JSON + json.dumps(record).encode()
    return _FLAT + _flat_state.pack(record).numpy().tobytes()


def _is_plain(value: object) -> bool:
    """Whether ``value`` goes through JSON unchanged: str-keyed dicts, lists, str, int, float, None."""
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_plain(item) for key, item in value.items())
    if isinstance(value, list):
        return all(_is_plain(item) for item in value)
    return value is None or type(value) in (str, int, float)


def unpack(raw: bytes) -> tuple[dict[str, object], int, int]:
    """``(parts, generation, commits)`` from a :func:`pack` record."""
    kind, body = raw[:1], raw[1:]
    if kind == _JSON:
        record: Any = json.loads(body)
    elif kind == _FLAT:
        record = _flat_state.unpack(torch.frombuffer(bytearray(body), dtype=torch.uint8), "a member's private state")
    else:
        raise ValueError(f"a member's private state record of unknown kind {kind!r}")
    if not isinstance(record, dict) or not isinstance(record.get("parts"), dict):
        raise ValueError("a member's private state record is not a dict of parts")
    return record["parts"], int(record["generation"]), int(record["commits"])


def adopt(records: dict[int, bytes], generation: int, commits: int) -> None:
    """Fold the lost workers' ``records`` (worker id -> its last :func:`pack` record) into this process's
    states; they were lost in ``generation``, which had committed ``commits`` steps."""
    registered = {state.name: state for state in states.registered_states()}
    for worker, raw in sorted(records.items()):
        try:
            parts, published_in, published_at = unpack(raw)
        except (ValueError, RuntimeError) as error:
            logger.warning("worker %d's private state on the store cannot be read (%s); what it alone counted is "
                           "lost with it", worker, error)
            continue
        missed = commits - published_at if published_in == generation else commits
        if missed > 0:
            logger.warning("worker %d was lost %d optimizer step(s) after it last published its private state; what "
                           "it alone counted in those steps (its Accumulator increments) is lost with it", worker,
                           missed)
        for name, part in parts.items():
            state = registered.get(name)
            if state is None:
                logger.warning("worker %d's private part of state %r has no such state here; dropped", worker, name)
                continue
            state.adopt_private_part(part, worker)
        logger.info("folded in what lost worker %d alone held (%s)", worker, ", ".join(map(repr, parts)) or "nothing")
