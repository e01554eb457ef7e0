"""The token planner's saved position: where an epoch's plan stands, for exact resume.

A :class:`TokenPlanState` is checkpointed after every step (the loader keeps
its :meth:`~TokenPlanState.state_dict` in its own state).  It does not
depend on the replica count, so a planner with the same ``window_size`` and
``seed`` resumes from it exactly on any number of replicas (see
:mod:`adaptive.data.tokens.planner`).  Saved states carry a ``version``
and are read through :class:`adaptive.checkpoint.versions.Format`.  Pure
Python (no torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from adaptive._utils.checks import check_bool, check_int
from adaptive.checkpoint.versions import Format, StateFormatError

__all__ = ["DEFAULT_WINDOW_SIZE", "TokenPlanState"]

#: Stream positions sorted together by default (a sample count, the same on any number of replicas).
DEFAULT_WINDOW_SIZE = 16384

_WHAT = "token plan state"
#: Version 1 is the format of release 0.1, which already wrote ``"version": 1``.
_FORMAT = Format(_WHAT, version=1)
_INT_FIELDS = (
    "epoch", "window", "batches_done", "packed_max_tokens", "steps_done", "samples_done",
    "tokens_done", "skipped_done", "padding_done", "window_size", "seed", "num_samples",
)  # fmt: skip


class TokenPlanState(NamedTuple):
    """Where an epoch's token-budget plan stands; checkpoint it after each step.

    Plain ints, bools and a list of ints (:meth:`state_dict`), independent of
    the replica count: any planner with the same ``window_size`` and ``seed``
    resumes from it exactly (see :mod:`adaptive.data.tokens.planner`).

    Fields: ``window`` is the first window not finished; ``batches_done`` the
    micro-batches of its current packing already consumed; ``packed_max_tokens``
    the budget of that packing (0: not packed yet, its skipped samples not
    reported); ``excluded`` window offsets left out of that packing because
    they were consumed or skipped under an earlier budget. The ``*_done``
    counters are totals for the epoch so far (``steps_done`` depends on the
    replica history, the others do not).

    A named tuple: immutable and cheap to create once per step.
    """

    epoch: int = 0
    window: int = 0
    batches_done: int = 0
    packed_max_tokens: int = 0
    excluded: tuple[int, ...] = ()
    steps_done: int = 0
    samples_done: int = 0
    tokens_done: int = 0
    skipped_done: int = 0
    padding_done: int = 0
    finished: bool = False
    window_size: int = DEFAULT_WINDOW_SIZE
    seed: int = 0
    num_samples: int = -1  # length of the index stream, -1 if unknown (iterator streams)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python snapshot (JSON-serialisable, safe for ``torch.load(weights_only=True)``)."""
        out: dict[str, Any] = {"version": _FORMAT.version, **self._asdict()}
        out["excluded"] = list(self.excluded)
        return out

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> TokenPlanState:
        """Validate and rebuild a state saved by :meth:`state_dict` (any readable version).

        Raises:
            TypeError: ``state`` is not a mapping, or a value has the wrong type.
            StateFormatError: no ``version``, or one newer than this release reads.
            ValueError: missing or unknown keys, values out of range, or an
                inconsistent position.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"{_WHAT} must be a mapping, got {type(state).__name__}")
        if "version" not in state:
            raise StateFormatError(
                f"{_WHAT} has no 'version' key; was it written by TokenPlanState.state_dict()?"
            )
        state = _FORMAT.read(state)
        expected = set(cls._fields)
        missing, unknown = expected - set(state), set(state) - expected
        if missing or unknown:
            raise ValueError(
                f"{_WHAT} has missing keys {sorted(missing)} and unknown keys "
                f"{sorted(unknown)}; was it written by TokenPlanState.state_dict()?"
            )
        values: dict[str, Any] = {}
        for name in _INT_FIELDS:
            minimum = -1 if name == "num_samples" else (1 if name == "window_size" else 0)
            values[name] = check_int(f"state[{name!r}]", state[name], minimum)
        values["finished"] = check_bool("state['finished']", state["finished"])
        values["excluded"] = _check_excluded(state["excluded"], values["window_size"])
        result = cls(**values)
        if result.packed_max_tokens == 0 and (result.batches_done or result.excluded):
            raise ValueError(
                f"{_WHAT} is inconsistent: batches_done and excluded must be empty "
                "when packed_max_tokens is 0"
            )
        return result


def _check_excluded(excluded: object, window_size: int) -> tuple[int, ...]:
    """The saved ``excluded`` offsets: a strictly increasing list of offsets within a window."""
    if not isinstance(excluded, (list, tuple)):
        raise TypeError(f"state['excluded'] must be a list of ints, got {type(excluded).__name__}")
    out = tuple(check_int("state['excluded'] entry", v, 0, window_size - 1) for v in excluded)
    if any(a >= b for a, b in zip(out, out[1:])):
        raise ValueError("state['excluded'] must be strictly increasing window offsets")
    return out
