"""The per-step agreement's record: each field combines over replicas as it declares."""

from __future__ import annotations

import dataclasses

import pytest

from adaptive.elastic.step_flags import Combine, StepFlags


def _agree(*replicas: StepFlags) -> StepFlags:
    """What the all-reduce (max) of the replicas' vectors decodes to."""
    vectors = [flags.encode() for flags in replicas]
    return StepFlags.decode([max(column) for column in zip(*vectors)])


def test_every_field_declares_how_it_combines_and_the_vector_is_as_wide_as_they_say() -> None:
    fields = [f for f in dataclasses.fields(StepFlags) if f.name != "mismatches"]
    assert all(isinstance(f.metadata.get("combine"), Combine) for f in fields)
    same = sum(f.metadata["combine"] is Combine.SAME for f in fields)
    assert StepFlags.width() == len(fields) + same == len(StepFlags().encode())


def test_any_takes_the_largest_smallest_the_smallest_and_same_reports_a_spread() -> None:
    rank0 = StepFlags(joins=2, drains=1, spacing=7, resumed_seq=4, folder_generation=3)
    rank1 = StepFlags(stop=True, leave=True, spacing=3, resumed_seq=4)
    agreed = _agree(rank0, rank1)
    assert (agreed.stop, agreed.leave, agreed.checkpoint_due) == (True, True, False)
    assert (agreed.joins, agreed.drains, agreed.folder_generation, agreed.spacing) == (2, 1, 3, 3)
    assert agreed.resumed_seq == 4 and agreed.mismatches == {}
    assert isinstance(agreed.stop, bool) and isinstance(agreed.joins, int)
    split = _agree(StepFlags(resumed_seq=-1), StepFlags(resumed_seq=5))
    assert split.mismatches == {"resumed_seq": (-1, 5)}


def test_a_round_trip_of_one_replica_is_itself_and_a_wrong_width_is_refused() -> None:
    flags = StepFlags(stop=True, checkpoint_due=True, spacing=12, resumed_seq=9, folder_generation=2,
                      newer_folder_generation=3, joins=1, leave=True, drains=2)
    assert StepFlags.decode(flags.encode()) == flags
    with pytest.raises(ValueError, match="expected"):
        StepFlags.decode([0.0])


def test_merged_carries_decisions_until_they_are_acted_on() -> None:
    carried = StepFlags(stop=True, joins=1, spacing=5)
    later = StepFlags(joins=3, drains=1, spacing=2, leave=False)
    merged = carried.merged(later, "stop", "joins", "drains")
    assert (merged.stop, merged.joins, merged.drains, merged.spacing) == (True, 3, 1, 5)  # spacing not carried
