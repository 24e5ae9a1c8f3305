"""Every way out of a command is one stderr line, one JSON document with --json, and an exit
code (modelship.output); a flow's own outcome survives Prefect failing to record it
(modelship.prefect_api.run_flow)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelship.errors import GateFailed, ReleaseCancelled, Unreachable
from modelship.faults import is_busy
from modelship.output import run_reporting
from modelship.prefect_api import keeps_outcome, run_flow
from modelship.signals import StopRequested


def _connect_error() -> BaseException:
    request = httpx.Request("POST", "http://127.0.0.1:4200/api/flow_runs/")
    try:
        try:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        except httpx.ConnectError as inner:
            raise RuntimeError("Failed to reach API at http://127.0.0.1:4200/api/") from inner
    except RuntimeError as outer:
        return outer


CASES: list[tuple[str, Any, int, str, str]] = [
    # name, what the body raises, exit code, JSON "error", words the line must hold
    ("gate", GateFailed("the gates stopped fraud v3", hint="production is unchanged"), 4,
     "GateFailed", "the gates stopped fraud v3. Production is unchanged."),
    ("prefect down", _connect_error(), 1, "Unreachable",
     "at http://127.0.0.1:4200/api/ did not answer (Connection refused)"),
    ("bug", KeyError("replicas"), 1, "InfrastructureError", "unexpected KeyError: 'replicas'"),
    ("sigterm", StopRequested(signal.SIGTERM), 143, "StopRequested", "stopped by SIGTERM"),
    ("ctrl-c", KeyboardInterrupt(), 130, "StopRequested", "stopped by SIGINT"),
    ("cancelled release", ReleaseCancelled("fraud v3 was undone", signum=signal.SIGTERM), 143,
     "ReleaseCancelled", "fraud v3 was undone"),
]


@pytest.mark.parametrize(("name", "error", "code", "kind", "words"), CASES,
                         ids=[c[0] for c in CASES])
@pytest.mark.parametrize("as_json", [True, False])
def test_any_exception_is_one_line_one_document_and_an_exit_code(
        name: str, error: BaseException, code: int, kind: str, words: str, as_json: bool,
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELSHIP_HOME", str(tmp_path))

    def action() -> dict[str, Any]:
        raise error

    assert run_reporting(action, as_json=as_json, render=str, to_json=dict) == code
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert "Traceback" not in out + err
    if as_json:
        document = json.loads(out)
        assert document["error"] == kind and document["exit_code"] == code
        assert document["message"] in err
    else:
        assert out == ""


def test_an_unexpected_error_keeps_its_traceback_in_a_log_not_on_the_terminal(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELSHIP_HOME", str(tmp_path))

    def action() -> None:
        {}["replicas"]  # noqa: B018 - the bug under test

    assert run_reporting(action, as_json=True, render=str, to_json=dict) == 1
    out, err = capsys.readouterr()
    log = tmp_path / "logs" / "errors.log"
    assert json.loads(out)["details"]["traceback"] == str(log)
    assert f"the traceback is in {log}" in err
    assert "Traceback (most recent call last)" in log.read_text()
    assert "KeyError: 'replicas'" in log.read_text()


def test_a_result_that_cannot_be_rendered_is_reported_like_any_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = run_reporting(lambda: {"replicas": []}, as_json=False,
                         render=lambda doc: doc["consistent"], to_json=dict)
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and "unexpected KeyError: 'consistent'" in err


def test_the_result_and_its_exit_code_when_nothing_fails(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = run_reporting(lambda: {"exit_code": 4}, as_json=True, render=str,
                         to_json=dict, exit_code=lambda d: int(d["exit_code"]))
    out, err = capsys.readouterr()
    assert code == 4 and json.loads(out) == {"exit_code": 4} and err == ""


# --------------------------------------------------------------------------------------
# the flow's outcome wins over a failure to record it


def _engine(body: Any, *, fails_after: BaseException | None) -> Any:
    """What Prefect's engine does around a flow body: run it, then report to the API."""

    def run() -> Any:
        try:
            value = body()
        except BaseException:
            if fails_after is not None:
                raise fails_after from None
            raise
        if fails_after is not None:
            raise fails_after
        return value

    return run


def test_a_release_that_succeeded_stays_a_success_when_prefect_cannot_record_it() -> None:
    body = keeps_outcome(lambda: {"status": "released", "exit_code": 0, "notes": []})
    record = run_flow(_engine(body, fails_after=_connect_error()), api_url=None)
    assert record["status"] == "released" and record["exit_code"] == 0
    assert len(record["notes"]) == 1
    assert "did not record the end of this flow run" in record["notes"][0]
    assert "http://127.0.0.1:4200/api/ did not answer" in record["notes"][0]


def test_a_release_that_failed_raises_its_own_error_not_the_engines() -> None:
    gate = GateFailed("the gates stopped fraud v3")

    def body() -> None:
        raise gate

    with pytest.raises(GateFailed) as caught:
        run_flow(_engine(keeps_outcome(body), fails_after=_connect_error()), api_url=None)
    assert caught.value is gate
    assert "did not record the end" in caught.value.details["notes"][0]


