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
backward(); step()`` loop (see :mod:`adaptive.parallel.data_parallel.data_parallel`).

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
break at the same step.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import signal
import time
from typing import Any, Iterator

import torch.utils.data

from adaptive.checkpoint import states
from adaptive.elastic import dataloader_context
from adaptive.elastic import env
from adaptive.elastic import epoch
from adaptive.observe import metrics
from adaptive.parallel import data_parallel
from adaptive.elastic import sync_points
from adaptive.batchsize.autoscale import AutoscaleConfig, BatchSizeController, Decision
from adaptive.batchsize.rampup import BatchSizeSchedule, ConstantSchedule, describe, make_schedule
from adaptive.data.sample_batches import SampleBatching
from adaptive.data.sampler import ElasticSampler
from adaptive.batchsize.step_lr import LR_SCALING, resolve_lr_scaling
from adaptive.data.steps import Batching, PlannedStep, StepShape, StepSizer, loss_weight
from adaptive.data.tokens.planner import AVERAGE_BY, DEFAULT_WINDOW_SIZE, ON_OVERSIZE, step_lr_factor
from adaptive.data.tokens.batching import TokenBatching, check_lengths

__all__ = ["AdaptiveDataLoader"]

logger = logging.getLogger(__name__)

#: DataLoader arguments passed through unchanged to the loader that fetches local batches.
_PASSTHROUGH = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


class _AdaptiveDataLoaderState(states.State):
    """Where a loader is: the loop in progress, its position, samples (tokens) consumed, finished loops."""

    def __init__(self, name: str, batch_size: int, scope: int | None) -> None:
        super().__init__(name, scope=scope)
        self.epoch: int | None = None  # epoch of the loop in progress (None: outside epochs)
        self.loop = 0  # which loop of this loader in that epoch (1-based; 0: none yet)
        self.index = 0  # global samples consumed (or skipped) by that loop
        self.finished: dict[int | None, int] = {}  # epoch -> last finished loop
        self.step = 0  # steps taken over the whole job
        self.batch_size = batch_size  # reference size: the global batch the LR was tuned for
        self.consumed = 0  # samples (tokens with a budget) trained over the whole job: drives ramp-up
        self.plan: dict | None = None  # token budgets: the TokenPlanState of the loop in progress

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "loop": self.loop,
            "index": self.index,
            "finished": [[key, value] for key, value in self.finished.items()],
            "step": self.step,
            "batch_size": self.batch_size,
            "consumed": self.consumed,
            "plan": self.plan,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.loop = int(state["loop"])
        self.index = int(state["index"])
        self.finished = {key: int(value) for key, value in state["finished"]}
        self.step = int(state["step"])
        self.batch_size = int(state["batch_size"])
        self.consumed = int(state.get("consumed", 0))
        self.plan = state.get("plan")


#: Signals that mean "stop the job": the main process handles them, data workers ignore them.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class _ShieldedWorkerInit:
    """``worker_init_fn`` of the DataLoader workers: leave the trainer's process group, then run the user's.

    torchrun stops a worker by signalling its whole process group, which
    holds the DataLoader's worker processes too.  Killed by that SIGTERM they
    would make the main process fail ("DataLoader worker ... is killed by
    signal") before it could checkpoint.  The stop belongs to the trainer, so
    each data worker moves to a process group of its own: signals meant for
    the job (and a terminal's Ctrl-C) no longer reach it, while the main
    process still shuts it down as usual, and its watchdog ends it if the
    main process dies.  The main process blocks the stop signals while it
    starts workers (:class:`_signals_blocked`); one sent to the old group in
    that window is discarded here before they are unblocked.
    """

    def __init__(self, user_fn: Any) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        os.setpgid(0, 0)
        while signal.sigpending() & _STOP_SIGNALS:  # sent to the trainer's group before we left it
            signal.sigwait(_STOP_SIGNALS)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        if self.user_fn is not None:
            self.user_fn(worker_id)


