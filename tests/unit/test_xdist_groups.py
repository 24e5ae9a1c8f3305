"""How `make test` shares the files out between its xdist workers (tests/conftest.py)."""

from __future__ import annotations

from tests.conftest import FILE_SECONDS, SPLIT, xdist_groups

CRASH = "tests/e2e/test_crash.py"
PROMOTE = "tests/e2e/test_promote.py"


def _unmarked(*paths: str) -> list[tuple[str, str | None]]:
    return [(path, None) for path in paths]


def test_one_group_per_file_heaviest_first_ties_in_collection_order() -> None:
    tests = _unmarked("tests/unit/test_a.py", "tests/unit/test_a.py", PROMOTE,
                      "tests/integration/test_x.py", "tests/unit/test_b.py")
    assert xdist_groups(tests) == [
        (PROMOTE, [2]),                         # from FILE_SECONDS
        ("tests/integration/test_x.py", [3]),   # one integration test: 8 s
        ("tests/unit/test_a.py", [0, 1]),       # two unit tests: 0.2 s
        ("tests/unit/test_b.py", [4]),
    ]


def test_a_split_file_is_dealt_round_robin_into_its_parts_each_weighted_by_its_share() -> None:
    assert SPLIT[CRASH] == 2
    groups = xdist_groups(_unmarked(*[CRASH] * 5, PROMOTE))
    # 3/5 and 2/5 of the file's seconds, with test_promote's between them
    assert FILE_SECONDS[CRASH] * 3 / 5 > FILE_SECONDS[PROMOTE] > FILE_SECONDS[CRASH] * 2 / 5
    assert groups == [(f"{CRASH}-part1of2", [0, 2, 4]), (PROMOTE, [5]),
                      (f"{CRASH}-part2of2", [1, 3])]
    # xdist takes the text after the last '@' of a nodeid as its group, unless a ']' comes
    # later (a parametrized id): a group name must hold neither
    assert not any(set(name) & {"@", "]"} for name, _ in groups)


def test_a_test_marked_with_its_own_group_stays_in_it_and_the_rest_of_its_file_is_not_cut() -> None:
    tests = [(CRASH, "crash-a"), (CRASH, "crash-b"), (CRASH, "crash-a"), (CRASH, None),
             (PROMOTE, None)]
    assert xdist_groups(tests) == [
        ("crash-a", [0, 2]), (PROMOTE, [4]), ("crash-b", [1]),
        (f"{CRASH}-part1of2", [3]),  # an unmarked cell of a marked file: still a share
    ]


def test_every_test_is_in_exactly_one_group() -> None:
    tests = _unmarked(*[p for p in FILE_SECONDS for _ in range(3)], *["tests/unit/t.py"] * 4)
    indices = sorted(i for _, group in xdist_groups(tests) for i in group)
    assert indices == list(range(len(tests)))
