"""Names a package exports, imported on first use.

The package faces (``adaptive``, ``adaptive.batchsize``, ...) name classes
from modules that need torch next to modules that do not. Importing the
face eagerly would make ``import adaptive.batchsize.rampup`` (torch-free
schedules) import torch; with :func:`lazy_exports` each
name's module is imported when the name is first used (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str], subpackages: tuple[str, ...] = ()
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``.

    Args:
        package: the package's ``__name__``.
        exports: public name -> the module that defines it; a name that is
            the last part of its module's path exports the module itself.
        subpackages: subpackages reachable as attributes without importing
            them first (``import adaptive; adaptive.parallel.sharding_mesh``).
    """

    def __getattr__(name: str) -> object:
        module_name = exports.get(name) or (f"{package}.{name}" if name in subpackages else None)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != "torch" and not (error.name or "").startswith("torch."):
                raise
            raise ModuleNotFoundError(f"{package}.{name} needs PyTorch, which is not installed: pip install "
                                      "torch (the scheduler, the goodput model and the planners work without it)",
                                      name=error.name) from error
        value = module if module_name.rsplit(".", 1)[-1] == name else getattr(module, name)
        globals_of_package = importlib.import_module(package).__dict__
        globals_of_package[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(importlib.import_module(package).__dict__) | set(exports) | set(subpackages))

    return __getattr__, __dir__
