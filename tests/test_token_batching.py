"""Tests for the token planner (adaptive.data.tokens): budgets, lock-step, exact-once resume, weights, LR."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive.batchsize.step_lr_rules import step_lr_factor
from adaptive.checkpoint.versions import StateFormatError
from adaptive.data.tokens._packing import deal  # the dealing rule is checked on a crafted example
from adaptive.data.tokens.lengths import OversizeSampleError, SampleLengths
from adaptive.data.tokens.micro_batches import MicroBatch, TokenStep
from adaptive.data.tokens.plan_state import TokenPlanState
from adaptive.data.tokens.planner import TokenBudgetPlanner
from adaptive.data.weighting import loss_weights, sample_loss_weights

PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers


def make_lengths(kind: str, n: int, seed: int, max_len: int) -> np.ndarray:
    """Lengths from one of several shapes of distribution, clipped to [1, max_len]."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        raw = rng.integers(1, max_len + 1, n)
    elif kind == "lognormal":
        raw = rng.lognormal(np.log(max_len / 8), 1.0, n)
    elif kind == "bimodal":
        raw = np.where(
            rng.random(n) < 0.7, rng.integers(1, 8, n), rng.integers(max_len // 2, max_len + 1, n)
        )
    elif kind == "constant":
        raw = np.full(n, max(1, max_len // 3))
    else:  # "long": mostly samples that only fit alone
        raw = rng.integers(max_len // 2, max_len + 1, n)
    return np.clip(np.asarray(raw, dtype=np.int64), 1, max_len)


def plan(
    planner: TokenBudgetPlanner, stream, state=None, limit: int | None = None
) -> list[TokenStep]:
    steps = []
    for step in planner.plan_epoch(stream, state=state):
        steps.append(step)
        if limit is not None and len(steps) >= limit:
            break
    return steps


def trained(steps: list[TokenStep]) -> list[int]:
    """Real (non-padding) sample indices of the steps."""
    return [
        int(i)
        for step in steps
        for replica in step.micro_batches
        for mb in replica
        if not mb.is_padding
        for i in mb.indices
    ]


def accounted(steps: list[TokenStep]) -> list[int]:
    """Trained plus skipped samples: each must appear exactly once per epoch."""
    return trained(steps) + [int(i) for step in steps for i in step.skipped]


def check_step(
    step: TokenStep, lengths: np.ndarray, max_tokens: int, replicas: int, accum: int
) -> None:
    assert step.num_replicas == replicas
    counts = {len(step.local(rank)) for rank in range(replicas)}
    assert counts == {step.num_micro_steps}, "replicas must run the same number of micro-steps"
    if not step.final:
        assert step.num_micro_steps == accum
        assert step.num_padding == 0
    assert 1 <= step.num_micro_steps <= accum
    assert step.num_padding <= replicas - 1
    assert step.num_samples >= 1
    for replica in step.micro_batches:
        for mb in replica:
            assert mb.num_samples >= 1
            assert mb.padded_tokens <= max_tokens, "padded tokens exceed the budget"
            assert np.array_equal(mb.lengths, lengths[mb.indices])
            assert mb.max_length == int(lengths[mb.indices].max())
            assert mb.num_tokens == int(lengths[mb.indices].sum())
            if mb.is_padding:
                assert mb.num_samples == 1


def stream_for(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 1000).permutation(n)


distributions = st.sampled_from(["uniform", "lognormal", "bimodal", "constant", "long"])


# --------------------------------------------------------------------------- budget and lock-step


@PROPERTY
@given(
    kind=distributions,
    n=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    max_tokens=st.integers(16, 600),
    replicas=st.integers(1, 6),
    accum=st.integers(1, 3),
    window=st.integers(1, 400),
)
def test_every_micro_batch_fits_and_replicas_stay_in_lockstep(
    kind, n, seed, max_tokens, replicas, accum, window
):
    lengths = make_lengths(kind, n, seed, max_len=max_tokens + 50)
    planner = TokenBudgetPlanner(
        lengths, max_tokens, replicas, accum, window_size=window, seed=seed, on_oversize="skip"
    )
    steps = plan(planner, stream_for(n, seed))
    for step in steps:
        check_step(step, lengths, max_tokens, replicas, accum)
    assert sum(step.final for step in steps) == (1 if steps else 0)
    if steps:
        assert sorted(accounted(steps)) == list(range(n))
    else:  # nothing trainable: the skips were only logged and counted
        assert np.all(lengths > max_tokens)
    assert planner.num_skipped == int((lengths > max_tokens).sum())
    if steps:
        final = steps[-1].state
        assert final.finished
        assert final.samples_done == len(trained(steps))
        assert final.tokens_done == sum(s.num_tokens for s in steps)
        assert final.steps_done == len(steps)


def test_every_replica_derives_the_same_plan_independently():
    lengths = make_lengths("lognormal", 500, 3, 256)
    stream = stream_for(500, 3)
    plans = [
        plan(TokenBudgetPlanner(lengths, 256, 3, 2, window_size=64, seed=5), stream)
        for _ in range(3)
    ]
    for other in plans[1:]:
        assert len(other) == len(plans[0])
        for a, b in zip(plans[0], other):
            for ra, rb in zip(a.micro_batches, b.micro_batches):
                assert [mb.indices.tolist() for mb in ra] == [mb.indices.tolist() for mb in rb]


@PROPERTY
@given(
    kind=distributions,
    n=st.integers(1, 250),
    seed=st.integers(0, 2**16),
    replicas=st.integers(1, 5),
    accum=st.integers(1, 3),
)
def test_micro_batch_stream_does_not_depend_on_replica_count(kind, n, seed, replicas, accum):
    lengths = make_lengths(kind, n, seed, max_len=128)
    stream = stream_for(n, seed)
    serial = plan(TokenBudgetPlanner(lengths, 128, 1, 1, window_size=50, seed=seed), stream)
    sequence = [s.micro_batches[0][0].indices.tolist() for s in serial]
    parallel = plan(
        TokenBudgetPlanner(lengths, 128, replicas, accum, window_size=50, seed=seed), stream
    )
    per_step = replicas * accum
    for k, step in enumerate(parallel[:-1]):
        got = sorted(mb.indices.tolist() for replica in step.micro_batches for mb in replica)
        assert got == sorted(sequence[k * per_step : (k + 1) * per_step])
    assert len(parallel) == -(-len(sequence) // per_step)


def test_final_step_pads_at_most_replicas_minus_one_with_zero_weight():
    lengths = np.full(5, 100)  # each sample fills the budget alone
    planner = TokenBudgetPlanner(lengths, 100, num_replicas=4, window_size=8)
    steps = plan(planner, np.arange(5))
    assert len(steps) == 2 and steps[1].final
    last = steps[1]
    assert last.num_micro_steps == 1 and last.num_padding == 3 and last.num_samples == 1
    weights = loss_weights(last)
    assert np.count_nonzero(weights) == 1
    assert sorted(accounted(steps)) == list(range(5))
    assert last.state.padding_done == 3


def test_final_step_splits_micro_batches_before_padding():
    lengths = np.full(30, 10)  # 10 samples per micro-batch of 100 tokens: 3 micro-batches
    planner = TokenBudgetPlanner(lengths, 100, num_replicas=4, accumulation_steps=2, window_size=30)
    (step,) = plan(planner, np.arange(30))
    assert step.final and step.num_micro_steps == 1 and step.num_padding == 0
    assert sorted(trained([step])) == list(range(30))


def test_deal_balances_padded_tokens_largest_first():
    def mb(tokens: int) -> MicroBatch:
        return MicroBatch(np.array([0]), np.array([tokens]), tokens, tokens, False)

    batches = [mb(t) for t in (10, 9, 8, 7, 6, 5, 4, 3)]
    dealt = deal(batches, 2)
    loads = [sum(m.padded_tokens for m in replica) for replica in dealt]
    assert [len(replica) for replica in dealt] == [4, 4]
    assert loads == [26, 26]  # 10+7+6+3 and 9+8+5+4
    # accumulation keeps balance: lengths varying 3x still give near-equal work per replica
    lengths = make_lengths("lognormal", 4000, 11, 512)
    planner = TokenBudgetPlanner(
        lengths, 512, num_replicas=4, accumulation_steps=8, window_size=2000
    )
    for step in plan(planner, stream_for(4000, 11))[:-1]:
        per_replica = step.padded().sum(axis=1)
        assert per_replica.max() <= 1.15 * per_replica.mean()


# --------------------------------------------------------------------------- grouping and order


def sequential_packing(lengths: np.ndarray, max_tokens: int) -> tuple[int, int]:
    """Baseline without grouping: fill micro-batches in stream order. Returns (batches, padded)."""
    batches = padded = count = longest = 0
    for length in lengths.tolist():
        if (count + 1) * max(longest, length) > max_tokens:
            batches, padded = batches + 1, padded + count * longest
            count = longest = 0
        count, longest = count + 1, max(longest, length)
    return batches + 1, padded + count * longest


def test_length_grouping_cuts_padding_and_steps():
    lengths = make_lengths("lognormal", 20000, 7, 2048)
    stream = stream_for(20000, 7)
    steps = plan(TokenBudgetPlanner(lengths, 4096, window_size=8192), stream)
    grouped = sum(s.num_tokens for s in steps) / sum(s.padded_tokens for s in steps)
    batches, padded = sequential_packing(lengths[stream], 4096)
    assert grouped >= 0.95
    assert grouped > int(lengths.sum()) / padded + 0.2
    assert len(steps) < 0.75 * batches


def test_order_is_seeded_by_seed_and_epoch():
    lengths = make_lengths("uniform", 400, 1, 64)
    stream = stream_for(400, 1)

    def first_batches(seed: int, epoch: int) -> list[list[int]]:
        planner = TokenBudgetPlanner(lengths, 128, window_size=400, seed=seed)
        return [s.micro_batches[0][0].indices.tolist() for s in planner.plan_epoch(stream, epoch)][
            :10
        ]

    assert first_batches(1, 0) == first_batches(1, 0)
    assert first_batches(1, 0) != first_batches(2, 0)
    assert first_batches(1, 0) != first_batches(1, 1)


# --------------------------------------------------------------------------- resume


def resume_segments():
    return st.lists(
        st.tuples(
            st.integers(1, 5),  # replicas
            st.integers(1, 3),  # accumulation steps
            st.sampled_from([64, 100, 160]),  # max_tokens
            st.integers(0, 6),  # steps to run before the next "kill"
        ),
        min_size=1,
        max_size=6,
    )


@PROPERTY
@given(
    kind=distributions,
    n=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    window=st.integers(1, 120),
    segments=resume_segments(),
)
def test_each_sample_once_across_resumes_rescales_and_budget_changes(
    kind, n, seed, window, segments
):
    lengths = make_lengths(kind, n, seed, max_len=130)  # some exceed the smaller budgets
    stream = stream_for(n, seed)
    checkpoint = None
    steps: list[TokenStep] = []
    for replicas, accum, max_tokens, count in segments + [(2, 2, 160, None)]:
        planner = TokenBudgetPlanner(
            lengths, max_tokens, replicas, accum, window_size=window, seed=seed, on_oversize="skip"
        )
        segment = plan(planner, stream, state=checkpoint, limit=count)
        for step in segment:
            check_step(step, lengths, max_tokens, replicas, accum)
        steps += segment
        if segment:  # checkpoint through JSON, as a real checkpoint would
            checkpoint = json.loads(json.dumps(segment[-1].state.state_dict()))
    if steps:
        assert sorted(accounted(steps)) == list(range(n))
        assert checkpoint["finished"]
    else:
        assert np.all(lengths > 64)


def test_resume_with_same_budget_continues_the_same_micro_batches():
    lengths = make_lengths("bimodal", 600, 4, 200)
    stream = stream_for(600, 4)
    make = lambda r, a: TokenBudgetPlanner(
        lengths, 200, r, a, window_size=128, seed=9
    )  # noqa: E731
    whole = plan(make(1, 1), stream)
    sequence = [s.micro_batches[0][0].indices.tolist() for s in whole]
    head = plan(make(1, 1), stream, limit=37)
    tail = plan(make(3, 2), stream, state=head[-1].state.state_dict())
    resumed = [mb.indices.tolist() for s in tail for r in s.micro_batches for mb in r]
    assert sorted(resumed[: 6 * (len(tail) - 1)]) == sorted(sequence[37 : 37 + 6 * (len(tail) - 1)])
    assert sorted(accounted(head + tail)) == list(range(600))


def test_changing_budget_during_iteration_keeps_exact_once():
    lengths = make_lengths("lognormal", 800, 5, 100)
    planner = TokenBudgetPlanner(lengths, 100, 2, 1, window_size=300, on_oversize="skip")
    steps = []
    for step in planner.plan_epoch(stream_for(800, 5)):
        check_step(step, lengths, planner.max_tokens, 2, planner.accumulation_steps)
        steps.append(step)
        if len(steps) == 5:
            planner.max_tokens = 60  # e.g. chosen by the goodput model
            planner.accumulation_steps = 2
        if len(steps) == 20:
            planner.max_tokens = 250
    assert sorted(accounted(steps)) == list(range(800))
    assert any(
        s.num_micro_steps == 2 and max(mb.padded_tokens for r in s.micro_batches for mb in r) > 60
        for s in steps[20:]
    )


def test_finished_state_yields_nothing_and_checks_its_context():
    lengths = np.full(10, 5)
    planner = TokenBudgetPlanner(lengths, 20, window_size=4)
    steps = plan(planner, np.arange(10))
    done = steps[-1].state
    assert done.finished and list(planner.plan_epoch(np.arange(10), state=done)) == []
    with pytest.raises(ValueError, match="epoch=3 does not match"):
        planner.plan_epoch(np.arange(10), epoch=3, state=done)
    with pytest.raises(ValueError, match="window_size=4"):
        TokenBudgetPlanner(lengths, 20, window_size=5).plan_epoch(np.arange(10), state=done)
    with pytest.raises(ValueError, match="stream of 10 samples"):
        planner.plan_epoch(np.arange(9), state=steps[0].state)


def test_state_dict_round_trip_and_validation():
    lengths = np.full(50, 7)
    planner = TokenBudgetPlanner(lengths, 21, window_size=16)
    state = plan(planner, np.arange(50), limit=3)[-1].state
    saved = state.state_dict()
    assert TokenPlanState.from_state_dict(json.loads(json.dumps(saved))) == state
    with pytest.raises(ValueError, match="missing keys \\['window'\\]"):
        TokenPlanState.from_state_dict({k: v for k, v in saved.items() if k != "window"})
    with pytest.raises(ValueError, match="state\\['batches_done'\\] must be an integer >= 0"):
        TokenPlanState.from_state_dict({**saved, "batches_done": -1})
    with pytest.raises(ValueError, match="strictly increasing"):
        TokenPlanState.from_state_dict({**saved, "packed_max_tokens": 21, "excluded": [3, 2]})
    with pytest.raises(StateFormatError, match="version"):
        TokenPlanState.from_state_dict({**saved, "version": 99})
    with pytest.raises(TypeError, match="mapping"):
        TokenPlanState.from_state_dict([1, 2])


def test_state_saved_by_release_0_1_still_loads():
    """The exact dict TokenPlanState.state_dict() wrote in release 0.1 (format version 1)."""
    saved = {
        "version": 1, "epoch": 2, "window": 3, "batches_done": 4, "packed_max_tokens": 21,
        "excluded": [0, 5], "steps_done": 9, "samples_done": 40, "tokens_done": 280,
        "skipped_done": 1, "padding_done": 0, "finished": False, "window_size": 16, "seed": 7,
        "num_samples": 50,
    }  # fmt: skip
    state = TokenPlanState.from_state_dict(saved)
    assert state == TokenPlanState(2, 3, 4, 21, (0, 5), 9, 40, 280, 1, 0, False, 16, 7, 50)
    assert state.state_dict() == saved  # the current format is still version 1


def test_state_without_a_version_is_refused():
    saved = TokenPlanState().state_dict()
    del saved["version"]
    with pytest.raises(StateFormatError, match="no 'version' key"):
        TokenPlanState.from_state_dict(saved)
    with pytest.raises(StateFormatError, match="format version must be an integer"):
        TokenPlanState.from_state_dict({**TokenPlanState().state_dict(), "version": "1"})


# --------------------------------------------------------------------------- oversize samples


def test_oversize_error_names_sample_and_length():
    lengths = np.array([5, 5, 900, 5])
    planner = TokenBudgetPlanner(lengths, 512)
    with pytest.raises(
        OversizeSampleError, match="sample 2 has 900 tokens, more than max_tokens=512"
    ):
        plan(planner, np.arange(4))


def test_oversize_skip_reports_once_even_across_resume(caplog):
    lengths = np.array([5] * 40 + [900] * 3)
    stream = stream_for(43, 0)
    planner = TokenBudgetPlanner(lengths, 20, window_size=43, on_oversize="skip")
    with caplog.at_level(logging.WARNING, logger="adaptive.data.tokens.planner"):
        head = plan(planner, stream, limit=2)
    assert planner.num_skipped == 3
    assert sorted(head[0].skipped.tolist()) == [40, 41, 42]
    assert "skipping 3 samples longer than max_tokens=20" in caplog.text
    resumed = TokenBudgetPlanner(lengths, 20, window_size=43, on_oversize="skip")
    tail = plan(resumed, stream, state=head[-1].state)
    assert resumed.num_skipped == 0 and all(s.skipped.size == 0 for s in tail)
    assert sorted(accounted(head + tail)) == list(range(43))
    assert tail[-1].state.skipped_done == 3


# --------------------------------------------------------------------------- inputs


def test_streams_lengths_and_sources_are_interchangeable():
    from adaptive.data.sampler import GlobalPermutation

    table = make_lengths("lognormal", 700, 2, 300)
    permutation = GlobalPermutation(700, seed=3, epoch=1)
    array = permutation.take(0, 700)
    chunks = (array[i : i + 97] for i in range(0, 700, 97))

    def signature(lengths, stream) -> list[list[int]]:
        planner = TokenBudgetPlanner(lengths, 300, 2, window_size=128)
        return [
            mb.indices.tolist()
            for s in planner.plan_epoch(stream)
            for r in s.micro_batches
            for mb in r
        ]

    expected = signature(table, array)
    assert signature(table, permutation) == expected
    assert signature(table, chunks) == expected
    assert signature(table, array.tolist()) == expected
    assert signature(lambda i: int(table[i]), array) == expected
    assert signature(torch.from_numpy(table), torch.from_numpy(array)) == expected


def test_forward_only_stream_resumes_and_replans():
    table = make_lengths("lognormal", 900, 6, 200)
    array = stream_for(900, 6)
    head = plan(TokenBudgetPlanner(table, 200, 2, window_size=128), array, limit=25)
    state = head[-1].state
    assert state.window > 0 and state.batches_done > 0  # skip windows, resume mid-window

    def rest(stream, max_tokens: int) -> list[list[int]]:
        planner = TokenBudgetPlanner(table, max_tokens, 3, window_size=128)
        steps = plan(planner, stream, state=state)
        assert sorted(accounted(head + steps)) == list(range(900))
        return [mb.indices.tolist() for s in steps for r in s.micro_batches for mb in r]

    for max_tokens in (200, 300):  # same budget, and a budget change that re-packs a window
        chunks = iter([array[i : i + 50] for i in range(0, 900, 50)])
        assert rest(chunks, max_tokens) == rest(array, max_tokens)


@pytest.mark.parametrize(
    "lengths, error, message",
    [
        ([[1, 2]], ValueError, "lengths must be 1-D"),
        ([], ValueError, "must not be empty"),
        ([1.5, 2.0], TypeError, "must hold integers"),
        ([3, 0, 2], ValueError, r"lengths\[1\] = 0: sample lengths must be positive"),
        ([True, False], TypeError, "must hold integers"),
    ],
)
def test_length_table_validation(lengths, error, message):
    with pytest.raises(error, match=message):
        SampleLengths(lengths)


def test_length_function_and_index_validation():
    bad_value = TokenBudgetPlanner(lambda i: 0 if i == 3 else 4, 16)
    with pytest.raises(ValueError, match=r"lengths\(3\) returned must be an integer >= 1, got 0"):
        plan(bad_value, np.arange(5))
    bad_type = TokenBudgetPlanner(lambda i: 2.5, 16)
    with pytest.raises(TypeError, match=r"lengths\(0\) returned must be an integer >= 1, got float 2.5"):
        plan(bad_type, np.arange(5))
    out_of_range = TokenBudgetPlanner([3, 3], 16)
    with pytest.raises(IndexError, match="sample index 5 is out of range"):
        plan(out_of_range, np.array([0, 5]))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_tokens": 0}, ValueError, "max_tokens must be an integer >= 1"),
        ({"num_replicas": 0}, ValueError, "num_replicas must be an integer >= 1"),
        ({"accumulation_steps": 1.5}, TypeError, "accumulation_steps must be an integer"),
        ({"window_size": 0}, ValueError, "window_size must be an integer >= 1"),
        ({"on_oversize": "drop"}, ValueError, "on_oversize must be one of 'error', 'skip'"),
    ],
)
def test_planner_argument_validation(kwargs, error, message):
    with pytest.raises(error, match=message):
        TokenBudgetPlanner([1, 2, 3], **{"max_tokens": 8, **kwargs})


def test_bad_stream_type_is_rejected():
    with pytest.raises(TypeError, match="stream must be"):
        TokenBudgetPlanner([1, 2], 8).plan_epoch(object())
    with pytest.raises(ValueError, match="stream must be 1-D"):
        TokenBudgetPlanner([1, 2], 8).plan_epoch(np.zeros((2, 2), dtype=np.int64))


# --------------------------------------------------------------------------- gradient weighting


def _gradient_problem(seed: int = 0, n: int = 60, dim: int = 5):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=gen).numpy()
    features = [
        torch.randn(int(length), dim, generator=gen, dtype=torch.float64) for length in lengths
    ]
    targets = [torch.randn(int(length), generator=gen, dtype=torch.float64) for length in lengths]
    model = torch.nn.Linear(dim, 1).double()
    return lengths, features, targets, model


def _summed_loss(model, features, targets, indices, average_by: str) -> torch.Tensor:
    """Sum of per-token (or per-sample) losses over a padded, masked micro-batch."""
    longest = max(features[i].shape[0] for i in indices)
    dim = features[indices[0]].shape[1]
    x = torch.zeros(len(indices), longest, dim, dtype=torch.float64)
    y = torch.zeros(len(indices), longest, dtype=torch.float64)
    mask = torch.zeros(len(indices), longest, dtype=torch.float64)
    for row, i in enumerate(indices):
        x[row, : features[i].shape[0]] = features[i]
        y[row, : features[i].shape[0]] = targets[i]
        mask[row, : features[i].shape[0]] = 1.0
    per_token = (model(x).squeeze(-1) - y) ** 2 * mask
    if average_by == "tokens":
        return per_token.sum()
    return (per_token.sum(dim=1) / mask.sum(dim=1)).sum()


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("average_by", ["tokens", "samples"])
@pytest.mark.parametrize("replicas, accum", [(2, 1), (2, 3), (3, 2)])
def test_weighted_replica_gradients_equal_single_process_gradient(
    average_by, replicas, accum, reduction
):
    lengths, features, targets, model = _gradient_problem()
    planner = TokenBudgetPlanner(lengths, 48, replicas, accum, window_size=32, seed=1)
    steps = plan(planner, stream_for(len(lengths), 1))
    assert steps[-1].final
    for step in (steps[0], steps[-1]):
        real = [
            int(i) for r in step.micro_batches for mb in r if not mb.is_padding for i in mb.indices
        ]
        model.zero_grad()
        total = sum(int(lengths[i]) for i in real) if average_by == "tokens" else len(real)
        (_summed_loss(model, features, targets, real, average_by) / total).backward()
        reference = _flat_grad(model).clone()

        weights = loss_weights(step, average_by, loss_reduction=reduction)
        replica_grads = []
        for rank in range(replicas):
            model.zero_grad()
            for m, mb in enumerate(step.local(rank)):
                summed = _summed_loss(model, features, targets, mb.indices.tolist(), average_by)
                if reduction == "mean":  # what a default loss function returns
                    count = mb.num_tokens if average_by == "tokens" else mb.num_samples
                    summed = summed / count
                (float(weights[rank, m]) * summed).backward()  # accumulation: grads add up
                per_sample = sample_loss_weights(step, rank, m, average_by)
                assert np.allclose(per_sample, loss_weights(step, average_by)[rank, m])
            replica_grads.append(_flat_grad(model).clone())
        ddp_average = torch.stack(replica_grads).mean(dim=0)  # what DDP's all-reduce computes
        torch.testing.assert_close(ddp_average, reference, rtol=1e-12, atol=1e-12)


def test_padding_micro_batches_get_zero_weight_and_sum_reduction_drops_world_size():
    lengths = np.full(5, 100)
    _, last = plan(TokenBudgetPlanner(lengths, 100, num_replicas=4), np.arange(5))
    assert np.array_equal(last.padding_mask(), np.array([[False], [True], [True], [True]]))
    mean = loss_weights(last, "tokens", "mean")
    summed = loss_weights(last, "tokens", "sum")
    assert mean[0, 0] == pytest.approx(4 / 100) and summed[0, 0] == pytest.approx(1 / 100)
    assert np.all(mean[1:] == 0) and np.all(sample_loss_weights(last, 2, 0) == 0)
    with pytest.raises(ValueError, match="average_by must be one of 'tokens', 'samples'"):
        loss_weights(last, "batches")
    with pytest.raises(ValueError, match="gradient_reduction must be one of 'mean', 'sum'"):
        loss_weights(last, "tokens", "max")
    with pytest.raises(ValueError, match="loss_reduction must be one of 'sum', 'mean'"):
        loss_weights(last, loss_reduction="none")
    assert loss_weights(last, loss_reduction="mean")[0, 0] == pytest.approx(4 / 100 * 100)


def test_loader_and_planner_weights_are_the_same_rule():
    """adaptive.data.weighting.loss_weight (loader, any batching) agrees with loss_weights (token steps)."""
    from adaptive.data.steps import PlannedStep, StepShape
    from adaptive.data.weighting import loss_weight

    lengths = np.full(5, 100)
    _, last = plan(TokenBudgetPlanner(lengths, 100, num_replicas=4), np.arange(5))
    matrix = loss_weights(last, "tokens", "mean")
    for rank in range(4):
        local = last.local(rank)
        planned = PlannedStep(
            tuple(mb.indices.tolist() for mb in local), tuple(mb.is_padding for mb in local), "tokens",
            last.num_tokens, last.num_tokens, last.num_samples, last.num_tokens, last.padded_tokens,
            StepShape(100, 1), None,
        )  # fmt: skip
        for m in range(last.num_micro_steps):
            assert loss_weight(planned, m, last.num_tokens, last.num_replicas) == matrix[rank, m]


def test_planning_modules_import_without_torch():
    import subprocess
    import sys

    modules = (
        "adaptive.data.tokens.planner", "adaptive.data.tokens.batching", "adaptive.data.weighting",
        "adaptive.data.sampler", "adaptive.data.steps", "adaptive.data.sample_batches",
        "adaptive.batchsize.rampup", "adaptive.batchsize.rampup_specs", "adaptive.batchsize.step_lr_rules",
    )  # fmt: skip
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_step_lr_factor_rules_and_validation():
    assert step_lr_factor(2000, 1000, "linear") == pytest.approx(2.0)
    assert step_lr_factor(4000, 1000, "sqrt") == pytest.approx(2.0)
    assert step_lr_factor(123, 1000, "none") == 1.0
    with pytest.raises(ValueError, match="rule must be one of 'linear', 'sqrt', 'none'"):
        step_lr_factor(1, 1, "cubic")
    with pytest.raises(ValueError, match="actual_size must be a finite number > 0"):
        step_lr_factor(0, 1000)
    with pytest.raises(TypeError, match="reference_size must be a number > 0"):
        step_lr_factor(10, "1000")


# --------------------------------------------------------------------------- pinned orders
#
# Computed by the code before SplitMix64 moved to adaptive._utils.mix: the
# micro-batch stream of an epoch must never change, or a checkpointed
# TokenPlanState would point into a different order.


def _digest(values) -> str:
    import hashlib

    return hashlib.sha256(np.asarray(values, dtype="<i8").tobytes()).hexdigest()[:16]


def test_shuffle_keys_and_order_are_pinned():
    from adaptive.data.tokens._packing import shuffle_key, shuffle_order

    keys = {
        (0, 0, 0): 13963009076894779909,
        (1, 0, 0): 14630955873730480365,
        (0, 1, 0): 7731136592674158243,
        (0, 0, 1): 17155153220712016812,
        (2**64 - 1, 5, 123): 7748227279808967425,
    }
    for words, key in keys.items():
        assert shuffle_key(*words) == key
    assert shuffle_order(10, shuffle_key(3, 1, 2)).tolist() == [0, 3, 7, 1, 4, 5, 2, 6, 9, 8]


@pytest.mark.parametrize(
    "seed, epoch, window, max_tokens, count, head, digest, sizes_digest",
    [
        (0, 0, 512, 400, 411, [2167, 2749, 1973, 1585, 906, 2361], "02f9f694e0e51874", "dbf64ef41ca62b30"),
        (7, 2, 256, 1000, 174, [2721, 2430, 975, 2200, 260, 454], "491f7ae8ae682d11", "48885a785954f9b4"),
    ],
)
def test_micro_batch_stream_is_pinned(seed, epoch, window, max_tokens, count, head, digest, sizes_digest):
    from adaptive.data.sampler import GlobalPermutation

    lengths = (np.arange(3000) * 7919 % 97) + 1
    planner = TokenBudgetPlanner(lengths, max_tokens, 3, 2, window_size=window, seed=seed)
    stream = GlobalPermutation(3000, seed, epoch)
    batches = [mb.indices for s in planner.plan_epoch(stream, epoch=epoch) for r in s.micro_batches for mb in r]
    flat = np.concatenate(batches)
    assert len(batches) == count and flat[: len(head)].tolist() == head
    assert _digest(flat) == digest and _digest([b.size for b in batches]) == sizes_digest
