"""Standalone ``swap``, ``rollback`` and ``canary`` are journaled as a release is (issue 19
item 2): a ledger record with its stages, and one Slack thread (the stack's Slack emulator) whose
parent is updated in place and whose replies follow the stages.

Cheap: the session stack, one model with two small versions checked and staged once, and
three fleet changes (a first swap, a swap, a rollback) plus a no-op swap; then the
standalone canary of a third version (v1's bytes again: its check hits the check cache),
which it checks and stages itself.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from flows import standalone
from modelship.clients import build_clients
from modelship.ledger import Ledger, ReleaseRecord
from modelship.policy import Policy, SwapPolicy
from modelship.settings import Settings
from tasks.check import run_check
from tasks.evidence import read_candidate_digest
from tests import models
from tests.policies import ERROR_GATE, FIRST_ROUND_CANARY

pytestmark = pytest.mark.integration

MODEL = "standalone-journal"
#: The cheapest canary (tests/policies.py), given up to 60 s on a loaded machine.
CANARY = {"canary": {**FIRST_ROUND_CANARY, "max_duration_s": 60.0}, "gates": [ERROR_GATE]}
#: The fleet changes' policy: no batching pause (one reload per replica, not three; the
#: pause is test_swap's subject, the journal is this file's).
FLEET = Policy(swap=SwapPolicy(pause_batching=False))


def _messages(settings: Settings) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{str(settings.slack_api_url).rstrip('/')}/_emulator/messages",
                                timeout=10) as answer:
        doc = json.load(answer)
    return list(doc.get("messages", doc) if isinstance(doc, dict) else doc)


def _thread(settings: Settings, record: ReleaseRecord) -> tuple[dict[str, Any],
                                                                  list[str]]:
    """The release's parent message (as last updated) and the texts of its replies."""
    ts = record.slack.get("ts")
    assert ts, f"{record.kind} {record.id} opened no Slack thread: {record.slack}"
    messages = _messages(settings)
    parents = [m for m in messages if m.get("ts") == ts]
    replies = [str(m["text"]) for m in messages if m.get("thread_ts") == ts]
    assert parents, f"no parent message {ts} in the emulator"
    return parents[-1], replies


def test_standalone_swap_and_rollback_leave_a_record_with_stages_and_a_slack_thread(
        stack_settings: Settings, tmp_path: Path) -> None:
    settings = stack_settings
    assert settings.slack_api_url is not None, "the session stack runs the Slack emulator"
    clients = build_clients(settings)
    try:
        assert clients.slack is not None and clients.storage is not None
        uri = str(settings.mlflow_tracking_uri)
        v1, v2 = (models.register_sklearn(uri, MODEL, seed=seed, reuse=True) for seed in (0, 1))
        for version in (v1, v2):
            report = run_check(settings, clients, Policy(), model=MODEL, version=version,
                               workdir=tmp_path / f"v{version}", stage=True)
            assert report.verdict == "passed"
        ledger = Ledger(clients.storage)

        def swap(target: int) -> dict[str, Any]:
            return standalone.swap(settings, clients, FLEET, model=MODEL, target=target,
                                   force=True, requester="journal-test")

        first, second = swap(v1), swap(v2)
        rolled = standalone.rollback(settings, clients, FLEET, model=MODEL, to=None,
                                     requester="journal-test")
        noop = swap(v1)  # v1 serves again after the rollback: nothing to change
        assert (first["status"], second["status"], rolled["status"]) == (
            "released", "released", "released")
        assert noop["kind"] == "noop"

        for result, kind, stages in ((first, "swap", ["swap"]), (second, "swap", ["swap"]),
                                     (rolled, "rollback", ["swap"]),
                                     (noop, "swap", ["swap", "repair"])):
            record = ledger.read(MODEL, result["release_id"])
            assert record.kind == kind
            assert [s.name for s in record.stages] == stages
            assert all(s.outcome in ("ok", "skipped") and s.ended_at for s in record.stages)
            assert record.stages[0].details.get("kind") == result.get(
                "kind", result.get("swap", {}).get("kind"))
            parent, replies = _thread(settings, record)
            assert record.status in parent["text"], parent["text"]
            assert "swap ok" in replies, replies
            assert any(record.status in text for text in replies), replies
        assert ledger.read(MODEL, rolled["release_id"]).reason == f"rolled back from v{v2}"

        # the canary of a version not staged yet: it checks and stages it, then measures
        # it with what its check found (its ReleaseCandidate), journaled the same way. v3
        # holds v1's bytes (a new version, never staged): its check is the cache's pass
        # of those bytes, the journal is the subject here, not the check
        v3 = models.register_sklearn(uri, MODEL, seed=0, reuse=True)
        canaried = standalone.canary(settings, clients, Policy.model_validate(CANARY),
                                     model=MODEL, version=v3)
        assert (canaried["verdict"], canaried["baseline"]) == ("passed", v1), canaried
        record = ledger.read(MODEL, canaried["release_id"])
        assert (record.kind, record.status) == ("canary", "passed")
        assert [s.name for s in record.stages] == ["check", "stage", "canary"]
        assert all(s.outcome == "ok" and s.ended_at for s in record.stages), record.stages
        assert record.candidate == {**read_candidate_digest(
            clients.storage, repository_prefix=settings.repository_prefix, model=MODEL,
            version=v3), "canary_report_id": record.id}
        parent, replies = _thread(settings, record)
        assert "passed" in parent["text"], parent["text"]
        assert {"check ok", "stage ok", "canary ok"} <= set(replies), replies
    finally:
        clients.close()