def test_a_failure_before_the_body_ran_is_the_engines_own() -> None:
    def engine() -> None:
        raise _connect_error()  # e.g. creating the flow run: the body never ran

    with pytest.raises(RuntimeError, match="Failed to reach API"):
        run_flow(engine, api_url=None)


def _busy() -> Exception:
    """What Prefect's client raises when its server answers 503 (SQLite locked)."""
    request = httpx.Request("POST", "http://127.0.0.1:4200/api/flow_runs/")
    return httpx.HTTPStatusError("Server error '503 Service Unavailable'", request=request,
                                 response=httpx.Response(503, request=request))


@pytest.mark.parametrize(("failures", "first", "ran"), [
    # (what the engine raises before the body on each try, the first error, body runs)
    (2, "busy", 1),        # busy twice at flow-run creation: started again, runs once
    (9, "busy", 0),        # busy on every try: the last answer is raised, after 3 pauses
    (1, "refused", 0),     # a refused API is not busy: raised at once, no second try
])
def test_a_flow_start_that_prefect_answered_busy_starts_again(
        failures: int, first: str, ran: int) -> None:
    tries: list[int] = []
    runs: list[int] = []
    body = keeps_outcome(lambda: runs.append(1) or {"status": "released", "notes": []})

    def engine() -> Any:
        tries.append(1)
        if len(tries) <= failures:
            raise _busy() if first == "busy" else _connect_error()
        return body()

    pauses = (0.0, 0.0, 0.0)
    if ran:
        assert run_flow(engine, api_url=None, busy_pauses_s=pauses)["status"] == "released"
    else:
        with pytest.raises(Exception) as caught:
            run_flow(engine, api_url=None, busy_pauses_s=pauses)
        assert is_busy(caught.value) == (first == "busy")
    assert len(runs) == ran
    assert len(tries) == (failures + 1 if ran else min(failures, len(pauses) + 1))


def test_a_busy_answer_after_the_body_started_is_never_a_second_run() -> None:
    """Only a flow none of which ran is started again: a body that began (and may have
    changed the fleet) and then met a busy API raises, once."""
    runs: list[int] = []

    def body() -> None:
        runs.append(1)
        raise _busy()

    with pytest.raises(httpx.HTTPStatusError):
        run_flow(keeps_outcome(body), api_url=None, busy_pauses_s=(0.0, 0.0))
    assert runs == [1]


def test_a_body_error_that_the_engine_reraises_passes_unchanged() -> None:
    down = Unreachable("S3 endpoint http://127.0.0.1:9 did not answer")

    def body() -> None:
        raise down

    with pytest.raises(Unreachable) as caught:
        run_flow(_engine(keeps_outcome(body), fails_after=None), api_url=None)
    assert caught.value is down and "notes" not in down.details


def test_a_flow_under_keeps_outcome_still_validates_its_parameters() -> None:
    """Prefect builds the parameter model from the decorated signature; the flow's own
    types (defined in its module, not in prefect_api) must resolve."""
    from flows.promote import PromoteParams, promote_flow

    checked = promote_flow.validate_parameters({"params": {"model": "m", "version": 3}})
    assert checked["params"] == PromoteParams(model="m", version=3)


def test_the_cli_keeps_prefects_run_logs_to_one_line(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import logging
    import sys

    from modelship.cli import _without_traceback, main

    monkeypatch.setattr("sys.argv", ["modelship", "--version"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("modelship ")
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        try:
            raise GateFailed("the gates stopped fraud v3")
        except GateFailed:
            record = logger.makeRecord(name, logging.ERROR, __file__, 1, "Encountered %r",
                                       (sys.exc_info()[1],), sys.exc_info())
        try:
            assert logger.filter(record)  # installed by main(), on the loggers Prefect uses
        finally:
            logger.removeFilter(_without_traceback)
        text = logging.Formatter().format(record)
        assert text == "Encountered GateFailed('the gates stopped fraud v3')", text


def test_a_worker_takes_back_prefects_retries_that_modelship_set_but_not_a_callers() -> None:
    """`modelship worker` and its flow runs ride out a busy Prefect (final run B: a worker's
    flow run crashed on a 503 after the CLI's one retry); a caller's own bound stays, also
    in a process started from a modelship process (the mark travels in the environment)."""
    from modelship.prefect_api import BOUNDED_CLIENT, service_env, set_client_defaults

    defaulted: dict[str, str] = {"PATH": "/bin"}
    set_client_defaults(defaulted)
    assert {k: defaulted[k] for k in BOUNDED_CLIENT} == BOUNDED_CLIENT
    child = dict(defaulted)
    set_client_defaults(child)  # a modelship process started from one: still defaults
    service = service_env(child)
    assert "PREFECT_CLIENT_MAX_RETRIES" not in service
    assert "PREFECT_API_REQUEST_TIMEOUT" not in service
    assert service["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] == "false"  # never an ephemeral
    assert service["PATH"] == "/bin"

    own = {"PREFECT_CLIENT_MAX_RETRIES": "3"}  # the caller's
    set_client_defaults(own)
    assert own["PREFECT_CLIENT_MAX_RETRIES"] == "3"
    assert service_env(own)["PREFECT_CLIENT_MAX_RETRIES"] == "3"
    assert "PREFECT_API_REQUEST_TIMEOUT" not in service_env(own)
