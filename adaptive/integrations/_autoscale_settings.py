"""The autoscale arguments of a front-end (the Trainer, Lightning's strategy), and the step count of its schedule.

Private to :mod:`adaptive.integrations`.  A front-end that turns on
:meth:`adaptive.AdaptiveDataLoader.autoscale_batch_size` for the training
loader it builds takes the same arguments (its name for ``max_batch_size``
may differ):

* :func:`settings_from`: the checked :class:`AutoscaleSettings`, or None
  when autoscale is off; checked at construction by the library's own
  validator (:class:`~adaptive.batchsize.autoscale.AutoscaleConfig`), its
  errors naming the front-end's arguments;
* :meth:`AutoscaleSettings.apply`: autoscale on for the loader, which checks
  the largest batch against the reference (the first launch's) batch;
* :func:`reference_steps`: the steps of the reference batch that a position
  in an epoch stands for, which a schedule defined in steps counts, so that
  it follows the samples whatever batch autoscale chose.
"""

from __future__ import annotations

import dataclasses

from adaptive.batchsize.autoscale import AutoscaleConfig
from adaptive.data.dataloader import AdaptiveDataLoader

__all__ = ["AutoscaleSettings", "reference_steps", "settings_from"]

_DEFAULT_ADAPT_EVERY = 20
_DEFAULT_HYSTERESIS = 0.05


@dataclasses.dataclass(frozen=True)
class AutoscaleSettings:
    """The arguments of :meth:`adaptive.AdaptiveDataLoader.autoscale_batch_size`, as a front-end takes them.

    ``front_end`` names it in errors, ``max_argument`` is its name for
    ``max_batch_size``, and ``reference`` says what its reference global
    batch is made of.
    """

    front_end: str
    max_argument: str
    reference: str
    max_batch_size: int
    local_bsz_bounds: tuple[int, int] | None = None
    gradient_accumulation: bool = False
    adapt_every: int = _DEFAULT_ADAPT_EVERY
    hysteresis: float = _DEFAULT_HYSTERESIS

    def check(self) -> None:
        """The library's validator, at the front-end's construction.

        The largest batch against the reference batch is checked when the
        loader is made (the reference is the first launch's, restored from
        the checkpoint).

        Raises:
            ValueError, TypeError: a value out of range, naming the argument.
        """
        bounds = self.local_bsz_bounds
        if bounds is None:  # the loader's default, (1, max_batch_size); (1, 1) lets a bad max_batch_size be named
            valid = isinstance(self.max_batch_size, int) and not isinstance(self.max_batch_size, bool)
            bounds = (1, self.max_batch_size if valid and self.max_batch_size >= 1 else 1)
        try:
            AutoscaleConfig(1, self.max_batch_size, bounds, self.gradient_accumulation, self.adapt_every,
                            self.hysteresis)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{self.front_end}: {self._named(str(error))}") from error

    def apply(self, loader: AdaptiveDataLoader) -> None:
        """Turn autoscale on for ``loader``.

        Raises:
            ValueError: the largest batch below the loader's reference (global) batch.
        """
        try:
            loader.autoscale_batch_size(self.max_batch_size, self.local_bsz_bounds, self.gradient_accumulation,
                                        adapt_every=self.adapt_every, hysteresis=self.hysteresis)
        except ValueError as error:
            raise ValueError(f"{self.front_end}: {self._named(str(error))} (the reference global batch is "
                             f"{self.reference})") from error

    def _named(self, message: str) -> str:
        """The library's message with ``max_batch_size`` named as the front-end's argument."""
        return message.replace("max_batch_size", self.max_argument)


def settings_from(front_end: str, max_argument: str, reference: str, max_batch_size: int | None,
                  local_bsz_bounds: tuple[int, int] | None, gradient_accumulation: bool, adapt_every: int,
                  hysteresis: float) -> AutoscaleSettings | None:
    """The checked settings, or None when autoscale is off (the largest batch, ``max_argument``, not given).

    Raises:
        ValueError: another autoscale setting given without ``max_argument``,
            or a value out of range (naming the argument).
    """
    if max_batch_size is None:
        given = {"local_bsz_bounds": local_bsz_bounds is not None, "gradient_accumulation": bool(gradient_accumulation),
                 "adapt_every": adapt_every != _DEFAULT_ADAPT_EVERY, "hysteresis": hysteresis != _DEFAULT_HYSTERESIS}
        named = [name for name, value in given.items() if value]
        if named:
            raise ValueError(f"{front_end}: {', '.join(named)} only apply with autoscale; pass {max_argument}= "
                             "(the largest global batch) to turn it on")
        return None
    settings = AutoscaleSettings(front_end, max_argument, reference, max_batch_size, local_bsz_bounds,
                                 gradient_accumulation, adapt_every, hysteresis)
    settings.check()  # (local_bsz_bounds: two ints, or a TypeError naming it)
    if local_bsz_bounds is None:
        return settings
    return dataclasses.replace(settings, local_bsz_bounds=(local_bsz_bounds[0], local_bsz_bounds[1]))


def reference_steps(loader: AdaptiveDataLoader, reference_batch: int, epoch: int, position: int) -> int:
    """Steps of ``reference_batch`` samples up to sample ``position`` of ``epoch`` (a schedule's count).

    ``epoch x S + floor(position / reference_batch)``, and ``(epoch + 1) x S``
    at the epoch's end, ``S`` the reference steps of an epoch: the count of
    an uninterrupted run with the reference batch, whatever batches
    autoscale chose.
    """
    per_epoch = max(1, loader.sampler.num_steps(0, reference_batch))
    if position >= loader.sampler.num_samples:  # the epoch's end: its (possibly partial) last step counts whole
        return (epoch + 1) * per_epoch
    return epoch * per_epoch + min(per_epoch, position // reference_batch)
