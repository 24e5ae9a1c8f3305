"""The circuit breaker: a hung dependency costs one call's budget per cooldown, not one per
call (issue 18 item 4: every command ends within its stated timeout with a dependency down).

The pure part runs on a fake clock; the clients run against a real loopback socket that
takes connections and never answers (a hung server), and a closed port (a dead one)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from model_registry.client import RegistryClient
from modelship.errors import InfrastructureError, ModelshipError, Unreachable
from modelship.faults import Breaker, RetryPolicy, is_timeout
from modelship.locks import _S3Locks
from modelship.storage import S3Storage


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _timed_out() -> Unreachable:
    try:
        try:
            raise TimeoutError("timed out")
        except TimeoutError as exc:
            raise Unreachable("MLflow at http://x did not answer while trying to read v1",
                              hint="check MLflow", endpoint="http://x", transient=True,
                              retried=4) from exc
    except Unreachable as error:
        return error


def _refused() -> Unreachable:
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as exc:
            raise Unreachable("MLflow at http://x did not answer", endpoint="http://x",
                              transient=True) from exc
    except Unreachable as error:
        return error


@pytest.mark.parametrize(("error", "timeout"), [
    (TimeoutError("timed out"), True),
    (_timed_out(), True),
    (_refused(), False),
    (ConnectionResetError("reset"), False),
    (InfrastructureError("500 from MLflow"), False),
    (None, False),
])
def test_only_a_timeout_in_the_chain_is_a_timeout(error: BaseException | None,
                                                   timeout: bool) -> None:
    assert is_timeout(error) is timeout


def test_a_timeout_opens_it_until_the_cooldown_then_one_call_may_try() -> None:
    clock = Clock()
    breaker = Breaker("MLflow", cooldown_s=30.0, clock=clock)
    breaker.check("read v1")  # closed: nothing raised
    error = _timed_out()
    breaker.failed(error, error)
    clock.now += 12
    with pytest.raises(Unreachable) as raised:
        breaker.check("tag v1")
    message = raised.value.message
    assert message.startswith("MLflow was not asked to tag v1: it did not answer 12 s ago")
    assert "timed out" in message and "not waited on again for 18 s" in message
    details = raised.value.details
    assert details["breaker_open"] is True and details["retried"] == 4
    assert details["endpoint"] == "http://x" and details["transient"] is True
    assert raised.value.hint == "check MLflow"
    clock.now += 18  # the cooldown is over: half-open, this call may try
    breaker.check("tag v1")
    breaker.failed(error, error)  # and it timed out again: open for another cooldown
    with pytest.raises(Unreachable):
        breaker.check()
    breaker.succeeded()  # an answer closes it at once
    breaker.check()


@pytest.mark.parametrize("error", [_refused(), InfrastructureError("500 from MLflow")])
def test_a_dead_server_or_an_answer_does_not_open_it(error: Exception) -> None:
    breaker = Breaker("MLflow", clock=Clock())
    assert isinstance(error, Unreachable | InfrastructureError)
    breaker.failed(error, error)
    breaker.check("read v1")  # a refused connection fails fast by itself


# --------------------------------------------------------------------------------------
# the clients against a hung loopback server


@pytest.fixture
def hung_url() -> Iterator[str]:
    """A server that takes connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _elapsed(call: object) -> tuple[float, Unreachable]:
    started = time.monotonic()
    with pytest.raises(Unreachable) as raised:
        call()  # type: ignore[operator]
    return time.monotonic() - started, raised.value


def test_a_hung_mlflow_is_waited_on_once(hung_url: str) -> None:
    registry = RegistryClient(hung_url, timeout_s=1.0,
                              retry=RetryPolicy(attempts=2, first_backoff_s=0.1, budget_s=1.0))
    first_s, first = _elapsed(lambda: registry.aliases("fraud"))
    assert first_s >= 1.0 and hung_url in first.message and not first.details.get("breaker_open")
    second_s, second = _elapsed(lambda: registry.version_tags("fraud", 3))
    assert second_s < 0.5, second_s
    assert second.details["breaker_open"] is True and second.details["endpoint"] == hung_url
    assert "MLflow was not asked to read the tags of fraud v3" in second.message


def test_a_hung_s3_is_waited_on_once(hung_url: str) -> None:
    storage = S3Storage(endpoint=hung_url, bucket="modelship", access_key="key",
                        secret_key="secret", timeout_s=0.5)
    first_s, first = _elapsed(lambda: storage.get_bytes("releases/fraud/a.json"))
    assert first_s >= 0.5 and hung_url in first.message
    second_s, second = _elapsed(lambda: list(storage.list_keys("releases/fraud/")))
    assert second_s < 0.5, second_s
    assert second.message.startswith(f"S3 endpoint {hung_url} was not asked to list "
                                     "s3://modelship/releases/fraud/: S3 did not answer")
    assert second.details["breaker_open"] is True and second.details["retried"]


def test_a_dead_mlflow_is_asked_every_time() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens: connections are refused at once
    registry = RegistryClient(f"http://127.0.0.1:{port}", timeout_s=1.0,
                              retry=RetryPolicy(attempts=1))
    for _ in range(2):
        _, error = _elapsed(lambda: registry.aliases("fraud"))
        assert not error.details.get("breaker_open"), error.details


def test_a_hung_s3_under_the_lock_is_waited_on_once(hung_url: str) -> None:
    locks = _S3Locks(S3Storage(endpoint=hung_url, bucket="modelship", access_key="key",
                               secret_key="secret", timeout_s=0.5))
    for bound_s in (60.0, 0.5):  # the first read spends its tries; the second is refused
        started = time.monotonic()
        with pytest.raises(ModelshipError) as raised:
            locks.read("locks/release/fraud.json")
        assert time.monotonic() - started < bound_s
        assert hung_url in raised.value.message
    assert "did not answer" in raised.value.message and "not waited on again" in \
        raised.value.message
