"""Failures, classified once: transient or final, retried with a bound, translated into the
tree (:mod:`modelship.errors`).

A failure is **transient** when the same call may succeed a moment later (STYLE §7)::

    exception, anywhere in its __cause__/__context__ chain           transient
    ───────────────────────────────────────────────────────────────  ─────────
    Unreachable, or a ModelshipError with details["transient"]       yes
    ConnectionError (refused, reset, aborted), TimeoutError          yes
    urllib.error.URLError whose reason is one of those               yes
    requests ConnectionError / Timeout / ChunkedEncodingError        yes  (MLflow)
    requests RetryError after a 408/429/502/503/504 answer           yes  (MLflow)
    urllib3 NewConnectionError / ProtocolError / TimeoutError        yes
    MlflowException whose error code maps to 408/429/502/503/504     yes
    httpx TransportError (ConnectError, TimeoutException, ...)       yes  (Prefect)
    httpx HTTPStatusError with 408/429/502/503/504                   yes  (Prefect)
    botocore ConnectionError family, ReadTimeoutError,               yes  (S3)
      ConnectionClosedError
    botocore ClientError: a throttling code or 408/429/502/503/504   yes  (S3)
    a Triton/gRPC status UNAVAILABLE or DEADLINE_EXCEEDED            yes
    anything else (4xx, 500, a failed gate or validation, a bug)     no

Vendor classes are recognised by their qualified names, so classifying an error never
imports mlflow, botocore or httpx (the CLI's error path stays fast).

Retries happen **once, at the innermost idempotent call** (:func:`call_with_retries`), with
exponential backoff inside a time budget. An error that already used its retries says so
(``details["retried"]``), and :func:`tasks.retry.retry_transient` does not retry the whole
stage again: retries never multiply into a hang.
"""

from __future__ import annotations

import re
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from modelship.errors import InfrastructureError, ModelshipError, Unreachable

T = TypeVar("T")

#: HTTP answers after which the same request may succeed.
TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})
#: S3 error codes that mean "slow down" (botocore's standard retry mode retries them too).
THROTTLING_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "SlowDown", "TooManyRequestsException",
    "RequestLimitExceeded", "ProvisionedThroughputExceededException", "ServiceUnavailable",
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete",
})
#: Classes whose instances are transport failures, by qualified name.
TRANSIENT_CLASSES = frozenset({
    "builtins.ConnectionError", "builtins.TimeoutError",
    "requests.exceptions.ConnectionError", "requests.exceptions.Timeout",
    "requests.exceptions.ChunkedEncodingError",
    "urllib3.exceptions.NewConnectionError", "urllib3.exceptions.ProtocolError",
    "urllib3.exceptions.TimeoutError",
    "httpx.TransportError",
    "botocore.exceptions.ConnectionError", "botocore.exceptions.ReadTimeoutError",
    "botocore.exceptions.ConnectionClosedError",
})
_TRANSIENT_GRPC = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
_RETRY_STATUS = re.compile(r"too many (\d{3}) error responses")


def _names(exc: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}


