"""The Prefect API, as modelship needs it: its health, bounded client settings, and flow
runs whose outcome survives an API that went away.

Prefect's own client retries a refused connection (once it has connected) 5 times with
backoff 2^n s and waits 60 s for an answer: one call to a dead server costs about a minute,
and a release makes several after its last stage (the flow's final state, the record's
artifact, the lock's release), which is how a CLI once hung for 455 s. The CLI bounds them
with :data:`BOUNDED_CLIENT`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

from modelship.errors import InfrastructureError, ModelshipError
from modelship.faults import is_busy, is_transient, translate
from modelship.http import expect_ok

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

#: Prefect client settings for every modelship process (set as environment defaults by
#: the CLI, before Prefect is imported): one retry after 2 s and 10 s per request, so a call
#: to a refused API gives up in about 2 s, and one to a server that accepts but never
#: answers in about 22 s. And never an ephemeral server: Prefect's default starts one
#: (``python -m uvicorn``, a port in 8000-8999, seconds of CPU) for a client that has no API
#: URL, and a parent that is SIGKILLed leaves it running, owned by no stack.
BOUNDED_CLIENT = {"PREFECT_CLIENT_MAX_RETRIES": "1", "PREFECT_API_REQUEST_TIMEOUT": "10",
                  "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false"}
#: Of :data:`BOUNDED_CLIENT`, what a long-running Prefect service (``modelship worker`` and
#: the flow runs it starts) takes back to Prefect's own defaults, 5 retries with backoff and
#: 60 s a request: it must ride out a server that is busy (SQLite answers 503 while another
#: write holds it: a worker's flow run crashed so in a final run) or restarting, where a
#: command a person waits for should not.
SERVICE_UNBOUNDED = ("PREFECT_CLIENT_MAX_RETRIES", "PREFECT_API_REQUEST_TIMEOUT")
#: Lists the :data:`BOUNDED_CLIENT` keys a modelship process set as defaults (not the
#: caller), so a process started from it still tells its bounds from a caller's own.
DEFAULTED_MARK = "MODELSHIP_PREFECT_DEFAULTED"
#: Longest wait for queued run logs and events at the end of a flow run, in seconds.
FLUSH_TIMEOUT_S = 3.0
#: Pauses before starting a flow again whose start Prefect answered busy, in seconds.
#: Prefect's SQLite database answers 503 when a write meets another release's
#: (SQLITE_BUSY_SNAPSHOT, which its busy timeout does not cover), and the bounded client
#: retries once: two releases at once on one stack failed so at flow-run creation.
BUSY_START_PAUSES_S = (0.5, 1.0, 2.0, 4.0)
#: Reconnections of the run-events websocket per event (Prefect's default is 10).
EVENT_RECONNECTIONS = 1
#: :func:`pointed_at` blocks open now, in any thread: the events client is reset only when
#: the last one ends, so one thread's block never changes where another's run events go.
_OPEN_BLOCKS = [0]
_OPEN_BLOCKS_LOCK = threading.Lock()


def set_client_defaults(environ: MutableMapping[str, str]) -> None:
    """Set :data:`BOUNDED_CLIENT` where ``environ`` has no value of its own, and mark which
    were set here (:data:`DEFAULTED_MARK`)."""
    marked = set(filter(None, environ.get(DEFAULTED_MARK, "").split(",")))
    for key, value in BOUNDED_CLIENT.items():
        if key not in environ:
            environ[key] = value
            marked.add(key)
    if marked:
        environ[DEFAULTED_MARK] = ",".join(sorted(marked))


def service_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a long-running Prefect service (pure): the :data:`SERVICE_UNBOUNDED`
    bounds that modelship set as defaults are removed; a caller's own stay."""
    marked = set(env.get(DEFAULTED_MARK, "").split(","))
    return {key: value for key, value in env.items()
            if not (key in SERVICE_UNBOUNDED and key in marked)}


class PrefectApi:
    """One Prefect server. The constructor does no I/O.

    Args:
        api_url: The API base URL, e.g. ``http://127.0.0.1:4200/api``.
        timeout_s: Timeout of one request, in seconds.
    """

    def __init__(self, api_url: str, *, timeout_s: float) -> None:
        self.api_url = api_url.rstrip("/")
        self.timeout_s = timeout_s

    def ping(self) -> None:
        """Raise Unreachable/InfrastructureError unless ``/health`` answers 200."""
        expect_ok(f"{self.api_url}/health", timeout_s=self.timeout_s, what="the Prefect API")


def require_api(api_url: str | None) -> str:
    """The Prefect API a flow runs on, or an error that says how to get one (exit 1).

    Without one, Prefect's own "No Prefect API URL provided" would surface as an unexpected
    error (modelship never lets it start a private ephemeral server instead)."""
    if not api_url:
        raise InfrastructureError(
            "no Prefect API to run the flow on: no stack is up in MODELSHIP_HOME, and "
            "neither MODELSHIP_PREFECT_API_URL nor PREFECT_API_URL is set",
            hint="run `modelship stack up` (the embedded stack) and retry, or set "
            "PREFECT_API_URL to your Prefect server's API (e.g. http://127.0.0.1:4200/api)",
            component="prefect")
    return api_url