class _signals_blocked:
    """Hold SIGTERM/SIGINT back while DataLoader workers are started (they inherit the mask)."""

    def __init__(self, active: bool) -> None:
        self.active = active

    def __enter__(self) -> None:
        if self.active:
            self._previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)

    def __exit__(self, *exc: Any) -> None:
        if self.active:  # a signal that arrived meanwhile is delivered to our handler now
            signal.pthread_sigmask(signal.SIG_SETMASK, self._previous)


class _Lookahead:
    """An iterator that can tell whether another item follows (the last step of a loop)."""

    _EMPTY = object()

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self._next: Any = self._EMPTY

    def __iter__(self) -> "_Lookahead":
        return self

    def __next__(self) -> Any:
        if self._next is not self._EMPTY:
            item, self._next = self._next, self._EMPTY
            return item
        return next(self._iterator)

    def has_next(self) -> bool:
        if self._next is self._EMPTY:
            self._next = next(self._iterator, self._EMPTY)
        return self._next is not self._EMPTY


class _LocalBatches(torch.utils.data.Sampler):
    """This replica's index lists, read from the current plan.

    Serves as the ``batch_sampler`` of the inner DataLoader (iterated in the
    main process, possibly ahead of training when workers prefetch); the
    outer loader re-points it whenever the plan restarts.
    """

    def __init__(self) -> None:
        self.source: Iterator[list[int]] = iter(())

    def __iter__(self) -> Iterator[list[int]]:
        return self.source


@dataclasses.dataclass
class _Plan:
    """A running plan: the steps for the outer loop and the batches fetched for them."""

    key: Any
    steps: _Lookahead
    batches: Iterator[Any]


