"""The device-side record of one measured optimizer step.

The hooks (:mod:`adaptive.batchsize.gns._probe`, :mod:`adaptive.batchsize.gns._sharded`)
leave each measured step's per-group squared norms on the device, with the
all-reduce that combines the replicas still in flight; the estimator reads
them (one wait, one copy of a few floats to the host) when it folds the step
into its averages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from adaptive.goodput.noise_estimate import BatchConfig, Measurement
from adaptive.runtime import collectives

__all__ = ["StepRecord"]


@dataclass
class StepRecord:
    """Device-side measurements of one optimizer step, read at flush time."""

    estimator: str
    config: BatchConfig
    count: int
    big: torch.Tensor
    votes: torch.Tensor  # the replicas' votes for the next interval, summed by the all-reduce (one element)
    local: torch.Tensor | None = None
    work: dist.Work | None = None  # the all-reduce combining the replicas' sums, until it is waited for
    scale: torch.Tensor | None = None
    prev: torch.Tensor | None = None
    prev_scale: torch.Tensor | None = None
    cross: torch.Tensor | None = None
    step: int = 0  # the optimizer step measured (counted by the probe)
    span: int = 1  # optimizer steps the measurement stands for (since the previous one)
    voters: int = 1  # the replicas whose votes are summed

    def read(self) -> tuple[Measurement, float]:
        """The measurement on the host and the summed votes: waits for the all-reduce, then one copy."""
        if self.work is not None:  # in live mode a lost peer another member reported ends the wait too
            collectives.wait(self.work, "the noise-scale all-reduce")
        parts = [self.big, self.local, self.prev, self.cross, self.scale, self.prev_scale, self.votes]
        device = self.big.device
        present = [p.reshape(-1).to(device, torch.float32) for p in parts if p is not None]
        values = iter(np.split(torch.cat(present).double().cpu().numpy(),
                               np.cumsum([p.numel() for p in present])[:-1]))
        big, local, prev, cross, scale, prev_scale, votes = (next(values) if p is not None else None
                                                              for p in parts)
        assert big is not None and votes is not None, "big and votes are tensors: their values are present"
        measurement = Measurement(self.estimator, self.config, self.count, big, local=local, prev=prev, cross=cross,
                                  scale=float(scale[0]) if scale is not None else None,
                                  prev_scale=float(prev_scale[0]) if prev_scale is not None else None)
        return measurement, float(votes[0])
