"""Transient or final, decided once (modelship.faults): the classification table, the
translation into the tree, and the bounded retry loop — with real vendor exceptions."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import urllib.error
from collections.abc import Iterator
from typing import Any

import botocore.exceptions
import httpx
import pytest
import requests
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    REQUEST_LIMIT_EXCEEDED,
    TEMPORARILY_UNAVAILABLE,
)

from model_registry.client import RegistryClient
from modelship.errors import (
    GateFailed,
    InfrastructureError,
    ModelshipError,
    Unreachable,
    ValidationFailed,
)
from modelship.faults import (
    RetryPolicy,
    call_with_retries,
    endpoint_of,
    is_transient,
    next_backoff,
    translate,
)
from modelship.storage import S3_ATTEMPTS, S3Storage
from tasks.retry import stage_should_retry

URL = "http://127.0.0.1:5000/api/2.0/mlflow/registered-models/get"


def _raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    """``outer`` raised while handling ``inner`` (implicit chaining, as MLflow does)."""
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 - the implicit __context__ is the point
    except BaseException as caught:
        return caught


def _httpx_status(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://127.0.0.1:4200/api/health")
    return httpx.HTTPStatusError("bad", request=request,
                                 response=httpx.Response(status, request=request))


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.mark.parametrize(("error", "transient"), [
    # the tree decides for itself
    (Unreachable("down"), True),
    (InfrastructureError("429", transient=True), True),
    (InfrastructureError("bad token"), False),
    (ValidationFailed("NaN outputs"), False),
    (GateFailed("p99 +40%"), False),
    # the standard library
    (ConnectionRefusedError(111, "Connection refused"), True),
    (ConnectionResetError(104, "Connection reset by peer"), True),
    (TimeoutError(), True),
    (TimeoutError(), True),
    (urllib.error.URLError(ConnectionRefusedError(111, "refused")), True),
    (urllib.error.URLError("unknown url type"), False),
    (ValueError("bug"), False),
    (KeyError("x"), False),
    # MLflow: requests' errors, wrapped the way MLflow wraps them
    (requests.exceptions.ConnectionError("refused"), True),
    (requests.exceptions.ReadTimeout("slow"), True),
    (_raised_from(MlflowException(f"API request to {URL} failed with exception refused"),
                  requests.exceptions.ConnectionError("Connection refused")), True),
    (_raised_from(MlflowException("API request failed"), requests.exceptions.RetryError(
        "Max retries exceeded (Caused by ResponseError('too many 503 error responses'))")),
     True),
    (_raised_from(MlflowException("API request failed"), requests.exceptions.RetryError(
        "Max retries exceeded (Caused by ResponseError('too many 500 error responses'))")),
     False),
    (MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE), True),
    (MlflowException("slow down", error_code=REQUEST_LIMIT_EXCEEDED), True),
    (MlflowException("bad name", error_code=INVALID_PARAMETER_VALUE), False),
    (MlflowException("RESOURCE_DOES_NOT_EXIST"), False),
    # Prefect: httpx
    (httpx.ConnectError("refused"), True),
    (httpx.ReadTimeout("slow"), True),
    (httpx.RemoteProtocolError("closed"), True),
    (_httpx_status(503), True),
    (_httpx_status(429), True),
    (_httpx_status(404), False),
    (_httpx_status(500), False),
    (_raised_from(RuntimeError("Failed to reach API at http://127.0.0.1:4200/api/"),
                  httpx.ConnectError("refused")), True),
    # S3: botocore
    (botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:8333"), True),
    (botocore.exceptions.ConnectTimeoutError(endpoint_url="http://127.0.0.1:8333"), True),
    (botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:8333"), True),
    (botocore.exceptions.ConnectionClosedError(endpoint_url="http://127.0.0.1:8333"), True),
    (_client_error("SlowDown", 503), True),
    (_client_error("Throttling", 400), True),
    (_client_error("ServiceUnavailable", 503), True),
    (_client_error("NoSuchKey", 404), False),
    (_client_error("AccessDenied", 403), False),
    (botocore.exceptions.NoCredentialsError(), False),
])
def test_transient_classification(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient
    assert stage_should_retry(error) is transient


def test_a_modelship_error_decides_for_itself_whatever_it_was_raised_from() -> None:
    final = _raised_from(ValidationFailed("bad rows"), ConnectionRefusedError())
    assert is_transient(final) is False


@pytest.mark.parametrize(("error", "endpoint"), [
    (botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:8333/b"),
     "http://127.0.0.1:8333/b"),
    (httpx.ConnectError("refused", request=httpx.Request("GET", "http://127.0.0.1:4200/api/x")),
     "http://127.0.0.1:4200/api/x"),
    (httpx.ConnectError("refused"), None),
    (_raised_from(MlflowException(f"API request to {URL} failed with exception x"),
                  requests.exceptions.ConnectionError("refused")), URL),
    (Unreachable("down", endpoint="http://127.0.0.1:9"), "http://127.0.0.1:9"),
    (ValueError("nothing here"), None),
])
def test_endpoint_of_names_the_url_a_failure_was_talking_to(error: BaseException,
                                                            endpoint: str | None) -> None:
    assert endpoint_of(error) == endpoint


def test_translate_makes_a_transport_failure_unreachable_naming_the_endpoint() -> None:
    cause = ConnectionRefusedError(111, "Connection refused")
    error = _raised_from(RuntimeError("Failed to reach API at http://127.0.0.1:4200/api/"),
                         httpx.ConnectError("[Errno 111] Connection refused"))
    translated = translate(error, what="the Prefect API")
    assert isinstance(translated, Unreachable) and translated.exit_code == 1
    assert translated.message == ("the Prefect API at http://127.0.0.1:4200/api/ did not "
                                  "answer (Connection refused)")
    assert translated.details == {"endpoint": "http://127.0.0.1:4200/api/", "transient": True}
    assert "modelship doctor" in (translated.hint or "")
    assert isinstance(translate(cause), Unreachable)


def test_translate_names_an_unexpected_exception_and_keeps_the_tree_as_it_is() -> None:
    bug = translate(KeyError("replicas"))
    assert type(bug) is InfrastructureError and bug.exit_code == 1
    assert bug.message == "unexpected KeyError: 'replicas'"
    assert bug.details["error_type"] == "builtins.KeyError"
    mine = GateFailed("p99 +40%")
    assert translate(mine) is mine
    assert translate(ValueError(""), what="MLflow").message == \
        "unexpected ValueError (MLflow): (no message)"


# --------------------------------------------------------------------------------------
# the bounded retry loop

POLICY = RetryPolicy(attempts=4, first_backoff_s=1.0, max_backoff_s=3.0, budget_s=10.0)


@pytest.mark.parametrize(("failed", "elapsed", "wait"), [
    (1, 0.0, 1.0),    # first retry after the first backoff
    (2, 1.0, 2.0),    # doubled
    (3, 3.0, 3.0),    # capped by max_backoff_s
    (4, 6.0, None),   # out of attempts
    (1, 9.5, None),   # the wait would end past the budget
    (2, 8.0, 2.0),    # ends exactly at the budget: still allowed
])
def test_next_backoff(failed: int, elapsed: float, wait: float | None) -> None:
    assert next_backoff(POLICY, failed_attempts=failed, elapsed_s=elapsed) == wait


class FakeTime:
    """A clock that only sleeping and the calls themselves advance."""

    def __init__(self, call_s: float) -> None:
        self.now = 0.0
        self.call_s = call_s
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


@pytest.mark.parametrize(("call_s", "sleeps", "calls"), [
    (0.0, [1.0, 2.0, 3.0], 4),  # refused at once: every attempt, backoff capped
    (4.0, [1.0], 2),            # each call times out after 4 s: the budget stops it early
])
def test_a_dead_server_is_retried_within_the_policy_and_the_error_says_so(
        call_s: float, sleeps: list[float], calls: int) -> None:
    fake = FakeTime(call_s)
    made: list[float] = []

    def call() -> None:
        made.append(fake.now)
        fake.now += fake.call_s
        raise Unreachable("MLflow at http://127.0.0.1:9 did not answer")

    with pytest.raises(Unreachable) as caught:
        call_with_retries(call, policy=POLICY, sleep=fake.sleep, clock=fake.clock)
    assert fake.sleeps == sleeps and len(made) == calls
    assert caught.value.details["retried"] == calls
    assert not stage_should_retry(caught.value)  # the stage does not multiply it
    assert fake.now <= POLICY.budget_s + call_s


def test_a_final_failure_is_not_retried_and_a_blip_is_survived() -> None:
    fake = FakeTime(0.0)
    tries: list[int] = []

    def final() -> None:
        tries.append(1)
        raise ValidationFailed("bad rows")

    with pytest.raises(ValidationFailed):
        call_with_retries(final, policy=POLICY, sleep=fake.sleep, clock=fake.clock)
    assert tries == [1] and fake.sleeps == []

    outcomes: list[Any] = [ConnectionResetError(104, "reset"), "ok"]

    def blip() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return str(outcome)

    assert call_with_retries(blip, policy=POLICY, sleep=fake.sleep, clock=fake.clock) == "ok"
    assert fake.sleeps == [1.0]


# --------------------------------------------------------------------------------------
# the clients, against real sockets


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


FAST = RetryPolicy(attempts=3, first_backoff_s=0.1, max_backoff_s=0.2, budget_s=2.0)


def test_mlflow_refused_is_unreachable_transient_and_retried_with_a_bound() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    client = RegistryClient(url, timeout_s=2, retry=FAST)
    started = time.monotonic()
    with pytest.raises(Unreachable) as caught:
        client.set_alias("fraud", "production", 3)  # the record stage's call
    assert time.monotonic() - started < 10
    error = caught.value
    assert error.message.startswith(f"MLflow at {url} did not answer while trying to point "
                                    "fraud@production at v3")
    assert "refused" in error.message.lower()
    assert error.details["transient"] is True and error.details["retried"] == 3
    assert error.details["endpoint"] == url


class _Flaky(http.server.BaseHTTPRequestHandler):
    """An MLflow registry that answers ``statuses`` in turn, then a registered model."""

    statuses: list[int] = []
    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        type(self).seen.append(self.path)
        status = type(self).statuses.pop(0) if type(self).statuses else 200
        body = {"registered_model": {"name": "fraud", "aliases": [
            {"alias": "production", "version": "3"}]}} if status == 200 else {
            "error_code": "TEMPORARILY_UNAVAILABLE" if status == 503 else "INTERNAL_ERROR",
            "message": "try later"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture()
def flaky_mlflow() -> Iterator[tuple[str, type[_Flaky]]]:
    handler = type("Handler", (_Flaky,), {"statuses": [], "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_mlflow_503_is_retried_and_500_is_final(
        flaky_mlflow: tuple[str, type[_Flaky]]) -> None:
    url, handler = flaky_mlflow
    client = RegistryClient(url, timeout_s=5, retry=FAST)
    handler.statuses[:] = [503, 503]
    assert client.aliases("fraud") == {"production": 3}
    assert len(handler.seen) == 3  # two 503s, then the answer
    handler.seen.clear()
    handler.statuses[:] = [500]
    with pytest.raises(InfrastructureError) as caught:
        client.aliases("fraud")
    assert not isinstance(caught.value, Unreachable) and not is_transient(caught.value)
    assert len(handler.seen) == 1


def test_s3_refused_is_unreachable_after_botocores_retries() -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    storage = S3Storage(endpoint=endpoint, bucket="b", access_key="k", secret_key="s",
                        timeout_s=2)
    started = time.monotonic()
    with pytest.raises(Unreachable) as caught:
        storage.get_bytes("releases/fraud/x.json")
    assert time.monotonic() - started < 15
    error: ModelshipError = caught.value
    assert error.message.startswith(f"S3 endpoint {endpoint} did not answer while trying to "
                                    "read s3://b/releases/fraud/x.json")
    assert error.details["retried"] == S3_ATTEMPTS and not stage_should_retry(error)


def test_a_server_that_never_answers_costs_the_budget_plus_one_timeout() -> None:
    with socket.socket() as hung:  # accepts connections (the backlog), never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        client = RegistryClient(url, timeout_s=1, retry=FAST)
        started = time.monotonic()
        with pytest.raises(Unreachable) as caught:
            client.aliases("fraud")
        took = time.monotonic() - started
    assert took < FAST.budget_s + 1 + 2, took  # budget, one request timeout, slack
    assert caught.value.details["retried"] >= 2 and "timed out" in caught.value.message
