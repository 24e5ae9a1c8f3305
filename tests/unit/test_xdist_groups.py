"""How `make test` shares the files out between its xdist workers (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests import conftest
from tests.conftest import FILE_SECONDS, xdist_groups

CRASH = "tests/e2e/test_crash.py"
PROMOTE = "tests/e2e/test_promote.py"


@pytest.fixture()
def split_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file cut in two (SPLIT) that weighs more than test_promote, less than twice it:
    the cut, not today's table (the fault matrix runs whole since its lanes)."""
    monkeypatch.setitem(conftest.SPLIT, CRASH, 2)
    monkeypatch.setitem(conftest.FILE_SECONDS, CRASH, FILE_SECONDS[PROMOTE] * 2.3)


def _ids(*paths: str) -> list[str]:
    return [f"{path}::test_{i}" for i, path in enumerate(paths)]


def test_one_group_per_file_heaviest_first_ties_in_collection_order() -> None:
    ids = _ids("tests/unit/test_a.py", "tests/unit/test_a.py", PROMOTE,
               "tests/integration/test_x.py", "tests/unit/test_b.py")
    assert xdist_groups(ids) == [
        (PROMOTE, [2]),                         # from FILE_SECONDS
        ("tests/integration/test_x.py", [3]),   # one integration test: 8 s
        ("tests/unit/test_a.py", [0, 1]),       # two unit tests: 0.2 s
        ("tests/unit/test_b.py", [4]),
    ]


@pytest.mark.usefixtures("split_crash")
def test_a_split_file_is_cut_into_consecutive_parts_each_weighted_by_its_share() -> None:
    ids = _ids(CRASH, CRASH, PROMOTE, CRASH, CRASH, CRASH)
    groups = xdist_groups(ids)
    # the first 3 of 5 cells and the last 2; test_promote weighs between their shares
    assert FILE_SECONDS[CRASH] * 3 / 5 > FILE_SECONDS[PROMOTE] > FILE_SECONDS[CRASH] * 2 / 5
    assert groups == [(f"{CRASH}-part1of2", [0, 1, 3]), (PROMOTE, [2]),
                      (f"{CRASH}-part2of2", [4, 5])]


@pytest.mark.usefixtures("split_crash")
def test_ordering_by_the_groups_then_grouping_again_gives_the_same_groups() -> None:
    """The workers reorder the collection by the groups; the scheduler groups what they
    collected: both must see the same groups."""
    ids = _ids(CRASH, "tests/unit/test_a.py", CRASH, PROMOTE, CRASH, CRASH, "tests/e2e/t.py")
    groups = xdist_groups(ids)
    ordered = [ids[i] for _, indices in groups for i in indices]
    again = xdist_groups(ordered)
    assert [(name, [ordered[i] for i in indices]) for name, indices in again] == \
        [(name, [ids[i] for i in indices]) for name, indices in groups]


def test_every_test_is_in_exactly_one_group() -> None:
    ids = _ids(*[p for p in FILE_SECONDS for _ in range(3)], *["tests/unit/t.py"] * 4)
    indices = sorted(i for _, group in xdist_groups(ids) for i in group)
    assert indices == list(range(len(ids)))
