"""Deep equality of saved and restored states, for the tests of the formats that carry them."""

from __future__ import annotations

from typing import Any

import torch


def assert_same(actual: Any, expected: Any, where: str = "value") -> None:
    """Equal values of the same types all the way down: tensors bitwise, with their dtype, shape and Python
    attributes; dicts with their keys in order and their attributes (``Module.state_dict()``'s ``_metadata``)."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual.resolve_conj().resolve_neg(), expected.resolve_conj().resolve_neg()), where
        assert vars(actual) == vars(expected), f"{where}: attributes {vars(actual)} != {vars(expected)}"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        assert getattr(actual, "__dict__", {}) == getattr(expected, "__dict__", {}), f"{where}: attributes"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where
