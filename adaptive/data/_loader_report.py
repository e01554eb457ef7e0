"""What a loader reports as it trains: progress lines, batch-size decisions and metrics records.

One :class:`LoaderReport` per :class:`~adaptive.AdaptiveDataLoader`.  It
times the steps (:class:`~adaptive.data._loop.StepTiming`), sums the steps'
sizes over a metrics interval, writes a record to the metrics file every
``ADAPTIVE_METRICS_INTERVAL`` steps, and logs a progress line every
``ADAPTIVE_PROGRESS_INTERVAL`` seconds on rank 0.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from adaptive._utils.text import format_duration
from adaptive.batchsize.autoscale import Decision
from adaptive.data._loop import IntervalStats, StepTiming
from adaptive.runtime import env
from adaptive.elastic import epoch
from adaptive.observe import metrics

__all__ = ["LoaderReport"]

logger = logging.getLogger("adaptive.data.dataloader")  # the loader's own lines, under the loader's logger


class LoaderReport:
    """Reporting for one loader (``loader``: its public read-outs are what is reported)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.timing = StepTiming()
        self.interval = IntervalStats()
        self.writer = metrics.MetricsWriter()
        self._progress_logged = time.monotonic()

    def step_taken(self, model: Any, index: int, init_batch_size: int) -> None:
        """After each training step: a metrics record when the interval is due, a progress line when due."""
        every = metrics.metrics_interval()
        if every and self.loader.step % every == 0:
            self.writer.write(self.record(model, init_batch_size))
            self.interval = IntervalStats()
        if env.rank() == 0:
            self._progress(index)

    def _progress(self, index: int) -> None:
        """A progress line every ``ADAPTIVE_PROGRESS_INTERVAL`` seconds (default 30; 0 = off)."""
        every = env.progress_interval()
        now = time.monotonic()
        if every <= 0 or now - self._progress_logged < every:
            return
        self._progress_logged = now
        loader = self.loader
        rate = self.timing.per_sec(loader.batch_size)
        line = f"loader {loader.name}: epoch {epoch.current_epoch()}, step {loader.step}"
        if loader.unit == "samples":
            total = loader.sampler.num_samples
            line += f", sample {index} of {total}"
            if rate:
                line += f", {rate:.1f} samples/s, epoch ETA {format_duration((total - index) / rate, clock=True)}"
        elif rate:
            line += f", {rate:.1f} {loader.unit}/s"
        logger.info("%s (batch %d %s)", line, loader.batch_size, loader.unit)

    def decision(self, decision: Decision, local: int, accum: int) -> None:
        """Log and record a batch-size change (sizes per replica in both units)."""
        loader, replicas = self.loader, env.num_replicas()
        before = local * accum * replicas
        after = decision.local_bsz * decision.accum_steps * replicas
        if env.rank() == 0:
            logger.info("batch size changed from %d (local %d x %d steps) to %d (local %d x %d steps) on %d "
                        "replicas because %s (goodput %.1f -> %.1f %s/s-equivalent)",
                        before, local, accum, after, decision.local_bsz, decision.accum_steps, replicas,
                        decision.reason, decision.previous_goodput, decision.goodput, loader.unit)
        self.writer.event("batch_size", loader=loader.name, step=loader.step, before=before, after=after,
                          local_bsz=decision.local_bsz, accum_steps=decision.accum_steps,
                          goodput_before=decision.previous_goodput, goodput_after=decision.goodput,
                          reason=decision.reason, unit=loader.unit)

    def record(self, model: Any, init_batch_size: int) -> dict[str, Any]:
        """The metrics record of the interval just ended (see docs/observability.md for the fields)."""
        loader = self.loader
        rate = self.timing.per_sec(loader.batch_size)
        record: dict[str, Any] = {"loader": loader.name, "step": loader.step, "epoch": epoch.current_epoch(),
                                  "replicas": env.num_replicas(), "nodes": env.num_nodes(),
                                  "batch_size": loader.batch_size, "local_bsz": loader.current_local_bsz,
                                  "accum_steps": loader.accumulation_steps, "unit": loader.unit,
                                  "consumed": loader.consumed, "samples_per_sec": rate}
        record.update(self.interval.fields())
        if loader.unit == "tokens":  # batch_size is in tokens: report both rates from the steps' actual sizes
            record["samples_per_sec"] = self.timing.per_sec(record.get("samples_per_step", 0)) or None
            record["tokens_per_sec"] = self.timing.per_sec(record.get("tokens_per_step", 0)) or None
        if model is not None:
            gns, rule = model.gns, model.scaling_rule
            grad = gns.to_grad_params()
            record.update(noise_scale=gns.noise_scale() if grad is not None else None,
                          gain=rule.last_gain, lr_factor=rule.last_factor, progress=rule.progress,
                          step_lr_factor=model.step_lr.last_factor)
            if grad is not None and rate:
                scale = loader.batch_size / init_batch_size
                record["goodput"] = rate * gns.gain(scale) / max(scale, 1e-12)
        return record