def chain(exc: BaseException | None) -> Iterator[BaseException]:
    """The exception, then its causes and contexts (each once)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc: BaseException, names: set[str]) -> int | None:
    """The HTTP status an error reports, where its library keeps one."""
    if "httpx.HTTPStatusError" in names:
        return int(exc.response.status_code)  # type: ignore[attr-defined]
    if "botocore.exceptions.ClientError" in names:
        meta = exc.response.get("ResponseMetadata", {})  # type: ignore[attr-defined]
        status = meta.get("HTTPStatusCode")
        return int(status) if status else None
    if "mlflow.exceptions.MlflowException" in names:
        return int(exc.get_http_status_code())  # type: ignore[attr-defined]
    if "requests.exceptions.RetryError" in names:
        found = _RETRY_STATUS.search(str(exc))
        return int(found.group(1)) if found else None
    return None


def _transient_here(exc: BaseException) -> bool:
    """Whether this one exception (not its causes) is transient."""
    if isinstance(exc, ModelshipError):
        return isinstance(exc, Unreachable) or bool(exc.details.get("transient"))
    names = _names(exc)
    if names & TRANSIENT_CLASSES:
        return True
    if "urllib.error.URLError" in names:
        return isinstance(getattr(exc, "reason", None), ConnectionError | TimeoutError)
    if "botocore.exceptions.ClientError" in names:
        code = str(exc.response.get("Error", {}).get("Code", ""))  # type: ignore[attr-defined]
        if code in THROTTLING_CODES:
            return True
    if "tritonclient.utils.InferenceServerException" in names:
        status = str(exc.status() or "")  # type: ignore[attr-defined]
        return any(code in status for code in _TRANSIENT_GRPC)
    return _status(exc, names) in TRANSIENT_STATUS


def is_transient(exc: BaseException | None) -> bool:
    """An error that the same call may not raise a moment later (the table above).

    A modelship error decides for itself (its class and ``details["transient"]``); a vendor
    error is transient when it, or an error it was raised from, is.
    """
    if exc is None:
        return False
    if isinstance(exc, ModelshipError):
        return _transient_here(exc)
    return any(_transient_here(e) for e in chain(exc))


#: HTTP answers that mean "the server is up but busy now": the request never started.
BUSY_STATUS = frozenset({429, 503})


def is_busy(exc: BaseException | None) -> bool:
    """The server answered busy (429 or 503), here or anywhere in the chain: unlike a
    refused connection or a timeout, the server is up and did not start the request."""
    return any(_status(e, _names(e)) in BUSY_STATUS for e in chain(exc))


def endpoint_of(exc: BaseException) -> str | None:
    """The URL a transport error was talking to, when its library keeps it."""
    for error in chain(exc):
        if isinstance(error, ModelshipError) and error.details.get("endpoint"):
            return str(error.details["endpoint"])
        kwargs = getattr(error, "kwargs", None)  # botocore
        if isinstance(kwargs, dict) and kwargs.get("endpoint_url"):
            return str(kwargs["endpoint_url"])
        try:
            request = getattr(error, "request", None)  # httpx, requests
        except RuntimeError:  # httpx raises when the error carries no request
            request = None
        url = getattr(request, "url", None)
        if url:
            return str(url)
        found = re.search(r"https?://[^\s'\"()]+", str(error))
        if found:
            return found.group(0).rstrip(".,:;")
    return None


def reason(exc: BaseException) -> str:
    """The innermost cause's words: 'Connection refused' beats 'Max retries exceeded'."""
    innermost = list(chain(exc))[-1]
    text = str(innermost).strip() or type(innermost).__name__
    refused = re.search(r"\[Errno \d+\] ([^')\]]+)", text)
    return refused.group(1).strip() if refused else text[:300]


def translate(exc: BaseException, *, what: str | None = None,
              endpoint: str | None = None) -> ModelshipError:
    """Any exception as a member of the tree, for a message that names what failed.

    Args:
        exc: What was raised.
        what: The system or action it concerns, e.g. ``"MLflow"``; None when unknown.
        endpoint: The URL it talked to, when the caller knows it better than the error.

    Returns:
        ``exc`` itself when it is a :class:`ModelshipError`; :class:`Unreachable` (transient)
        for a transport failure, naming the endpoint; else :class:`InfrastructureError`
        naming the exception type (exit 1).
    """
    if isinstance(exc, ModelshipError):
        return exc
    url = endpoint or endpoint_of(exc)
    subject = what or "a server"
    if is_transient(exc):
        where = f"{subject} at {url}" if url else subject
        return Unreachable(
            f"{where} did not answer ({reason(exc)})",
            hint=f"check that {subject} is running and reachable (`modelship doctor`), "
            "then run the command again",
            endpoint=url, transient=True)
    text = str(exc).strip() or "(no message)"
    where = f" ({subject}{f' at {url}' if url else ''})" if what or url else ""
    return InfrastructureError(
        f"unexpected {type(exc).__name__}{where}: {text[:500]}",
        hint="nothing reported this failure on purpose: if it repeats, file an issue with "
        "the command and this line",
        error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        **({"endpoint": url} if url else {}))


def describe_traceback(exc: BaseException) -> str:
    """The formatted traceback, for a log file rather than the terminal."""
    return "".join(traceback.format_exception(exc))


