"""A stack's ports come from below the kernel's ephemeral range, and a start that found one
taken tries again on new ports, not on the same ones.

A port picked by binding to port 0 lies in the ephemeral range: between its pick and its
server's bind, any outgoing connection (a client's, or the stack's own servers talking to
each other) can take it as its local end, and the server fails with 'address already in
use'. A clean-clone `make test` failed so (the canary Triton, twice in a row: the retry
reused the same saved ports, since nothing listened on the taken one)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelship.errors import StackError
from modelship.progress import quiet
from modelship.stack import manager, process
from modelship.stack.process import (
    EPHEMERAL_DEFAULT,
    GRPC_OFFSET,
    ephemeral_range,
    free_ports,
    pick_range,
)


@pytest.mark.parametrize(("ephemeral", "span"), [
    ((32768, 60999), (10000, 22768)),  # Linux's default
    ((49152, 65535), (10000, 39152)),  # IANA's
    ((15000, 65000), None),  # too little room below: the kernel picks
    ((1024, 65535), None),
    ((70000, 70001), (10000, 55536)),  # nonsense high: room for the +10000 gRPC ports
])
def test_the_range_a_stack_picks_from(ephemeral: tuple[int, int],
                                      span: tuple[int, int] | None) -> None:
    assert pick_range(ephemeral) == span


def test_the_ephemeral_range_is_read_from_proc_or_defaults(tmp_path: Path) -> None:
    given = tmp_path / "range"
    given.write_text("40000\t60000\n")
    assert ephemeral_range(given) == (40000, 60000)
    given.write_text("garbage")
    assert ephemeral_range(given) == EPHEMERAL_DEFAULT
    assert ephemeral_range(tmp_path / "missing") == EPHEMERAL_DEFAULT


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    ports = free_ports(30, avoid={10000})
    assert len(set(ports)) == 30 and 10000 not in ports
    span = pick_range(ephemeral_range())
    if span is not None:  # this machine leaves room below its ephemeral range
        assert all(span[0] <= p < span[1] for p in ports)
        assert max(ports) + GRPC_OFFSET < ephemeral_range()[0]
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if the port was not free


@pytest.fixture
def held() -> Iterator[int]:
    """A loopback port with a listener on it, inside the picking range."""
    low, high = pick_range(EPHEMERAL_DEFAULT) or (10000, 22768)
    for port in range(low + 5000, high):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        sock.listen(1)
        yield port
        sock.close()
        return
    pytest.skip("no port to hold")


def test_a_held_port_is_skipped_and_a_full_range_is_an_error(
        held: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "pick_range", lambda _: (held, held + 4))
    ports = free_ports(3)
    assert sorted(ports) == [held + 1, held + 2, held + 3]
    with pytest.raises(StackError, match=f"no 4 free loopback ports between {held}"):
        free_ports(4)


def test_a_start_again_after_a_taken_port_draws_new_ports(tmp_path: Path) -> None:
    home = tmp_path / ".modelship"
    (home / "data").mkdir(parents=True)
    first = manager._choose_ports(home, 1, None, quiet)  # saves them in the home
    again = manager._choose_ports(home, 1, None, quiet)
    assert again == first  # a restart keeps its links: the same ports when they are free
    fresh = manager._choose_ports(home, 1, None, quiet, reuse=False)
    used = {*first.seaweed.values(), first.mlflow, first.prefect, *first.triton[0]}
    assert not used & {*fresh.seaweed.values(), fresh.mlflow, fresh.prefect, *fresh.triton[0]}


def test_up_retries_a_taken_port_on_new_ports(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    calls: list[bool] = []

    def fake_up(*args: object, new_ports: bool = False) -> tuple[dict[str, object], object]:
        calls.append(new_ports)
        if not new_ports:
            raise StackError("canary exited: bind failed: Address already in use",
                             component="canary")
        return {}, None

    monkeypatch.setattr(manager, "_up_locked", fake_up)
    settings = manager.Settings(home=tmp_path / ".modelship")
    manager.up(settings, replicas=1)
    assert calls == [False, True]
