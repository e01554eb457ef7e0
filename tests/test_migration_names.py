"""The AdaptDL names that docs/migration-adaptdl.md maps exist here and work.

* ``to_tensorboard(writer, step, tag_prefix=...)`` on the loader and the
  model, read back from a real TensorBoard event file;
* AdaptDL's gradient-statistics read-out (``adaptdl.torch._metrics``) and
  what replaces it (``model.gns``, ``model.scaling_rule.progress``, the
  hints file);
* ``adaptdl.get_tensorboard_dir()`` / ``ADAPTDL_TENSORBOARD_LOGDIR`` and
  ``adaptive.env.tensorboard_path()``;
* every ``adaptive.*`` name and every ``loader.``/``model.`` attribute the
  migration doc's table gives resolves.
"""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path

import pytest
import torch

import adaptive
from adaptive.runtime import env
from adaptive.goodput import read_hints
from adaptive.observe import metrics

REPO = Path(__file__).resolve().parent.parent
MIGRATION = REPO / "docs" / "migration-adaptdl.md"


class Recorder:
    """Stands in for a SummaryWriter: remembers add_scalar calls."""

    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[tag] = (value, step)


class Regression(torch.utils.data.Dataset):
    def __init__(self, n: int = 256) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.3 * torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def train(epochs: int = 2, *, autoscale: bool = False, name: str = "model"):
    """A tiny linear regression trained long enough for a noise-scale estimate."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    model = adaptive.AdaptiveDataParallel(net, optimizer, name=name, gns_interval=1)
    loader = adaptive.AdaptiveDataLoader(Regression(), batch_size=16, shuffle=True, name=f"{name}-data")
    if autoscale:
        loader.autoscale_batch_size(64, local_bsz_bounds=(8, 64), adapt_every=4)
    for _ in adaptive.remaining_epochs_until(epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model, loader


# ---------------------------------------------------------------------- tag prefix


@pytest.mark.parametrize("given, expected", [("", "adaptive/"), ("AdaptDL/Data/", "AdaptDL/Data/"),
                                             ("AdaptDL/Model", "AdaptDL/Model/"), ("x", "x/")])
def test_tensorboard_prefix(given, expected):
    assert metrics.tensorboard_prefix(given) == expected


def test_tensorboard_prefix_must_be_a_string():
    with pytest.raises(TypeError, match="tag_prefix must be a str"):
        metrics.tensorboard_prefix(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tag_prefix"):
        metrics.to_tensorboard(Recorder(), {"batch_size": 3}, 1, tag_prefix=7)  # type: ignore[arg-type]


def test_metrics_to_tensorboard_keeps_its_tags_and_takes_a_prefix():
    record = {"step": 40, "batch_size": 64, "local_bsz": 32, "accum_steps": 1, "replicas": 2, "gain": 1.5,
              "noise_scale": float("nan"), "goodput": None, "loader": "0", "epoch": 3}
    default, prefixed = Recorder(), Recorder()
    metrics.to_tensorboard(default, record)
    metrics.to_tensorboard(prefixed, record, 3, tag_prefix="AdaptDL/Data")
    numbers = {"batch_size": 64, "local_bsz": 32, "accum_steps": 1, "replicas": 2, "gain": 1.5}
    assert default.scalars == {f"adaptive/{key}": (value, 40) for key, value in numbers.items()}
    assert prefixed.scalars == {f"AdaptDL/Data/{key}": (value, 3) for key, value in numbers.items()}


def read_event_tags(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the TensorBoard event files under ``folder``: [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_loader_and_model_to_tensorboard_with_adaptdls_prefixes_in_a_real_event_file(job):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from torch.utils.tensorboard import SummaryWriter

    model, loader = train()
    assert model.gns.to_grad_params() is not None, "the test needs a noise-scale estimate"
    folder = job / "tensorboard"
    with SummaryWriter(str(folder)) as writer:
        # as AdaptDL's pytorch-cifar example does, once per epoch
        loader.to_tensorboard(writer, 1, tag_prefix="AdaptDL/Data/")
        model.to_tensorboard(writer, 1, tag_prefix="AdaptDL/Model/")
        # and without a prefix: today's tags, the loader's own step by default
        loader.to_tensorboard(writer)
        model.to_tensorboard(writer, loader.step)
    tags = read_event_tags(folder)

    loader_fields = {"batch_size", "local_bsz", "accum_steps", "replicas", "noise_scale", "gain", "lr_factor",
                     "progress", "samples_per_sec", "goodput", "step_lr_factor"}
    model_fields = {"noise_scale", "grad_sqr", "grad_var", "gain", "lr_factor", "progress"}
    expected = ({f"AdaptDL/Data/{key}" for key in loader_fields} | {f"AdaptDL/Model/{key}" for key in model_fields}
                | {f"adaptive/{key}" for key in loader_fields | model_fields})
    missing = expected - set(tags)
    assert not missing, f"tags not written: {sorted(missing)}"
    assert set(tags) <= expected | {f"AdaptDL/Data/{key}" for key in metrics.SCALARS} | \
        {f"adaptive/{key}" for key in metrics.SCALARS}
    assert tags["AdaptDL/Data/batch_size"] == [(1, 16.0)]
    assert tags["AdaptDL/Data/local_bsz"] == [(1, 16.0)] and tags["AdaptDL/Data/accum_steps"] == [(1, 1.0)]
    assert tags["AdaptDL/Model/grad_sqr"][0][1] == pytest.approx(model.gns.sqr_avg(), rel=1e-6)
    assert tags["AdaptDL/Model/grad_var"][0][1] == pytest.approx(model.gns.var_avg(), rel=1e-6)
    assert tags["AdaptDL/Model/progress"][0][1] == pytest.approx(model.scaling_rule.progress, rel=1e-6)
    # no prefix: both write under adaptive/ at the loader's step
    assert [step for step, _ in tags["adaptive/batch_size"]] == [loader.step]
    assert [step for step, _ in tags["adaptive/grad_sqr"]] == [loader.step]


def test_model_to_tensorboard_before_any_estimate_writes_no_noise(job):
    net = torch.nn.Linear(2, 1)
    model = adaptive.AdaptiveDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1))
    writer = Recorder()
    model.to_tensorboard(writer, 0, tag_prefix="AdaptDL/Model/")
    assert writer.scalars == {"AdaptDL/Model/gain": (1.0, 0), "AdaptDL/Model/lr_factor": (1.0, 0),
                              "AdaptDL/Model/progress": (0.0, 0)}


# ---------------------------------------------------------------------- the statistics read-out


def test_gradient_statistics_read_out_replaces_adaptdls_metrics_state(job):
    """``adaptdl.torch._metrics._metrics_state().grad_params`` and ``get_progress()`` (DCGAN)."""
    model, loader = train(autoscale=True)
    grad = model.gns.to_grad_params()
    assert grad is not None
    # grad_params[0] (the squared gradient norm) and grad_params[1] (the variance)
    assert (grad.sqr, grad.var) == (model.gns.sqr_avg(), model.gns.var_avg())
    assert grad.sqr > 0 and grad.var > 0
    assert math.isfinite(model.gns.noise_scale()) and model.gns.noise_scale() > 0
    # get_progress(): scale-invariant steps; at the initial batch size each step counts about one
    assert 0 < model.scaling_rule.progress <= loader.step * 1.0001 * max(1.0, loader.batch_size / 16)
    # get_goodput_fn() and the perf params: the hints file rank 0 writes while autoscaling
    written = read_hints(env.checkpoint_path())
    assert written.grad_params is not None and written.init_batch_size == 16
    assert written.completed_fraction is not None and 0 <= written.completed_fraction <= 1  # of the 2 epochs
    function = written.goodput_function()
    assert function is None or function.evaluate(1, 1, 16, 1) > 0


def test_two_models_trained_in_one_loop_are_each_measured(job):
    """DCGAN: netD and netG step in the same loader loop.

    AdaptDL summed the statistics of every AdaptiveDataParallel into one
    ``grad_params``; here each model has its own (sum them yourself).
    """
    torch.manual_seed(0)
    nets = [torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)]
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.05) for net in nets]
    models = [adaptive.AdaptiveDataParallel(net, optimizer, name=name, gns_interval=1)
              for net, optimizer, name in zip(nets, optimizers, ("netD", "netG"))]
    loader = adaptive.AdaptiveDataLoader(Regression(), batch_size=16, shuffle=True)
    for _ in adaptive.remaining_epochs_until(2):
        for x, y in loader:
            for model, optimizer in zip(models, optimizers):
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    assert models[0].gns is not models[1].gns
    grads = [model.gns.to_grad_params() for model in models]
    assert all(grad is not None and grad.sqr > 0 for grad in grads), grads


# ---------------------------------------------------------------------- the TensorBoard folder


def test_tensorboard_path_defaults_to_the_share_path(job, monkeypatch):
    monkeypatch.delenv("ADAPTIVE_TENSORBOARD_PATH", raising=False)
    monkeypatch.setenv("ADAPTIVE_SHARE_PATH", str(job / "share"))
    assert env.tensorboard_path() == str(job / "share" / "tensorboard")
    monkeypatch.chdir(job)
    monkeypatch.setenv("ADAPTIVE_TENSORBOARD_PATH", "tb/run1")
    assert env.tensorboard_path() == str(job / "tb" / "run1")
    monkeypatch.delenv("ADAPTIVE_SHARE_PATH")
    monkeypatch.delenv("ADAPTIVE_TENSORBOARD_PATH")
    monkeypatch.setenv("ADAPTIVE_JOB_ID", "dcgan")
    assert env.tensorboard_path() == str(job / ".adaptive" / "dcgan" / "share" / "tensorboard")
    assert not (job / ".adaptive").exists(), "asking for the path creates nothing"


def test_a_summary_writer_on_tensorboard_path_writes_there(job, monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from torch.utils.tensorboard import SummaryWriter

    monkeypatch.setenv("ADAPTIVE_TENSORBOARD_PATH", str(job / "tb"))
    with SummaryWriter(env.tensorboard_path()) as writer:  # DCGAN: SummaryWriter(adaptdl.get_tensorboard_dir())
        writer.add_scalar("Loss/G", 0.5, 0)
    assert read_event_tags(job / "tb") == {"Loss/G": [(0, 0.5)]}


# ---------------------------------------------------------------------- the migration doc


def _here_column_spans() -> list[str]:
    """Code spans of the "here" column of the migration doc's name table."""
    spans = []
    for line in MIGRATION.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not set(cells[1]) <= {"-", " "}:
            spans.extend(re.findall(r"`([^`]+)`", cells[1]))
    return spans


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(dotted)


