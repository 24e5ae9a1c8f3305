"""`modelship promote` with approval required, on the stack.

The release pauses after its gates and posts its approval request in the thread; a click
sent as Slack sends it (``modelship approvals click`` through the console script, signed
with the stack's secret, to the stack's ``approvals serve``) approves it, rejects it
(exit 5), or nobody clicks and it expires (exit 5, fail closed), also when Slack is down.
The release runs in the test process (:func:`tests.inprocess.run_inprocess`), the approver
beside it in a thread; each click is a real ``modelship approvals click`` process (its exit
code and JSON document), forked from one that imported the CLI once (:mod:`tests.zygote`).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelship.approvals.wire import APPROVE, parse_button_value
from modelship.settings import Settings
from tests import models
from tests.conftest import ROOT, cli_env
from tests.inprocess import beside, run_inprocess
from tests.policies import short_policy
from tests.zygote import Zygote

pytestmark = pytest.mark.e2e

MODEL = "cli-approvals"
#: The approval is tested here, not the canary nor the bake: the short release
#: (tests/policies.py; its canary's report, with the plot the approval request shows, is
#: written), no bake, and the swap's default batching pause.
POLICY = short_policy(canary={"max_duration_s": 20.0}, swap=None,
                      approval={"timeout_s": 300})
APPROVAL = ["--require-approval", "--approvers", "U0ALICE,S0APPROVERS",
            "--requested-by", "U0CAROL"]


def _promote(settings: Settings, policy: Path, version: int,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The release of ``version`` with approval required (in-process)."""
    return run_inprocess("promote", MODEL, "--version", str(version), "--policy", str(policy),
                         *APPROVAL, "--json", home=settings.home, env=env)


def _record(done: subprocess.CompletedProcess[str], code: int) -> dict[str, Any]:
    assert done.returncode == code, done.stderr[-4000:]
    doc = json.loads(done.stdout)
    return doc.get("details", {}).get("record", doc) if "error" in doc else doc


def _messages(settings: Settings) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{settings.slack_api_url}_emulator/messages",
                                timeout=10) as response:
        return list(json.loads(response.read())["messages"])


def _approval_message(settings: Settings, version: int, done: threading.Event
                      ) -> dict[str, Any]:
    """The approval request of ``MODEL vN`` once it is posted (the run is paused then)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert not done.is_set(), f"the release of v{version} ended before asking"
        for message in reversed(_messages(settings)):
            if message["text"].startswith(f"approval needed: {MODEL} v{version} "):
                return message
        time.sleep(0.5)
    raise AssertionError("no approval message was posted")


def _buttons(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for b in message["blocks"] if b["type"] == "actions" for e in b["elements"]]


@pytest.fixture(scope="module")
def clicker(stack_settings: Settings) -> Iterator[Zygote]:
    """``modelship`` imported once, in the environment a console-script run against the
    stack has; each click a process forked from it (a real ``modelship approvals click``
    run: its own pid, exit code, stdout and stderr), not an interpreter importing the CLI
    and Prefect again per click while the release waits."""
    with Zygote(target="modelship.cli:main",
                preload=("modelship.cli", "modelship.approvals.click"),
                env=cli_env(stack_settings.home), cwd=ROOT,
                prepare="tests.faults:cli_defaults") as zygote:
        yield zygote


def _click(clicker: Zygote, release: str, user: str, approve: bool) -> dict[str, Any]:
    done = clicker.run(["modelship", "approvals", "click", release, "--as", user,
                        "--approve" if approve else "--reject", "--json"], timeout=300)
    answer = json.loads(done.stdout)
    answer["exit_code"] = done.returncode
    return answer


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_policy(tmp_path_factory.mktemp("approvals") / "policy.yaml", POLICY)


def test_promote_waits_for_an_approver_and_a_rejection_exits_5(
        stack_settings: Settings, policy: Path, clicker: Zygote) -> None:
    uri = str(stack_settings.mlflow_tracking_uri)
    v1 = models.register_onnx(uri, MODEL, models.onnx_graph("softmax"))
    v2 = models.register_onnx(uri, MODEL, models.onnx_graph("softmax"))

    def approve(done: threading.Event) -> dict[str, Any]:
        message = _approval_message(stack_settings, v1, done)
        buttons = _buttons(message)
        assert [b["action_id"] for b in buttons][:1] == [APPROVE] and len(buttons) == 2
        release, digest = parse_button_value(buttons[0]["value"])
        assert digest["model"] == MODEL and digest["version"] == v1
        assert len(digest["onnx_sha256"]) == 64 and digest["canary_report_id"] == release
        assert any(b["type"] == "image" for b in message["blocks"])  # the canary plot
        assert message["thread_ts"]  # its own message, in the release's thread

        refused = _click(clicker, release, "U0CAROL", approve=True)  # four-eyes
        assert refused["exit_code"] == 2 and refused["error"] == "requester_cannot_approve"
        accepted = _click(clicker, release, "U0ALICE", approve=True)
        assert accepted["exit_code"] == 0 and accepted["status"] == "approved"
        return message

    with beside(approve) as approver:
        done = _promote(stack_settings, policy, v1)
    message = approver.result()  # first: what went wrong on the approver's side
    record = _record(done, 0)
    assert record["status"] == "released" and record["to_version"] == v1
    request = record["approvals"][0]
    assert (request["status"], request["decided_by"], request["channel"]) == (
        "approved", "U0ALICE", "slack")
    shown = next(m for m in _messages(stack_settings) if m["ts"] == message["ts"])
    assert not _buttons(shown) and "Approved by" in json.dumps(shown["blocks"])

    def reject(done: threading.Event) -> dict[str, Any]:
        message = _approval_message(stack_settings, v2, done)
        release, _ = parse_button_value(_buttons(message)[0]["value"])
        rejected = _click(clicker, release, "U0BOB", approve=False)
        assert rejected["exit_code"] == 0 and rejected["status"] == "rejected"
        return message

    with beside(reject) as rejecter:
        done = _promote(stack_settings, policy, v2)
    message = rejecter.result()
    record = _record(done, 5)
    assert record["status"] == "rejected" and record["exit_code"] == 5
    assert "U0BOB rejected" in record["reason"]
    status = json.loads(run_inprocess("status", MODEL, "--json",
                                      home=stack_settings.home).stdout)
    assert status["production_version"] == v1  # nothing changed
    shown = next(m for m in _messages(stack_settings) if m["ts"] == message["ts"])
    assert not _buttons(shown) and "Rejected by" in json.dumps(shown["blocks"])


def test_with_slack_down_nothing_approves_and_the_release_expires_closed(
        stack_settings: Settings, tmp_path: Path) -> None:
    """(With Slack up, expiry marks the message expired: tests/integration/
    test_approvals_flow.py, without a canary's minute.)"""
    uri = str(stack_settings.mlflow_tracking_uri)
    version = models.register_onnx(uri, MODEL, models.onnx_graph("softmax"))
    short = models.write_policy(tmp_path / "short.yaml",
                                {**POLICY, "approval": {"timeout_s": 3}})
    dead = {"MODELSHIP_SLACK_API_URL": "http://127.0.0.1:9/"}
    record = _record(_promote(stack_settings, short, version, env=dead), 5)
    assert record["status"] == "rejected" and "expired after 3 s" in record["reason"]
    assert "never reached Slack" in record["reason"]
    assert any("only the Prefect UI form can decide" in n for n in record["notes"])
    request = record["approvals"][0]
    assert request["status"] == "expired" and request["cleanup"] and not request["slack"]
    assert [s["name"] for s in record["stages"]][-1] == "approve"  # no swap
