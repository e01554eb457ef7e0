"""AdaptiveDataLoader: a DataLoader whose position survives restarts and rescales.

It walks one seeded global permutation per epoch (guarantee G2, see
:mod:`adaptive.data.sampler`), cuts it into optimizer steps and gives each
replica its share.  Its position is checkpointed with everything else, so
after any restart or change of replica count the stream continues at the
same sample.

How the stream becomes steps is a batching strategy
(:mod:`adaptive.data.steps`):

* sample batches (:mod:`adaptive.data.sample_batches`): ``batch_size`` global
  samples per step, split evenly across replicas;
* token budgets (:mod:`adaptive.data.tokens.batching`), with ``max_tokens=`` and
  ``lengths=``: every replica's micro-batch holds at most ``max_tokens``
  padded tokens, samples of similar length are grouped, and all replicas
  take the same number of steps and micro-steps.

The global batch may follow a ramp-up schedule in consumed samples or
tokens (``batch_size_schedule=``, see :mod:`adaptive.batchsize.rampup`), and with
:meth:`AdaptiveDataLoader.autoscale_batch_size` the loader chooses the
micro-batch size and the number of gradient-accumulation steps that
maximise goodput (see :mod:`adaptive.batchsize.autoscale`), also in the middle of an
epoch; a schedule then caps autoscale's choice.  An optimizer step may be
made of several micro-batches; the loop stays the ordinary ``zero_grad();
backward(); step()`` loop (see :mod:`adaptive.parallel.data_parallel`).

Exact gradients for uneven steps: multiply each micro-batch's *summed* loss
(over its real tokens, or its samples) by :attr:`AdaptiveDataLoader.loss_weight`
and the step's gradient is the mean over all real tokens (samples) of the
whole step, across replicas and micro-steps, as one process would compute
it.  The learning rate follows the actual size of each step
(``lr_scaling``, see :mod:`adaptive.batchsize.step_lr`).

Loops of a loader are numbered within each epoch (the training loop is
loop 1, a second pass over the same loader would be loop 2).  After a
restart, loops that already finished in the current epoch are skipped (they
yield nothing) and the interrupted loop resumes mid-way (guarantee G5).
Leaving a loop with ``break`` counts as finishing it; every replica must
break at the same step.  The step broken out of counts as taken (its
samples are consumed, :attr:`AdaptiveDataLoader.step` counts it) when the
break comes after its last micro-batch and an optimizer step was taken in
it (a ``--max-steps`` break after ``optimizer.step()``), or after
:func:`adaptive.finish_training`; otherwise (a peek, a break before the
step is trained) it does not.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Iterator

import torch.utils.data

from adaptive.checkpoint import admission, naming, states
from adaptive.elastic import epoch, sync_points
from adaptive.observe import metrics
from adaptive.parallel._training import trained_models
from adaptive.runtime import env
from adaptive.runtime.step import StepContext, stream
from adaptive.batchsize.autoscale import AutoscaleConfig, BatchSizeController
from adaptive.batchsize.rampup import BatchSizeSchedule
from adaptive.batchsize.rampup_specs import describe
from adaptive.data._loader_options import (check_sample_accumulation, check_token_options, dataset_length,
                                           options_of, refuse_token_options, refuse_unsupported, unit_schedule)
from adaptive.data._loader_state import LoaderState
from adaptive.data._loader_report import LoaderReport
from adaptive.data._loop import LocalBatches
from adaptive.data._pass import LoaderPass, running_loader, running_loop
from adaptive.data._workers import ShieldedWorkerInit
from adaptive.data.sample_batches import SampleBatching
from adaptive._utils.checks import check_choice, check_int
from adaptive.data.sampler import ElasticSampler
from adaptive.batchsize.step_lr import LR_SCALING, lr_factor_of
from adaptive.data.steps import Batching, PlannedStep, StepShape, StepSizer
from adaptive.data.weighting import AVERAGE_BY
from adaptive.data.tokens.plan_state import DEFAULT_WINDOW_SIZE
from adaptive.data.tokens.planner import ON_OVERSIZE
from adaptive.data.tokens.batching import TokenBatching, check_lengths

__all__ = ["AdaptiveDataLoader", "current_dataloader"]

logger = logging.getLogger(__name__)


class AdaptiveDataLoader:
    """An elastic, restartable replacement for ``torch.utils.data.DataLoader``.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: the *global* batch size, summed over all replicas; each
            replica gets an even share (default 1).  With ``max_tokens`` it
            is in tokens: each step holds at most this many padded tokens
            whatever the replica count (default: no global size, each
            replica runs ``accumulation_steps`` micro-batches per step).
            With ``batch_size_schedule`` it is only the reference size the
            learning rate was tuned for (default: the schedule's final size).
        shuffle: visit the samples in a seeded random order each epoch.
        seed: seed of the shuffling; the order depends only on (seed, epoch).
        drop_last: drop the final step of an epoch if it is smaller than
            ``batch_size`` (otherwise it is kept; if fewer samples remain
            than replicas, fewer than ``replicas`` samples are repeated).
            Sample batches only.
        name: checkpoint name; default the creation order: ``"0"``, ``"1"``,
            ... for loaders created before the epoch loop, ``"e3.0"``, ...
            for loaders created inside epoch 3 (those belong to their epoch,
            see :mod:`adaptive.checkpoint.states`).
        max_tokens: turn on token-budget batches: the most padded tokens
            (longest sample x samples) one replica's micro-batch may hold.
        lengths: with ``max_tokens``, the token count of every sample: a
            list/array indexed by sample index, or a function index -> length.
        accumulation_steps: micro-batches per optimizer step.  With
            ``max_tokens`` and no global ``batch_size``: per replica, each of
            at most ``max_tokens``.  With sample batches: each step's
            ``batch_size`` global samples are ``accumulation_steps``
            micro-batches of ``batch_size / accumulation_steps`` samples
            (summed over replicas), which ``batch_size`` must be a multiple
            of (not with ``batch_size_schedule``; autoscale, once on,
            chooses the micro-steps itself).  With ``drop_last`` a last
            micro-batch smaller than that is dropped.  Default 1.
        window_size: with ``max_tokens``, stream positions sorted by length
            together (more: less padding); fixed for the whole job.
        on_oversize: with ``max_tokens``, what to do with a sample longer
            than the budget: ``"error"`` or ``"skip"`` (logged, counted).
        average_by: what :attr:`loss_weight` averages the step's gradient
            over: ``"tokens"`` (default with ``max_tokens``) or ``"samples"``.
        lr_scaling: how the LR follows each step's actual size relative to
            the size its shape stands for: ``"linear"``, ``"sqrt"``,
            ``"none"`` or ``"auto"`` (the family of the model's scaling
            rule); see :mod:`adaptive.batchsize.step_lr`.
        batch_size_schedule: a ramp-up of the global batch in consumed
            samples (tokens with ``max_tokens``): ``"0:64 200K:128 1M:256"``,
            a :class:`~adaptive.batchsize.rampup.BatchSizeSchedule` such as
            :class:`~adaptive.batchsize.rampup.LinearRampup`, or its ``spec()``.
        **kwargs: the usual DataLoader arguments (``num_workers``,
            ``collate_fn``, ``pin_memory``, ``timeout``, ``worker_init_fn``,
            ``multiprocessing_context``, ``prefetch_factor``,
            ``persistent_workers``, ``pin_memory_device``, ``in_order``).
            ``sampler``, ``batch_sampler`` and ``generator`` cannot be
            honoured (the order must be the elastic one) and are refused.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[Any],
        batch_size: int | None = None,
        shuffle: bool = False,
        *,
        seed: int = 0,
        drop_last: bool = False,
        name: str | None = None,
        max_tokens: int | None = None,
        lengths: Any = None,
        accumulation_steps: int = 1,
        window_size: int = DEFAULT_WINDOW_SIZE,
        on_oversize: str = "error",
        average_by: str | None = None,
        lr_scaling: str = "auto",
        batch_size_schedule: Any = None,
        **kwargs: Any,
    ) -> None:
        refuse_unsupported(kwargs)
        length = dataset_length(dataset)
        if batch_size is not None:
            check_int("batch_size", batch_size, minimum=1)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        if stream().loop is not None:
            raise RuntimeError("AdaptiveDataLoader created inside another AdaptiveDataLoader loop; "
                               "create loaders before the loops")
        self.dataset = dataset
        self.sampler = ElasticSampler(length, shuffle=shuffle, seed=seed, drop_last=drop_last)
        if name is None:
            name = naming.default_name("dataloader")
        elif not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        self.name = name
        self._lr_scaling = check_choice("lr_scaling", lr_scaling, LR_SCALING)
        unit = "samples" if max_tokens is None else "tokens"
        self._schedule = None if batch_size_schedule is None else unit_schedule(batch_size_schedule, unit)
        if max_tokens is None:
            refuse_token_options(lengths, window_size, on_oversize, average_by)
            check_sample_accumulation(accumulation_steps, batch_size, self._schedule is not None)
            self._batching: Batching = SampleBatching(self.sampler, name)
            self._average_by = "samples"
        else:
            check_token_options(drop_last, accumulation_steps, batch_size is not None or self._schedule is not None)
            self._batching = TokenBatching(self.sampler, check_lengths(lengths, length), max_tokens,
                                           window_size=window_size, seed=seed,
                                           on_oversize=check_choice("on_oversize", on_oversize, ON_OVERSIZE),
                                           name=name)
            self._average_by = check_choice("average_by", average_by or "tokens", AVERAGE_BY)
        self._accumulation_steps = accumulation_steps
        self._global_tokens = max_tokens is not None and batch_size is not None and self._schedule is None
        reference = self._default_reference(batch_size)
        self._batches = LocalBatches()
        self._workers = int(kwargs.get("num_workers") or 0) > 0
        if self._workers:
            kwargs["worker_init_fn"] = ShieldedWorkerInit(kwargs.get("worker_init_fn"))
        # Worker seeds come from a generator of the loader's own, seeded from the position each pass
        # starts at (see _start_plan): creating a pass never draws from torch's global generator, whose
        # state a checkpoint restores (adaptive.elastic.random_state), and worker seeds do not depend on
        # how training got to that position.
        self._worker_seeds = torch.Generator()
        self._inner = torch.utils.data.DataLoader(dataset, batch_sampler=self._batches,
                                                  generator=self._worker_seeds, **kwargs)
        self._loops: collections.Counter[int | None] = collections.Counter()  # loops started per epoch
        self._controller: BatchSizeController | None = None
        self._pass: LoaderPass | None = None  # the pass of a loop running now
        self._report = LoaderReport(self)
        self._timing = self._report.timing
        self._scope_warned = False  # warned that this loader outlived the epoch that owns it
        self._given_batch_size = reference
        self._state = LoaderState(name, reference, naming.epoch_scope(), after_admission=self._follow_restored_size)
        states.load_state(self._state)
        self._follow_restored_size()
        if self._schedule is not None and env.rank() == 0:
            logger.info("loader %s: %s", name, describe(self._schedule))
        sync_points.install_signal_handlers()

    def _follow_restored_size(self) -> None:
        """Size steps from the reference batch size the state holds (the checkpoint's, once restored).

        Called when the loader is built and again when a live joiner restored
        its state at admission, after it was built.
        """
        if self._state.batch_size != self._given_batch_size:  # a joiner or a relaunch with other settings
            logger.warning("loader %s: the checkpointed %s %d overrides the %d given: the job goes on with the "
                           "batch size it was started with (start a new job, with another checkpoint folder, to "
                           "change it)", self.name, "batch size" if self._schedule is None else
                           "reference batch size", self._state.batch_size, self._given_batch_size)
        self._init_batch_size = self._state.batch_size
        self._sizer = self._make_sizer()
        if self._controller is not None:
            self._controller.config = dataclasses.replace(self._controller.config,
                                                          init_batch_size=self._init_batch_size)
            self._follow_controller()

    def _follow_controller(self) -> None:
        """The sizer takes its steps' shape from the autoscale controller."""
        assert self._controller is not None
        self._sizer.autoscale = self._controller.current
        self._sizer.schedule = self._schedule  # only an explicit schedule caps autoscale

    def _default_reference(self, batch_size: int | None) -> int:
        """The reference size (what the LR was tuned for) when no checkpoint says otherwise."""
        if batch_size is not None:
            return batch_size
        if self._schedule is not None:
            return self._schedule.final_batch_size
        return self._batching.default_batch_size(self._accumulation_steps, env.num_replicas())

    def _make_sizer(self) -> StepSizer:
        return self._batching.make_sizer(self._state.batch_size, self._schedule, self._accumulation_steps,
                                         self._global_tokens)

    @classmethod
    def from_dataloader(cls, loader: torch.utils.data.DataLoader[Any], *, shuffle: bool | None = None,
                        seed: int = 0, name: str | None = None) -> "AdaptiveDataLoader":
        """Build from an existing DataLoader, keeping its dataset, batch size and worker settings.

        ``batch_size`` becomes the global batch size.  The order is taken from
        its sampler (``RandomSampler`` means shuffle); other samplers cannot be
        honoured and are refused.
        """
        shuffle, kwargs = options_of(loader, shuffle)
        return cls(loader.dataset, batch_size=loader.batch_size, shuffle=shuffle, seed=seed,
                   drop_last=loader.drop_last, name=name, **kwargs)

    def autoscale_batch_size(self, max_batch_size: int, local_bsz_bounds: tuple[int, int] | None = None,
                             gradient_accumulation: bool = False, *, adapt_every: int = 20,
                             hysteresis: float = 0.05) -> None:
        """Let the loader choose the batch size that trains fastest, while training.

        With ``max_tokens`` every size is in tokens: the goodput model
        chooses the token budget of a micro-batch (within
        ``local_bsz_bounds``, at most ``max_tokens``) and the micro-steps.
        With a ``batch_size_schedule`` the schedule caps the global batch:
        autoscale may choose any size up to the scheduled one, never more.

        Args:
            max_batch_size: the largest global batch size allowed (>= the
                reference ``batch_size``).
            local_bsz_bounds: (lo, hi) per-replica micro-batch sizes that fit
                in memory and keep the device busy; default (1, max_batch_size),
                with ``max_tokens`` (longest sample, max_tokens) ((max_tokens,
                max_tokens) when ``lengths`` is a function).
            gradient_accumulation: allow several micro-batches per optimizer
                step, to reach large global batches with few replicas.
            adapt_every: optimizer steps between decisions.
            hysteresis: only switch when goodput rises by more than this fraction.
        """
        if running_loader() is self:
            raise RuntimeError("call autoscale_batch_size before iterating the loader")
        bounds = self._batching.autoscale_bounds(max_batch_size, local_bsz_bounds)
        config = AutoscaleConfig(self._init_batch_size, max_batch_size, bounds, bool(gradient_accumulation),
                                 adapt_every, hysteresis)
        if self._controller is None:
            self._controller = BatchSizeController(self.name, config, self._state.scope)
        else:
            self._controller.config = config
        self._follow_controller()

    # ------------------------------------------------------------------ properties

    def _next_shape(self) -> StepShape:
        return self._sizer.shape(self._state.consumed, env.num_replicas())

    @property
    def unit(self) -> str:
        """``"samples"``, or ``"tokens"`` with a token budget: the unit of batch sizes and ``consumed``."""
        return self._batching.unit

    @property
    def max_tokens(self) -> int | None:
        """The largest padded-token budget of a micro-batch (None for sample batches)."""
        return self._batching.max_tokens

    @property
    def batch_size(self) -> int:
        """The global batch size of the next optimizer step (summed over replicas and micro-steps).

        In tokens with a token budget (the padded tokens the step may hold).
        """
        shape = self._next_shape()
        return self._sizer.planned_size(shape, env.num_replicas(), shape.accum)

    @property
    def current_local_bsz(self) -> int:
        """This replica's micro-batch size in the next full step (a token budget with ``max_tokens``)."""
        shape = self._next_shape()
        if self._sizer.per_replica:
            return shape.micro
        if self._controller is not None:
            return self._controller.current()[0]
        replicas = env.num_replicas()
        return shape.micro // replicas + (env.rank() < shape.micro % replicas)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self._next_shape().accum

    @property
    def _context(self) -> StepContext | None:
        """The micro-step being trained (None outside the loop)."""
        return None if self._pass is None else self._pass.context

    @property
    def micro_step(self) -> tuple[int, int] | None:
        """(index, count) of the micro-batch being trained on, or None outside the loop."""
        context = self._context
        return None if context is None else (context.micro_step, context.num_micro_steps)

    def is_accumulation_step(self) -> bool:
        """True on micro-batches that are not the last of their optimizer step.

        On those, clip gradients or step a GradScaler only when this is False.
        """
        return self._context is not None and self._context.is_accumulation_step

    @property
    def current_step(self) -> PlannedStep | None:
        """The optimizer step being trained on (sizes, padding, this replica's indices), or None."""
        return None if self._pass is None else self._pass.step_now

    @property
    def loss_weight(self) -> float:
        """Factor for the current micro-batch's *summed* loss (sum over its real tokens, or samples).

        ``(loss_sum * loader.loss_weight).backward()`` on every micro-batch
        makes the optimizer step's gradient the mean over all real tokens
        (``average_by="tokens"``) or samples of the whole step, across
        replicas and micro-steps: the single-process gradient of the same
        samples.  0 on padding micro-batches (``is_padding``).
        """
        if self._context is None:
            raise RuntimeError("loss_weight is defined inside the loader loop only (for the current micro-batch)")
        return self._context.loss_weight

    @property
    def is_padding(self) -> bool:
        """True if the current micro-batch only repeats samples to keep replicas in lock-step."""
        return self._context is not None and self._context.padding

    @property
    def lr_factor(self) -> float:
        """LR factor of the current step for its actual size (``lr_scaling``); 1 outside the loop.

        ``lr_scaling="auto"`` follows the scaling rule of the model wrapper, as
        the wrapper's optimizer hook does when it applies this factor.
        """
        model = trained_models().latest
        return lr_factor_of(self._context, model.scaling_rule if model is not None else None)

    @property
    def consumed(self) -> int:
        """Samples (tokens with a budget) trained by this loader over the whole job; drives ramp-up."""
        return self._state.consumed

    @property
    def schedule(self) -> BatchSizeSchedule | None:
        """The ramp-up schedule of the global batch, if any."""
        return self._schedule

    @property
    def step(self) -> int:
        """Optimizer steps this loader has taken over the whole job, restarts included."""
        return self._state.step

    def to_tensorboard(self, writer: Any, step: int | None = None, *, tag_prefix: str = "") -> None:
        """Write the latest metrics (batch sizes, noise scale, gain, LR factor, throughput, goodput).

        Args:
            writer: a ``torch.utils.tensorboard.SummaryWriter``.
            step: the TensorBoard step; default :attr:`step` (continues across restarts).
            tag_prefix: tags are ``<tag_prefix><field>`` (a ``/`` is appended when
                missing); default ``adaptive/<field>``.  The fields are
                :data:`adaptive.observe.metrics.SCALARS`.
        """
        record = self._report.record(trained_models().latest, self._init_batch_size)
        metrics.to_tensorboard(writer, record, step if step is not None else self._state.step, tag_prefix=tag_prefix)

    def __len__(self) -> int:
        """Micro-batches in a whole epoch at the current batch size (plans the epoch with a token budget)."""
        return self._batching.remaining_micro_steps(self._state, self._sizer, env.num_replicas())

    def __repr__(self) -> str:
        return f"AdaptiveDataLoader(name={self.name!r}, batch_size={self.batch_size}, unit={self.unit!r})"

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        admission.admit()  # live mode: a process that joins a running job becomes a member here, at the latest
        with running_loop(self):
            key = epoch.current_epoch()
            self._warn_if_out_of_scope(key)
            self._loops[key] += 1
            self._pass = LoaderPass(self, key, self._loops[key])
            try:
                yield from self._pass.run()
            finally:
                self._pass = None

    def _warn_if_out_of_scope(self, key: int | None) -> None:
        scope = self._state.scope
        if scope is not None and key != scope and not self._scope_warned:
            self._scope_warned = True
            logger.warning("loader %s was created inside epoch %d and is iterated in epoch %s: objects created "
                           "inside an epoch are checkpointed only until that epoch ends, so its position is not "
                           "saved now; create it before the epoch loop", self.name, scope, key)


def current_dataloader() -> AdaptiveDataLoader | None:
    """The AdaptiveDataLoader whose loop is running now, or None between loops."""
    loader = running_loader()
    return loader if isinstance(loader, AdaptiveDataLoader) else None
