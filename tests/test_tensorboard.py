"""TensorBoard scalars through a real ``SummaryWriter``, read back from the event files.

``tensorboard`` is an extra users install (``pip install -e ".[tensorboard]"``)
and ``requirements-test.txt`` installs it, so these tests do not skip without
it: they fail and say what to install.
"""

from __future__ import annotations

import pytest
import torch

import adaptive
from conftest import restart_process_state


def tensorboard():
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        pytest.fail(f"tensorboard is not installed ({error}): pip install -r requirements-test.txt "
                    '(or pip install -e ".[tensorboard]")', pytrace=False)
    return SummaryWriter, EventAccumulator


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int):
        x = torch.tensor([index / 40.0])
        return x, 3 * x


def _train(logdir, epochs: int, stop_at_step: int | None = None) -> int:
    SummaryWriter, _ = tensorboard()
    torch.manual_seed(0)
    net = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model = adaptive.AdaptiveDataParallel(net, optimizer)
    loader = adaptive.AdaptiveDataLoader(Points(), batch_size=8, shuffle=True)
    writer = SummaryWriter(str(logdir))
    try:
        for _ in adaptive.remaining_epochs_until(epochs):
            for x, y in loader:
                loss = (model(x) - y).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                loader.to_tensorboard(writer)  # step = loader.step, which continues across restarts
                model.to_tensorboard(writer, loader.step)
                if loader.step == stop_at_step:
                    adaptive.request_stop()
    finally:
        writer.close()
    return loader.step


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    _, EventAccumulator = tensorboard()
    found: dict[str, list[tuple[int, float]]] = {}
    for run in sorted(p for p in logdir.iterdir() if p.name.startswith("events.out.tfevents.")):
        events = EventAccumulator(str(run))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
    return found


def test_loader_and_model_scalars_reach_the_event_files_and_continue_across_a_restart(job):
    logdir = job / "tensorboard"
    with pytest.raises(SystemExit):
        _train(logdir, epochs=3, stop_at_step=7)
    restart_process_state()
    last = _train(logdir, epochs=3)
    assert last == 15  # 3 epochs of 5 steps
    scalars = _scalars(logdir)
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2, "one event file per process"
    for tag in ("adaptive/batch_size", "adaptive/local_bsz", "adaptive/replicas", "adaptive/gain",
                "adaptive/lr_factor"):
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
    batch = scalars["adaptive/batch_size"]
    assert sorted(step for step, _ in batch) == list(range(15)), "steps lost or repeated across the restart"
    assert {value for _, value in batch} == {8.0}
    assert {value for _, value in scalars["adaptive/replicas"]} == {1.0}
    assert all(value > 0 for _, value in scalars["adaptive/gain"])