# --------------------------------------------------------------------------------------
# bounded retries


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long one idempotent call is retried on a transient failure.

    Attributes:
        attempts: Tries in all, the first included.
        first_backoff_s: Wait before the second try, in seconds; doubled for each next one.
        max_backoff_s: Longest single wait, in seconds.
        budget_s: No new try starts later than this after the first began, in seconds, so
            one call ends within ``budget_s`` plus one request timeout.
    """

    attempts: int = 4
    first_backoff_s: float = 1.0
    max_backoff_s: float = 8.0
    budget_s: float = 20.0


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(attempts=1)


def next_backoff(policy: RetryPolicy, *, failed_attempts: int, elapsed_s: float) -> float | None:
    """Seconds to wait before the next try, or None to give up (pure).

    Args:
        policy: The bounds.
        failed_attempts: Tries made so far, all failed transiently (≥ 1).
        elapsed_s: Seconds since the first try began.
    """
    if failed_attempts >= policy.attempts:
        return None
    wait = min(policy.max_backoff_s, policy.first_backoff_s * 2 ** (failed_attempts - 1))
    if elapsed_s + wait > policy.budget_s:
        return None
    return wait


def call_with_retries(call: Callable[[], T], *, policy: RetryPolicy = DEFAULT_RETRY,
                      on_retry: Callable[[BaseException, float], None] | None = None,
                      sleep: Callable[[float], None] = time.sleep,
                      clock: Callable[[], float] = time.monotonic) -> T:
    """Run ``call``; on a transient failure try again with backoff, within the policy.

    The last failure is re-raised unchanged, with ``retried`` (tries made) recorded on it
    when it is a :class:`ModelshipError`, so no outer layer retries it again. A final
    (non-transient) failure is raised at once.
    """
    started = clock()
    failed = 0
    while True:
        try:
            return call()
        except Exception as exc:
            failed += 1
            wait = next_backoff(policy, failed_attempts=failed, elapsed_s=clock() - started) \
                if is_transient(exc) else None
            if wait is None:
                if isinstance(exc, ModelshipError) and failed > 1:
                    exc.details["retried"] = failed
                raise
            if on_retry is not None:
                on_retry(exc, wait)
            sleep(wait)


#: Class names (anywhere in an error's chain) that mean "the server took the connection or
#: the request and did not answer in time": a hung server, not a dead one.
TIMEOUT_CLASSES = frozenset({
    "builtins.TimeoutError", "requests.exceptions.Timeout", "urllib3.exceptions.TimeoutError",
    "botocore.exceptions.ReadTimeoutError", "botocore.exceptions.ConnectTimeoutError",
    "httpx.TimeoutException",
})


#: urllib3 derives its "could not connect" (a refused connection too) from its connect
#: timeout: that one is a timeout only when its own cause says so.
_NOT_A_TIMEOUT = "urllib3.exceptions.NewConnectionError"


def is_timeout(exc: BaseException | None) -> bool:
    """Whether an error, or one it was raised from, is a timeout (:data:`TIMEOUT_CLASSES`)."""
    for error in chain(exc):
        names = _names(error)
        if _NOT_A_TIMEOUT not in names and names & TIMEOUT_CLASSES:
            return True
    return False


@dataclass
class Breaker:
    """Stop waiting on a dependency that stopped answering, for a while (a circuit breaker).

    Retries bound one call; a command makes many. Against a hung server (it takes the
    connection and never answers) each call spends its whole timeout and retry budget, so
    a command that needs ten calls would hang for ten budgets. Once a call has spent its
    retries on timeouts, the breaker opens: the next calls to that dependency fail at once
    with the same error (marked ``retried``, so no outer layer retries it) until
    ``cooldown_s`` has passed; then one call may try again. A refused connection (a dead
    server) fails fast by itself and does not open it.

    Attributes:
        what: The dependency, for the message (``"MLflow"``, ``"S3"``).
        cooldown_s: How long calls fail fast after the dependency timed out, in seconds.
        clock: Monotonic seconds (a fake one in tests).
    """

    what: str
    cooldown_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _opened_at: float | None = None
    _cause: ModelshipError | None = None

    def check(self, action: str | None = None) -> None:
        """Raise :class:`Unreachable` at once while open (``action`` names the call it
        stops, when the caller knows it); do nothing while closed."""
        if self._opened_at is None or self._cause is None:
            return
        waited = self.clock() - self._opened_at
        if waited >= self.cooldown_s:
            return  # half-open: this call may try; its outcome closes or reopens it
        cause = self._cause
        asked = f"{self.what} was not asked to {action}: it" if action else self.what
        raise Unreachable(
            f"{asked} did not answer {waited:.0f} s ago ({reason(cause)}), so it is not "
            f"waited on again for {self.cooldown_s - waited:.0f} s",
            hint=cause.hint, **{**cause.details, "retried": cause.details.get("retried") or 1,
                                "breaker_open": True, "transient": True})

    def succeeded(self) -> None:
        """A call was answered: close the breaker."""
        self._opened_at, self._cause = None, None

    def failed(self, exc: BaseException, error: ModelshipError) -> None:
        """A call failed after its retries with ``exc`` (what the library raised), reported
        as ``error``: a timeout opens the breaker, anything else leaves it as it is."""
        if is_timeout(exc):
            self._opened_at, self._cause = self.clock(), error


def already_retried(exc: BaseException | None) -> bool:
    """Whether a call-level retry loop already spent its tries on this error."""
    return isinstance(exc, ModelshipError) and bool(exc.details.get("retried"))

