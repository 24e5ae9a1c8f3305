"""Retry only what is transient (STYLE §7): unreachable servers and timeouts, never a
failed validation or gate. Used as Prefect's ``retry_condition_fn`` on the idempotent
tasks of a release.

What is transient is decided in one place, :func:`modelship.faults.is_transient`. The
clients retry their own idempotent calls (MLflow, S3) within a time budget; a stage is
retried only for a transient error that no call-level loop retried already, so the two
layers never multiply into a hang.
"""

from __future__ import annotations

from typing import Any

from modelship.faults import already_retried, is_transient

TRANSIENT_RETRIES = 2

__all__ = ["TRANSIENT_RETRIES", "is_transient", "retry_transient", "stage_should_retry"]


def stage_should_retry(exc: BaseException | None) -> bool:
    """Whether a failed stage is worth running again (pure)."""
    return is_transient(exc) and not already_retried(exc)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: retry when the failed state holds a transient error."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - the state re-raises what the task raised
        return stage_should_retry(exc)
    return False
