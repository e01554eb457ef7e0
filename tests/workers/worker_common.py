"""Pieces shared by the multi-process test workers (imported next to them)."""

import json
import os

import torch


class StepCountingLinear(torch.nn.Module):
    """A linear model that also carries, in its checkpointed state, how many
    optimizer steps it has taken: tests compare it with the loader's step."""

    def __init__(self, in_features: int, squeeze: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, 1)
        self.squeeze = squeeze
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        out = self.linear(x)
        return out.squeeze(-1) if self.squeeze else out


def write_json(path, payload):
    """Replace ``path`` atomically (tests poll these files while workers run)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def append_jsonl(path, record):
    """Append one JSON line to ``path``."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
