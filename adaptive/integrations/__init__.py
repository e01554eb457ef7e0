"""Front-ends that make existing training scripts elastic: Hugging Face Accelerate and Trainer, Lightning (DESIGN.md 5b).

Each front-end is a module of its own, imported explicitly, because each
needs an optional extra that the library itself does not:

* :mod:`adaptive.integrations.accelerate`: ``AdaptiveAccelerator``, a
  drop-in subclass of ``accelerate.Accelerator``
  (``pip install adaptive-elastic[huggingface]``);
* :mod:`adaptive.integrations.transformers`: ``AdaptiveTrainer``, a
  drop-in subclass of ``transformers.Trainer`` (the same extra);
* :mod:`adaptive.integrations.lightning`: ``AdaptiveStrategy``, a Lightning
  strategy used as ``L.Trainer(strategy=AdaptiveStrategy())``
  (``pip install adaptive-elastic[lightning]``).

Importing this package imports none of them, so ``import adaptive`` never
needs the extras.
"""
