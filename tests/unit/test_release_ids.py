"""Release ids sort in the order their records started: "newest first" is a sort of ids."""

from __future__ import annotations

import re

from modelship.ledger import ReleaseRecord, new_release_id, sort_newest_first


def test_ids_made_within_one_second_sort_in_the_order_they_were_made() -> None:
    ids = [new_release_id() for _ in range(2000)]  # far more than one per microsecond
    assert len(set(ids)) == len(ids)
    assert sorted(ids) == ids


def test_the_newest_of_two_records_started_in_one_second_is_the_later_one() -> None:
    first = ReleaseRecord.start("swap", "m", from_version=1, to_version=2)
    second = ReleaseRecord.start("promote", "m", from_version=2, to_version=3)
    assert [r.id for r in sort_newest_first([first, second])] == [second.id, first.id]


def test_ids_of_the_seconds_only_form_sort_against_other_seconds_by_time() -> None:
    older, newer = "20261201T004455Z-ffffff", "20261201T004456000001Z-000000"
    assert sorted([newer, older]) == [older, newer]


def test_ids_keep_the_characters_names_built_from_them_allow() -> None:
    # e.g. tasks/approve.py's Prefect pause key, approval-<id, lowercased>-<n>: lowercase
    # letters, digits and dashes only (a "." was refused: FlowRunInput's key validator).
    assert re.fullmatch(r"[0-9]{8}T[0-9]{12}Z-[0-9a-f]{6}", new_release_id())
