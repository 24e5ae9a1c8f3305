"""The ``modelship reconcile`` CLI's pure parts: its table, its exit code, its --watch loop."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest

from modelship.cli.fleet import _print_rounds, _reconcile_exit_code, _render_reconcile

LOADED: dict[str, Any] = {"model": "fraud", "version": 3, "ok": True,
          "replicas": [{"replica": "triton-0", "action": "load", "reason": "empty"},
                       {"replica": "triton-1", "action": "none", "reason": None}]}
FAILED: dict[str, Any] = {"model": "churn", "version": None, "ok": False, "exit_code": 4,
          "error": "manifest refused", "hint": "stage it again", "replicas": []}


@pytest.mark.parametrize(("models", "expected"), [
    ([], 0),
    ([LOADED], 0),
    ([LOADED, FAILED], 4),
    ([{**FAILED, "exit_code": None}], 1),
])
def test_exit_code_is_zero_or_the_worst_failed_models(models: list[dict[str, Any]],
                                                      expected: int) -> None:
    doc = {"ok": all(m["ok"] for m in models), "models": models, "changed": 0}
    assert _reconcile_exit_code(doc) == expected


def test_render_lists_each_replica_the_failures_and_what_changed() -> None:
    text = _render_reconcile({"ok": False, "models": [LOADED, FAILED], "changed": 1})
    lines = text.splitlines()
    assert any("triton-0" in line and "load" in line and "v3" in line for line in lines)
    assert "churn: manifest refused (stage it again)" in lines
    assert lines[-1] == "changed 1 replica(s)"


def test_render_of_a_dry_run_counts_the_loads_it_would_make() -> None:
    text = _render_reconcile({"ok": True, "dry_run": True, "models": [LOADED], "changed": 0})
    assert text.splitlines()[-1] == "dry run: would load 1 replica(s); nothing was changed"


def test_render_with_no_pinned_model_says_so() -> None:
    text = _render_reconcile({"ok": True, "models": [], "changed": 0})
    assert text.splitlines()[0] == "no model has a production pin yet: nothing to reconcile"


def test_watch_prints_a_json_line_per_round_and_exits_with_the_last_rounds_code() -> None:
    rounds = [{"ok": False, "models": [FAILED], "changed": 0},
              {"ok": True, "models": [LOADED], "changed": 1}]
    out = io.StringIO()
    assert _print_rounds(lambda: iter(rounds), as_json=True, stdout=out) == 0
    assert [json.loads(line) for line in out.getvalue().splitlines()] == rounds


def test_watch_stopped_by_ctrl_c_keeps_the_last_rounds_code() -> None:
    def interrupted() -> Iterator[dict[str, Any]]:
        yield {"ok": False, "models": [FAILED], "changed": 0}
        raise KeyboardInterrupt

    out = io.StringIO()
    assert _print_rounds(interrupted, as_json=False, stdout=out) == 4
    assert "churn: manifest refused" in out.getvalue()
