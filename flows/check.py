"""The pre-deploy artifact gate, for the callers that name it here (``modelship check``,
``modelship stage``, tests and benchmarks): its stages live in :mod:`tasks.check`."""

from __future__ import annotations

from tasks.check import CheckReport, parse_ref, preflight, run_check, stage_checked

__all__ = ["CheckReport", "parse_ref", "preflight", "run_check", "stage_checked"]