class _StepTiming:
    """Wall time of each optimizer step, split into data waiting and compute."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._boundary: float | None = None
        self._data = 0.0
        self._compute: list[float] = []
        self._yielded: float | None = None
        self._recent: collections.deque = collections.deque(maxlen=20)

    def fetch(self, iterator: Iterator[Any], last: bool) -> Any:
        now = time.perf_counter()
        if self._boundary is None:
            self._boundary = now
        if self._yielded is not None:  # the previous micro-batch (an accumulation step) is done
            self._compute.append(now - self._yielded)
        batch = next(iterator)
        done = time.perf_counter()
        self._data += done - now
        self._yielded = None if last else done
        return batch

    def step_done(self) -> tuple[float | None, float | None, float | None]:
        """(step time, compute time per micro-batch or None, data wait) of the step just finished."""
        now = time.perf_counter()
        start, self._boundary = self._boundary, now
        data, compute = self._data, self._compute
        self._data, self._compute, self._yielded = 0.0, [], None
        if start is None:
            return None, None, None
        self._recent.append(now - start)
        return now - start, (sum(compute) / len(compute) if compute else None), data

    def per_sec(self, size: float) -> float | None:
        """``size`` per second at the recent step rate."""
        if not self._recent:
            return None
        return size / (sum(self._recent) / len(self._recent))


class _IntervalStats:
    """Sizes of the steps since the last metrics record (cheap sums)."""

    def __init__(self) -> None:
        self.steps = self.samples = self.tokens = self.padded = 0

    def add(self, step: PlannedStep) -> None:
        self.steps += 1
        self.samples += step.num_samples
        self.tokens += step.num_tokens or 0
        self.padded += step.padded_tokens or 0

    def fields(self) -> dict[str, Any]:
        if not self.steps:
            return {}
        out: dict[str, Any] = {"samples_per_step": self.samples / self.steps}
        if self.padded:
            out.update(tokens_per_step=self.tokens / self.steps, padding_efficiency=self.tokens / self.padded)
        return out


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
    return value


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
            see :mod:`adaptive.checkpoint.states.states`).
        max_tokens: turn on token-budget batches: the most padded tokens
            (longest sample x samples) one replica's micro-batch may hold.
        lengths: with ``max_tokens``, the token count of every sample: a
            list/array indexed by sample index, or a function index -> length.
        accumulation_steps: with ``max_tokens`` and no global ``batch_size``,
            micro-batches per replica per optimizer step.
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
            :class:`~adaptive.batchsize.rampup.LinearRampup`, or its ``to_config()``.
        **kwargs: the usual DataLoader arguments (``num_workers``,
            ``collate_fn``, ``pin_memory``, ``timeout``, ``worker_init_fn``,
            ``multiprocessing_context``, ``prefetch_factor``,
            ``persistent_workers``, ``pin_memory_device``, ``in_order``).
            ``sampler``, ``batch_sampler`` and ``generator`` cannot be
            honoured (the order must be the elastic one) and are refused.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
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
        _refuse_unsupported(kwargs)
        length = _dataset_length(dataset)
        if batch_size is not None:
            _check_positive_int("batch_size", batch_size)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        if dataloader_context.current_dataloader() is not None:
            raise RuntimeError("AdaptiveDataLoader created inside another AdaptiveDataLoader loop; "
                               "create loaders before the loops")
        self.dataset = dataset
        self.sampler = ElasticSampler(length, shuffle=shuffle, seed=seed, drop_last=drop_last)
        if name is None:
            name = states.default_name("dataloader")
        elif not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        self.name = name
        self._lr_scaling = _check_choice("lr_scaling", lr_scaling, LR_SCALING)
        unit = "samples" if max_tokens is None else "tokens"
        self._schedule = None if batch_size_schedule is None else _unit_schedule(batch_size_schedule, unit)
        if max_tokens is None:
            _refuse_token_options(lengths, accumulation_steps, window_size, on_oversize, average_by)
            self._batching: Batching = SampleBatching(self.sampler, name)
            self._average_by = "samples"
        else:
            _check_token_options(drop_last, accumulation_steps, batch_size is not None or self._schedule is not None)
            self._batching = TokenBatching(self.sampler, check_lengths(lengths, length), max_tokens,
                                           window_size=window_size, seed=seed,
                                           on_oversize=_check_choice("on_oversize", on_oversize, ON_OVERSIZE),
                                           name=name)
            self._average_by = _check_choice("average_by", average_by or "tokens", AVERAGE_BY)
        self._accumulation_steps = accumulation_steps
        self._global_tokens = max_tokens is not None and batch_size is not None and self._schedule is None
        reference = self._default_reference(batch_size)
        self._batches = _LocalBatches()
        self._workers = int(kwargs.get("num_workers") or 0) > 0
        if self._workers:
            kwargs["worker_init_fn"] = _ShieldedWorkerInit(kwargs.get("worker_init_fn"))
        self._inner = torch.utils.data.DataLoader(dataset, batch_sampler=self._batches, **kwargs)
        self._loops: collections.Counter = collections.Counter()
        self._controller: BatchSizeController | None = None
        self._micro: tuple[int, int] | None = None
        self._step_now: PlannedStep | None = None
        self._weights: list[float] = []
        self._lr_factor = 1.0
        self._last_step: tuple[int, int] | None = None  # (micro size, micro-steps) of the last step taken
        self._interval = _IntervalStats()
        self._timing = _StepTiming()
        self._metrics = metrics.MetricsWriter()
        self._progress_logged = time.monotonic()
        self._scope_warned = False  # warned that this loader outlived the epoch that owns it
        self._state = _AdaptiveDataLoaderState(f"adaptive.dataloader.{name}", reference, states.epoch_scope())
        if states.load_state(self._state) and self._state.batch_size != reference:
            logger.info("loader %s: continuing with the checkpointed %s %d (%d given)", name,
                        "batch size" if self._schedule is None else "reference batch size",
                        self._state.batch_size, reference)
        self._init_batch_size = self._state.batch_size
        self._sizer = self._make_sizer()
        if self._schedule is not None and env.rank() == 0:
            logger.info("loader %s: %s", name, describe(self._schedule))
        sync_points.install_signal_handlers()

    def _default_reference(self, batch_size: int | None) -> int:
        """The reference size (what the LR was tuned for) when no checkpoint says otherwise."""
        if batch_size is not None:
            return batch_size
        if self._schedule is not None:
            return self._schedule.final_batch_size
        if isinstance(self._batching, TokenBatching):  # the planned step of the first launch
            return self._batching.max_tokens * self._accumulation_steps * env.num_replicas()
        return 1

    def _make_sizer(self) -> StepSizer:
        batching = self._batching
        if isinstance(batching, TokenBatching):
            floor = batching.longest_sample() or batching.max_tokens
            schedule = self._schedule
            if self._global_tokens:
                schedule = ConstantSchedule(self._state.batch_size, "tokens")
            native = StepShape(batching.max_tokens, self._accumulation_steps)
            return StepSizer("tokens", schedule, lambda replicas: native, max_micro=batching.max_tokens,
                             min_micro=lambda replicas: floor)
        return StepSizer("samples", self._schedule, lambda replicas: StepShape(self._state.batch_size, 1),
                         min_micro=lambda replicas: replicas)

    @classmethod
    def from_dataloader(cls, loader: torch.utils.data.DataLoader, *, shuffle: bool | None = None,
                        seed: int = 0, name: str | None = None) -> "AdaptiveDataLoader":
        """Build from an existing DataLoader, keeping its dataset, batch size and worker settings.

        ``batch_size`` becomes the global batch size.  The order is taken from
        its sampler (``RandomSampler`` means shuffle); other samplers cannot be
        honoured and are refused.
        """
        if loader.batch_size is None:
            raise ValueError("from_dataloader: the DataLoader uses a custom batch_sampler, which cannot be "
                             "honoured; build AdaptiveDataLoader(dataset, batch_size=...) instead")
        sampler = loader.sampler
        if shuffle is None:
            if isinstance(sampler, torch.utils.data.RandomSampler):
                shuffle = True
            elif isinstance(sampler, torch.utils.data.SequentialSampler):
                shuffle = False
            else:
                raise ValueError(f"from_dataloader: the DataLoader's sampler {type(sampler).__name__} cannot be "
                                 "honoured; only the default sequential or random order is supported")
        kwargs: dict[str, Any] = {
            "num_workers": loader.num_workers,
            "collate_fn": loader.collate_fn,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "persistent_workers": loader.persistent_workers,
        }
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
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
        if dataloader_context.current_dataloader() is self:
            raise RuntimeError("call autoscale_batch_size before iterating the loader")
        bounds = self._autoscale_bounds(max_batch_size, local_bsz_bounds)
        config = AutoscaleConfig(self._init_batch_size, max_batch_size, bounds, bool(gradient_accumulation),
                                 adapt_every, hysteresis)
        if self._controller is None:
            self._controller = BatchSizeController(self.name, config, self._state.scope)
        else:
            self._controller.config = config
        self._sizer.autoscale = self._controller.current
        self._sizer.schedule = self._schedule  # only an explicit schedule caps autoscale

    def _autoscale_bounds(self, max_batch_size: int, bounds: tuple[int, int] | None) -> tuple[int, int]:
        batching = self._batching
        if not isinstance(batching, TokenBatching):
            return (1, max_batch_size) if bounds is None else tuple(bounds)  # type: ignore[return-value]
        longest = batching.longest_sample()
        if bounds is None:  # lengths given as a function: the longest sample is unknown, keep the budget
            return (longest or batching.max_tokens, batching.max_tokens)
        lo, hi = tuple(bounds)
        if isinstance(hi, int) and hi > batching.max_tokens:
            raise ValueError(f"local_bsz_bounds[1]={hi} exceeds max_tokens={batching.max_tokens}: with token "
                             "budgets the bounds are tokens per micro-batch and max_tokens is the memory limit")
        if (isinstance(lo, int) and longest is not None and lo < longest and batching.on_oversize == "error"):
            raise ValueError(f"local_bsz_bounds[0]={lo} is below the longest sample ({longest} tokens): a smaller "
                             "budget would make it oversize; raise the lower bound or use on_oversize='skip'")
        return lo, hi

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
        return self._batching.max_tokens if isinstance(self._batching, TokenBatching) else None

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
    def micro_step(self) -> tuple[int, int] | None:
        """(index, count) of the micro-batch being trained on, or None outside the loop."""
        return self._micro

    def is_accumulation_step(self) -> bool:
        """True on micro-batches that are not the last of their optimizer step.

        On those, clip gradients or step a GradScaler only when this is False.
        """
        return self._micro is not None and self._micro[0] < self._micro[1] - 1

    @property
    def current_step(self) -> PlannedStep | None:
        """The optimizer step being trained on (sizes, padding, this replica's indices), or None."""
        return self._step_now

    @property
    def loss_weight(self) -> float:
        """Factor for the current micro-batch's *summed* loss (sum over its real tokens, or samples).

        ``(loss_sum * loader.loss_weight).backward()`` on every micro-batch
        makes the optimizer step's gradient the mean over all real tokens
        (``average_by="tokens"``) or samples of the whole step, across
        replicas and micro-steps: the single-process gradient of the same
        samples.  0 on padding micro-batches (``is_padding``).
        """
        if self._micro is None:
            raise RuntimeError("loss_weight is defined inside the loader loop only (for the current micro-batch)")
        return self._weights[self._micro[0]]

    @property
    def is_padding(self) -> bool:
        """True if the current micro-batch only repeats samples to keep replicas in lock-step."""
        return self._step_now is not None and self._micro is not None and self._step_now.padding[self._micro[0]]

    @property
    def lr_factor(self) -> float:
        """LR factor of the current step for its actual size (``lr_scaling``); 1 outside the loop."""
        return self._lr_factor if self._step_now is not None else 1.0

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
        metrics.to_tensorboard(writer, self._metrics_record(), step if step is not None else self._state.step,
                               tag_prefix=tag_prefix)

    def __len__(self) -> int:
        """Micro-batches in a whole epoch at the current batch size (plans the epoch with a token budget)."""
        return self._batching.remaining_micro_steps(self._state, self._sizer, env.num_replicas())

    def __repr__(self) -> str:
        return f"AdaptiveDataLoader(name={self.name!r}, batch_size={self.batch_size}, unit={self.unit!r})"

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        with dataloader_context.active_loop(self):
            key = epoch.current_epoch()
            self._warn_if_out_of_scope(key)
            self._loops[key] += 1
            loop = self._loops[key]
            if self._state.finished.get(key, 0) >= loop:
                logger.log(_rank0_info(), "loader %s: loop %d of epoch %s already finished before the restart; "
                           "skipping it", self.name, loop, key)
                return
            self._enter_loop(key, loop)
            yield from self._steps(key)

    def _enter_loop(self, key: int | None, loop: int) -> None:
        state = self._state
        for old in [k for k in state.finished if k is not None and key is not None and k < key]:
            del state.finished[old]
        if (state.epoch, state.loop) == (key, loop) and self._batching.resuming(state):
            logger.log(_rank0_info(), "loader %s: resuming loop %d of epoch %s at sample %d of %d",
                       self.name, loop, key, state.index, self.sampler.num_samples)
        else:
            state.epoch, state.loop = key, loop
            self._batching.reset(state)
        self.sampler.set_epoch(0 if key is None else key)

    def _warn_if_out_of_scope(self, key: int | None) -> None:
        scope = self._state.scope
        if scope is not None and key != scope and not self._scope_warned:
            self._scope_warned = True
            logger.warning("loader %s was created inside epoch %d and is iterated in epoch %s: objects created "
                           "inside an epoch are checkpointed only until that epoch ends, so its position is not "
                           "saved now; create it before the epoch loop", self.name, scope, key)

    def _steps(self, key: int | None) -> Iterator[Any]:
        state = self._state
        plan: _Plan | None = None
        self._timing.reset()
        sync_points.restart_spacing()  # this loop's steps may be much longer or shorter than the last loop's
        try:
            while not epoch.training_finished():  # finish_training() in the loop body ends the loop
                first = plan is None
                if first:  # a stop that arrived between loops is acted on before the first step
                    sync_points.settle(self._checkpoint_metadata)
                else:
                    sync_points.step_boundary(self._checkpoint_metadata)
                self._after_boundary(first=first)
                plan_key = self._controller.current() if self._controller is not None else None
                if plan is None or plan.key != plan_key:
                    if plan is not None:  # a new batch size: new step times
                        sync_points.restart_spacing()
                    plan = self._start_plan(plan_key)
                step = next(plan.steps, None)
                if step is None:
                    break
                if not first and not plan.steps.has_next():
                    # A stop known now is taken before the loop's last step, so that a replay runs
                    # that step (and the loop body that binds its variables) again.
                    sync_points.settle(self._checkpoint_metadata)
                self._begin_step(step)
                count = step.num_micro_steps
                for micro in range(count):
                    self._micro = (micro, count)
                    yield self._timing.fetch(plan.batches, last=micro == count - 1)
                self._commit(step)
        except GeneratorExit:
            # ``break`` (or the loop abandoned): the loop counts as done.  No
            # collective here: the pending agreement settles at the next boundary.
            step, micro = self._step_now, self._micro
            if epoch.training_finished() and step is not None and micro is not None and micro[0] == micro[1] - 1:
                self._commit(step)  # finish_training() then break after the step's last micro-batch: it was taken
            else:
                self._end_step(None)
            self._mark_finished(key)
            epoch.save_pending_finish()  # all replicas called finish_training(): this collective is safe
            raise
        self._mark_finished(key)
        if epoch.training_finished():  # finish_training() in the loop body: checkpointed, nothing left to agree on
            epoch.save_pending_finish()
        else:
            sync_points.final_boundary(self._checkpoint_metadata)

    def _commit(self, step: PlannedStep) -> None:
        """The step's micro-batches were all trained: advance the position past it."""
        self._batching.commit(self._state, step)
        self._state.step += 1
        self._end_step(step)

    def _start_plan(self, key: Any) -> _Plan:
        """(Re)start planning from the committed position; the fetching side follows the same plan."""
        steps = self._batching.plan(self._state, self._sizer, env.num_replicas(), env.rank())
        outer, inner = itertools.tee(steps)
        self._batches.source = (indices for step in inner for indices in step.indices)
        with _signals_blocked(self._workers):  # workers start here (each loop, unless persistent)
            batches = iter(self._inner)
        return _Plan(key, _Lookahead(outer), batches)

    def _begin_step(self, step: PlannedStep) -> None:
        """Loss weights, LR factor and gradient-statistics configuration of the step about to run."""
        replicas, count = env.num_replicas(), step.num_micro_steps
        model = data_parallel.current_model()
        total = step.num_tokens if self._average_by == "tokens" else step.num_samples
        divisor = model.gradient_divisor(count) if model is not None else replicas
        self._weights = [loss_weight(step, m, total or 0, divisor) for m in range(count)]
        rule = resolve_lr_scaling(self._lr_scaling, model.scaling_rule if model is not None else None)
        self._lr_factor = step_lr_factor(max(step.size, 1), step.planned_size, rule)
        self._step_now = step
        local = step.shape.micro if self._sizer.per_replica else max(1, step.shape.micro // replicas)
        self._last_step = (local, count)
        if torch.is_grad_enabled():  # not for evaluation loops under no_grad
            for trained in data_parallel.live_models():  # every model the step trains (DCGAN: netD and netG)
                trained.gns.set_batch_config(init_batch_size=self._init_batch_size, local_bsz=local,
                                             accum_steps=count, num_replicas=replicas)

    def _end_step(self, step: PlannedStep | None) -> None:
        if step is not None:
            self._interval.add(step)
        self._micro = None
        self._step_now = None

    def _after_boundary(self, first: bool) -> None:
        """Per-step bookkeeping at a boundary: timing, batch-size decisions, metrics."""
        model = data_parallel.current_model()
        step_time, compute_time, data_time = self._timing.step_done()
        if self._controller is not None and step_time is not None and self._last_step is not None:
            self._controller.observe(*self._last_step, step_time, compute_time, data_time)
        if self._controller is not None and model is not None:
            force = first and self._controller.replicas_changed()
            if force or (not first and self._state.step % self._controller.config.adapt_every == 0):
                before = self._controller.current()
                grad_params = model.gns.to_grad_params()
                decision = self._controller.decide(grad_params, force=force)
                self._controller.report_hints(grad_params, model.scaling_rule.progress)
                if decision is not None:
                    self._log_decision(decision, *before)
        interval = metrics.metrics_interval()
        if interval and not first and self._state.step % interval == 0 and torch.is_grad_enabled():
            self._metrics.write(self._metrics_record())
            self._interval = _IntervalStats()
        if env.rank() == 0 and not first and torch.is_grad_enabled():
            self._log_progress()

    def _log_progress(self) -> None:
        """A progress line every ``ADAPTIVE_PROGRESS_INTERVAL`` seconds (default 30; 0 = off), rank 0 only."""
        every = env.progress_interval()
        now = time.monotonic()
        if every <= 0 or now - self._progress_logged < every:
            return
        self._progress_logged = now
        rate = self._timing.per_sec(self.batch_size)
        line = f"loader {self.name}: epoch {epoch.current_epoch()}, step {self._state.step}"
        if self.unit == "samples":
            total = self.sampler.num_samples
            line += f", sample {self._state.index} of {total}"
            if rate:
                line += f", {rate:.1f} samples/s, epoch ETA {_duration((total - self._state.index) / rate)}"
        elif rate:
            line += f", {rate:.1f} {self.unit}/s"
        logger.info("%s (batch %d %s)", line, self.batch_size, self.unit)

    def _log_decision(self, decision: Decision, local: int, accum: int) -> None:
        replicas = env.num_replicas()  # local sizes are per replica in both units
        before = local * accum * replicas
        after = decision.local_bsz * decision.accum_steps * replicas
        if env.rank() == 0:
            logger.info("batch size changed from %d (local %d x %d steps) to %d (local %d x %d steps) on %d "
                        "replicas because %s (goodput %.1f -> %.1f %s/s-equivalent)",
                        before, local, accum, after, decision.local_bsz, decision.accum_steps, replicas,
                        decision.reason, decision.previous_goodput, decision.goodput, self.unit)
        self._metrics.event("batch_size", loader=self.name, step=self._state.step, before=before, after=after,
                            local_bsz=decision.local_bsz, accum_steps=decision.accum_steps,
                            goodput_before=decision.previous_goodput, goodput_after=decision.goodput,
                            reason=decision.reason, unit=self.unit)

    def _metrics_record(self) -> dict[str, Any]:
        model = data_parallel.current_model()
        record: dict[str, Any] = {"loader": self.name, "step": self._state.step,
                                  "epoch": epoch.current_epoch(),
                                  "replicas": env.num_replicas(), "nodes": env.num_nodes(),
                                  "batch_size": self.batch_size, "local_bsz": self.current_local_bsz,
                                  "accum_steps": self.accumulation_steps, "unit": self.unit,
                                  "consumed": self._state.consumed,
                                  "samples_per_sec": self._timing.per_sec(self.batch_size)}
        record.update(self._interval.fields())
        if self.unit == "tokens":  # batch_size is in tokens: report both rates from the steps' actual sizes
            record["samples_per_sec"] = self._timing.per_sec(record.get("samples_per_step", 0)) or None
            record["tokens_per_sec"] = self._timing.per_sec(record.get("tokens_per_step", 0)) or None
        if model is not None:
            gns, rule = model.gns, model.scaling_rule
            grad = gns.to_grad_params()
            record.update(noise_scale=gns.noise_scale() if grad is not None else None,
                          gain=rule.last_gain, lr_factor=rule.last_factor, progress=rule.progress,
                          step_lr_factor=model.step_lr.last_factor)
            rate = self._timing.per_sec(self.batch_size)
            if grad is not None and rate:
                scale = self.batch_size / self._init_batch_size
                record["goodput"] = rate * gns.gain(scale) / max(scale, 1e-12)
        return record

    def _mark_finished(self, key: int | None) -> None:
        self._state.finished[key] = self._state.loop
        self._batching.reset(self._state)

    def _checkpoint_metadata(self) -> dict:
        return {"epoch": epoch.current_epoch(), "step": self._state.step, "loader": self.name,
                "index": self._state.index, "batch_size": self.batch_size, "consumed": self._state.consumed,
                "unit": self.unit}


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _dataset_length(dataset: Any) -> int:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError("AdaptiveDataLoader needs a map-style dataset (with __len__ and __getitem__), "
                        "not an IterableDataset")
    try:
        length = len(dataset)
    except TypeError:
        raise TypeError(f"dataset must define __len__; got {type(dataset).__name__}") from None
    if length == 0:
        raise ValueError("dataset is empty: AdaptiveDataLoader needs at least one sample")
    return length


def _unit_schedule(spec: Any, unit: str) -> BatchSizeSchedule:
    """The ramp-up schedule from ``batch_size_schedule=``, checked to count ``unit``."""
    schedule = make_schedule(spec, unit)
    if schedule.unit != unit:
        raise ValueError(f"batch_size_schedule counts {schedule.unit} but this loader batches by {unit} "
                         f"({'with' if unit == 'tokens' else 'without'} max_tokens); build the schedule "
                         f"with unit={unit!r}")
    return schedule


def _refuse_token_options(lengths: Any, accumulation_steps: Any, window_size: Any, on_oversize: Any,
                          average_by: Any) -> None:
    """Token-budget options given without ``max_tokens`` are mistakes: say so."""
    given = {"lengths": lengths is not None, "accumulation_steps": accumulation_steps != 1,
             "window_size": window_size != DEFAULT_WINDOW_SIZE, "on_oversize": on_oversize != "error",
             "average_by": average_by not in (None, "samples")}
    wrong = [key for key, value in given.items() if value]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} only apply to token-budget batches; pass max_tokens= as well "
                         "(for sample batches use autoscale_batch_size(gradient_accumulation=True) "
                         "for accumulation)")


