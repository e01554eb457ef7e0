"""The one argument validator: wrong type -> TypeError, out of range -> ValueError, the argument named."""

from __future__ import annotations

import numpy as np
import pytest

from adaptive._utils.checks import check_bool, check_choice, check_float, check_int


def test_numpy_bools_are_bools_and_not_integers():
    assert check_bool("shuffle", np.True_) is True and check_bool("shuffle", np.bool_(False)) is False
    with pytest.raises(TypeError, match="n must be an integer >= 1, got bool"):
        check_int("n", np.True_, minimum=1)
    with pytest.raises(TypeError, match="n must be an integer, got bool"):
        check_int("n", True)
    with pytest.raises(TypeError, match="lr must be a number"):
        check_float("lr", np.False_)


def test_numpy_integers_pass_and_ranges_are_named():
    assert check_int("n", np.int64(3), minimum=1) == 3
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 4\], got 5"):
        check_int("n", 5, minimum=1, maximum=4)
    with pytest.raises(TypeError, match="shuffle must be True or False, got int 1"):
        check_bool("shuffle", 1)
    with pytest.raises(ValueError, match="mode must be one of 'a', 'b', got 'c'"):
        check_choice("mode", "c", ("a", "b"))
    with pytest.raises(TypeError, match="mode must be one of"):
        check_choice("mode", 1, ("a", "b"))
