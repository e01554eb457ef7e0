"""Front-ends that make existing training scripts elastic: Hugging Face Accelerate (DESIGN.md section 5b).

Each front-end is a module of its own, imported explicitly, because each
needs an optional extra that the library itself does not:

* :mod:`adaptive.integrations.accelerate`: ``AdaptiveAccelerator``, a
  drop-in subclass of ``accelerate.Accelerator``
  (``pip install adaptive-elastic[huggingface]``).

Importing this package imports none of them, so ``import adaptive`` never
needs the extras.
"""
