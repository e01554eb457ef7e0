"""The hand-over's wire format: a packed state unpacks equal, and a forged buffer is refused (G4)."""

from __future__ import annotations

import collections
import io
import pickle

import pytest
import torch

from adaptive.checkpoint import _flat_state
from adaptive.checkpoint._safe_load import NotLoadable
from state_equality import assert_same


def trained_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return {"seq": 7, "metadata": {"epoch": 1}, "sharded": [],
            "states": {"model": model.state_dict(), "optimizer": optimizer.state_dict()}}


def test_model_and_optimizer_round_trip_bit_for_bit():
    state = trained_state()
    packed = _flat_state.pack(state)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    out = _flat_state.unpack(packed, "test state")
    assert_same(out, state)
    assert out["states"]["model"]._metadata == state["states"]["model"]._metadata  # load_state_dict's versions
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    model.load_state_dict(out["states"]["model"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(out["states"]["optimizer"])
    assert_same(optimizer.state_dict(), state["states"]["optimizer"])


def test_unusual_tensors_and_containers_round_trip():
    with_attribute = torch.arange(3.0)
    with_attribute.note = "kept"
    state = {
        "non_contiguous": torch.randn(3, 4).t(), "bool": torch.tensor([True, False]), "half": torch.randn(5).half(),
        "bfloat": torch.randn(2, 3).bfloat16(), "empty": torch.zeros(0, 5), "scalar": torch.tensor(3.5),
        "int64": torch.arange(10), "conjugate": torch.randn(3, dtype=torch.complex64).conj(),
        "in_a_tuple": (torch.ones(2), 1), "in_a_list": [torch.full((2,), 2.0), None, "x"],
        "counter": collections.Counter({3: 2}), "parameter": torch.nn.Parameter(torch.ones(2)),
        "with_attribute": with_attribute, "nested": {"a": {"b": [torch.eye(2)]}}, 1: torch.ones(1),
        "requires_grad": torch.ones(2, requires_grad=True), "float8": torch.randn(4).to(torch.float8_e4m3fn),
    }
    out = _flat_state.unpack(_flat_state.pack(state), "test state")
    assert_same(out, state)
    assert out["conjugate"].is_conj() is False and torch.equal(out["conjugate"], state["conjugate"].resolve_conj())
    assert out["requires_grad"].requires_grad


def test_pack_leaves_the_state_alone_and_unpack_copies():
    state = trained_state()
    weight = state["states"]["model"]["0.weight"]
    packed = _flat_state.pack(state)
    assert state["states"]["model"]["0.weight"] is weight
    out = _flat_state.unpack(packed, "test state")
    packed.zero_()
    assert torch.equal(out["states"]["model"]["0.weight"], weight)  # a copy, not a view of the buffer


def test_a_bare_tensor_and_a_state_without_tensors():
    tensor = torch.randn(4, 4)
    assert torch.equal(_flat_state.unpack(_flat_state.pack(tensor), "t"), tensor)
    assert _flat_state.unpack(_flat_state.pack({"a": [1, "b"]}), "t") == {"a": [1, "b"]}


def forged(skeleton_pickle: bytes, tail: int = 0) -> torch.Tensor:
    length = torch.tensor([len(skeleton_pickle)], dtype=torch.int64).view(torch.uint8)
    body = torch.frombuffer(bytearray(skeleton_pickle), dtype=torch.uint8)
    return torch.cat([length, body, torch.zeros(tail, dtype=torch.uint8)])


def test_a_skeleton_that_would_run_code_is_refused():
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    buffer = io.BytesIO()
    torch.save({"skeleton": Evil(), "tensors": []}, buffer, pickle_module=pickle)
    with pytest.raises(NotLoadable, match="refusing to load the forged state"):
        _flat_state.unpack(forged(buffer.getvalue()), "the forged state")


@pytest.mark.parametrize("entry, message", [
    ((("a",), torch.float32, (1000,), 0), "outside"),
    ((("a",), "float32", (2,), 0), "dtype"),
    ((("a",), torch.float32, (-1,), 0), "shape"),
    ((("b",), torch.float32, (1,), 0), "no place"),
    ((("a",), torch.float32, (1,), 3), "outside"),
])
def test_a_tensor_entry_outside_the_buffer_or_skeleton_is_refused(entry, message):
    buffer = io.BytesIO()
    torch.save({"skeleton": {"a": None}, "tensors": [entry]}, buffer)
    with pytest.raises(NotLoadable, match=message):
        _flat_state.unpack(forged(buffer.getvalue(), tail=64), "the forged state")


@pytest.mark.parametrize("buffer", [torch.zeros(4, dtype=torch.uint8), torch.zeros(16, dtype=torch.float32),
                                    torch.tensor([10**6], dtype=torch.int64).view(torch.uint8)])
def test_a_buffer_that_is_no_packed_state_is_refused(buffer):
    with pytest.raises(NotLoadable, match="cannot deserialise"):
        _flat_state.unpack(buffer, "the forged state")