@contextmanager
def pointed_at(api_url: str | None) -> Iterator[None]:
    """Run Prefect code against ``api_url``, the stack's server (never an ephemeral one).

    Prefect reads its settings once at import, so setting ``PREFECT_API_URL`` later has no
    effect; ``temporary_settings`` is Prefect's own way to change them in a block.
    """
    if not api_url:
        yield
        return
    # lazy: prefect costs ~3 s at import; only a run pointed at a Prefect API needs it
    from prefect.events.clients import NullEventsClient, PrefectEventsClient
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Run events (task run states) go over a websocket whose client tries to reconnect 10
    # times, sleeping 1 s from the fourth try, for EACH queued event: against a dead server
    # that is ~8 s an event, paid at exit. Here: two tries an event, no sleep.
    with _OPEN_BLOCKS_LOCK:
        _OPEN_BLOCKS[0] += 1
        EventsWorker.set_client_override(PrefectEventsClient, api_url=api_url,
                                         reconnection_attempts=EVENT_RECONNECTIONS)
    # Outside the block, with no API URL of its own, Prefect would send a late run event to
    # an ephemeral server it starts for it (its events ignore
    # PREFECT_SERVER_ALLOW_EPHEMERAL_MODE): such events are dropped instead.
    after = None if PREFECT_API_URL.value() else NullEventsClient
    with temporary_settings({PREFECT_API_URL: api_url}):
        try:
            yield
        except Exception as exc:
            if isinstance(exc, ModelshipError) or not is_transient(exc):
                raise
            raise translate(exc, what="the Prefect API", endpoint=api_url) from exc
        finally:
            _flush_to_api()
            with _OPEN_BLOCKS_LOCK:
                _OPEN_BLOCKS[0] -= 1
                if not _OPEN_BLOCKS[0]:
                    EventsWorker.set_client_override(after)


def _flush_to_api(timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Send the queued run logs and events while the API URL still points at the stack.

    Left for interpreter exit, Prefect's background senders would run outside the block:
    with no API URL they start an ephemeral server to send to (seconds of exit time, and
    the logs land in the wrong place), and they warn about pending items on stderr.
    """
    # lazy: prefect costs ~3 s at import; only pointed_at's runs have senders to flush
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        try:
            service.drain_all(timeout=timeout_s, at_exit=False)
        except Exception:  # noqa: BLE001 - best effort: a log flush never fails a release
            pass


# --------------------------------------------------------------------------------------
# a flow's own outcome wins over a failure to report it

_OUTCOMES: ContextVar[list[tuple[str, Any]] | None] = ContextVar("modelship_flow_outcomes",
                                                                 default=None)


def keeps_outcome(fn: Callable[P, T]) -> Callable[P, T]:
    """Decorate a flow function (under ``@flow``) so that :func:`run_flow` learns what its
    body returned or raised, even when Prefect's engine then fails to record it."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        sink = _OUTCOMES.get()
        if sink is not None:
            sink.append(("started", None))
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:
            if sink is not None:
                sink.append(("raised", exc))
            raise
        if sink is not None:
            sink.append(("returned", value))
        return value

    # Prefect builds the flow's parameter model from this signature; resolved here, in the
    # flow's own module, because the wrapper's globals (this module) do not know its types.
    wrapper.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
    return wrapper


def run_flow(call: Callable[[], T], *, api_url: str | None,
             busy_pauses_s: tuple[float, ...] = BUSY_START_PAUSES_S) -> T:
    """Run a flow (``call``, a flow under :func:`keeps_outcome`) against ``api_url`` and
    return what its body returned.

    When the body finished but Prefect failed afterwards (the API went down: the final
    state, an artifact), the body's own outcome stands, with a note: a release that
    succeeded exits 0 and says that Prefect did not record it; a release that failed
    raises its own error, not the engine's. A failure before the body ran (Prefect down
    at the start) is :class:`~modelship.errors.Unreachable` naming the API; one where
    Prefect answered busy (:func:`modelship.faults.is_busy`) starts the flow again after
    each of ``busy_pauses_s``, since none of it ran.
    """
    for pause in (*busy_pauses_s, None):
        sink: list[tuple[str, Any]] = []
        try:
            return _run_once(call, api_url, sink)
        except Exception as exc:
            if sink or pause is None or not is_busy(exc):
                raise
            log.warning("Prefect at %s was busy creating the flow run (%s); starting it "
                        "again in %.1f s", api_url, translate(exc).message, pause)
        time.sleep(pause)
    raise AssertionError("unreachable: the last pass returns or raises")


def _run_once(call: Callable[[], T], api_url: str | None, sink: list[tuple[str, Any]]) -> T:
    """One pass of :func:`run_flow`; ``sink`` collects what the body did."""
    token = _OUTCOMES.set(sink)
    try:
        with pointed_at(api_url):
            return call()
    except Exception as exc:
        outcomes = [entry for entry in sink if entry[0] != "started"]
        if not outcomes or outcomes[-1][1] is exc or exc.__cause__ is outcomes[-1][1]:
            raise
        kind, value = outcomes[-1]
        note = (f"Prefect at {api_url} did not record the end of this flow run "
                f"({translate(exc).message}); the outcome here is the run's own, and the "
                "ledger holds its record")
        if kind == "raised":
            if isinstance(value, ModelshipError):
                value.details.setdefault("notes", []).append(note)
            raise value from exc
        if isinstance(value, dict):
            value.setdefault("notes", []).append(note)
        return value
    finally:
        _OUTCOMES.reset(token)
