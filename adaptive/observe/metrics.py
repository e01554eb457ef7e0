"""What a job reports about itself: a JSON-lines file, and TensorBoard scalars.

Rank 0 appends to ``<ADAPTIVE_SHARE_PATH>/metrics.jsonl``.  Two kinds of
lines, both with ``time`` (unix seconds) and ``pid`` (which process, so a
reader can tell restarts apart):

* step records, every ``ADAPTIVE_METRICS_INTERVAL`` optimizer steps (default
  10): ``step``, ``epoch``, ``replicas``, ``nodes``, ``batch_size`` (global),
  ``local_bsz``, ``accum_steps``, ``noise_scale``, ``gain``, ``lr_factor``,
  ``progress`` (scale-invariant: sum of gains), ``samples_per_sec``,
  ``goodput`` (samples/s x statistical efficiency; null until known);
* events, with an ``event`` key: ``start`` (what was resumed),
  ``batch_size`` (a decision, with the goodput before and after),
  ``checkpoint``.

``adaptive report RUN_DIR`` draws these; :func:`to_tensorboard` writes the
same scalars to a ``torch.utils.tensorboard.SummaryWriter``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Protocol

from adaptive._utils.types import JSON
from adaptive.runtime import env

__all__ = ["MetricsWriter", "ScalarWriter", "metrics_path", "metrics_interval", "read_metrics", "to_tensorboard",
           "tensorboard_prefix", "DEFAULT_TAG_PREFIX", "SCALARS"]

logger = logging.getLogger(__name__)

#: Step-record fields that are numbers worth plotting.
SCALARS = ("batch_size", "local_bsz", "accum_steps", "replicas", "noise_scale", "gain", "lr_factor",
           "progress", "samples_per_sec", "goodput", "tokens_per_sec", "step_lr_factor", "padding_efficiency")

#: The TensorBoard tag group when no ``tag_prefix`` is given.
DEFAULT_TAG_PREFIX = "adaptive/"


def metrics_path() -> str:
    """Where this job's metrics go."""
    return os.path.join(env.share_path(), "metrics.jsonl")


def metrics_interval() -> int:
    """Optimizer steps between step records (``ADAPTIVE_METRICS_INTERVAL``, default 10; 0 = off)."""
    return env.metrics_interval()


class ScalarWriter(Protocol):
    """What :func:`to_tensorboard` writes to: a TensorBoard ``SummaryWriter`` or anything with its ``add_scalar``."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> object:
        """Record ``scalar_value`` under ``tag`` at ``global_step``."""


def _clean(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends records to the metrics file on rank 0; does nothing elsewhere."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or metrics_path()
        self.enabled = env.rank() == 0
        self._warned = False

    def write(self, record: JSON) -> None:
        """Append one record (adds ``time`` and ``pid``)."""
        if not self.enabled:
            return
        line = {"time": time.time(), "pid": os.getpid(), **{k: _clean(v) for k, v in record.items()}}
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as error:
            if not self._warned:
                logger.warning("cannot write metrics to %s (%s); set ADAPTIVE_SHARE_PATH to a writable folder",
                               self.path, error)
                self._warned = True

    def event(self, name: str, **fields: object) -> None:
        """Append an event record."""
        self.write({"event": name, **fields})


def read_metrics(path: str) -> tuple[list[JSON], list[JSON]]:
    """(step records, events) of a metrics file or of a folder holding ``metrics.jsonl``.

    Lines that do not parse (a line cut by a crash) are skipped.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics file at {path}; point at a job's ADAPTIVE_SHARE_PATH")
    steps: list[JSON] = []
    events: list[JSON] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            (events if "event" in record else steps).append(record)
    return steps, events


def tensorboard_prefix(tag_prefix: str = "") -> str:
    """The start of every TensorBoard tag written with ``tag_prefix``.

    ``""`` (the default) gives ``"adaptive/"``; any other prefix replaces it,
    with a ``/`` appended when missing (as AdaptDL did), so
    ``tag_prefix="AdaptDL/Data/"`` or ``"AdaptDL/Data"`` writes
    ``AdaptDL/Data/batch_size``.

    Raises:
        TypeError: ``tag_prefix`` is not a str.
    """
    if not isinstance(tag_prefix, str):
        raise TypeError(f"tag_prefix must be a str, got {type(tag_prefix).__name__}")
    if not tag_prefix:
        return DEFAULT_TAG_PREFIX
    return tag_prefix if tag_prefix.endswith("/") else tag_prefix + "/"


def to_tensorboard(writer: ScalarWriter, record: JSON, step: int | None = None, *, tag_prefix: str = "") -> None:
    """Write a step record's scalars (the fields in :data:`SCALARS`) to a TensorBoard ``SummaryWriter``.

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (anything with ``add_scalar``).
        record: a step record (as in the metrics file).
        step: the TensorBoard step; default the record's ``step``.
        tag_prefix: tags are ``<tag_prefix><field>``; default ``adaptive/<field>``
            (see :func:`tensorboard_prefix`).
    """
    prefix = tensorboard_prefix(tag_prefix)
    step = record.get("step") if step is None else step
    for key in SCALARS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            writer.add_scalar(f"{prefix}{key}", value, step)