def test_every_adaptive_name_in_the_migration_doc_exists():
    spans = _here_column_spans()
    assert len(spans) > 40, "the name table was not found"
    text = MIGRATION.read_text(encoding="utf-8")
    code = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    code += re.findall(r"^```.*?^```", text, flags=re.M | re.S)
    names = {match for span in code for match in re.findall(r"\badaptive(?:\.\w+)+", span)}
    assert {"adaptive.env.tensorboard_path", "adaptive.env.checkpoint_path", "adaptive.goodput.read_hints"} <= names
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"docs/migration-adaptdl.md maps to names that do not exist: {missing}"


def test_every_loader_and_model_attribute_in_the_migration_table_exists(job):
    net = torch.nn.Linear(4, 1)
    model = adaptive.AdaptiveDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1))
    owners = {"loader": adaptive.AdaptiveDataLoader(Regression(), batch_size=8), "model": model,
              "model.gns": model.gns, "model.scaling_rule": model.scaling_rule}
    found = [(owner, attribute) for span in _here_column_spans()
             for owner, attribute in re.findall(r"\b(model\.gns|model\.scaling_rule|loader|model)\.(\w+)", span)]
    assert ("model.gns", "sqr_avg") in found and ("model", "to_tensorboard") in found
    missing = sorted({f"{owner}.{attribute}" for owner, attribute in found
                      if not hasattr(owners[owner], attribute)})
    assert not missing, f"docs/migration-adaptdl.md names attributes that do not exist: {missing}"


def test_dcgans_positional_name_is_a_type_error_that_says_what_to_write(job):
    """docs/migration-adaptdl.md, "Positional arguments of AdaptiveDataParallel"."""
    net = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 15, 0.1)
    with pytest.raises(TypeError, match=r"scaler(.|\n)*name="):
        adaptive.AdaptiveDataParallel(net, optimizer, schedule, "netD")
    model = adaptive.AdaptiveDataParallel(net, optimizer, schedule, name="netD")
    assert model.lr_scheduler is schedule and model.scaler is None