def _check_token_options(drop_last: bool, accumulation_steps: Any, global_batch: bool) -> None:
    """Options that cannot go with ``max_tokens``, or only in some combinations."""
    if drop_last:
        raise ValueError("drop_last=True is not supported with max_tokens: the last step of an epoch is kept "
                         "(it may be smaller)")
    _check_positive_int("accumulation_steps", accumulation_steps)
    if accumulation_steps != 1 and global_batch:
        raise ValueError("accumulation_steps= cannot be combined with a global batch_size= or "
                         "batch_size_schedule= in tokens: the micro-steps follow from the global batch and "
                         "max_tokens")


def _rank0_info() -> int:
    """INFO on rank 0, DEBUG elsewhere: one line per event, not one per replica."""
    return logging.INFO if env.rank() == 0 else logging.DEBUG


def _refuse_unsupported(kwargs: dict[str, Any]) -> None:
    refused = {
        "sampler": "the order must be the elastic, replica-independent one; use shuffle= and seed=",
        "batch_sampler": "batches are cut from the elastic global stream; use batch_size= or max_tokens=",
        "generator": "the order is seeded by seed=, independently of torch's RNG",
    }
    for key, why in refused.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"AdaptiveDataLoader cannot honour {key}=: {why}")
        kwargs.pop(key, None)
    unknown = set(kwargs) - set(_PASSTHROUGH)
    if unknown:
        raise TypeError(f"AdaptiveDataLoader got unexpected keyword arguments {sorted(unknown)}; "
                        f"allowed DataLoader arguments are {list(_PASSTHROUGH)}")


def _reset_for_tests() -> None:
    """Nothing is kept per process here any more (names are counted by :mod:`adaptive.checkpoint.states.states`)."""
