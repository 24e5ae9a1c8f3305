"""Retry only what is transient (STYLE §7): unreachable servers and timeouts, never a
failed validation or gate. Used as Prefect's ``retry_condition_fn`` on the idempotent
tasks of a release."""

from __future__ import annotations

from typing import Any

from modelship.errors import ModelshipError, Unreachable

TRANSIENT_RETRIES = 2


def is_transient(exc: BaseException | None) -> bool:
    """An error that the same call may not raise a moment later."""
    if isinstance(exc, Unreachable):
        return True
    if isinstance(exc, ModelshipError):
        return bool(exc.details.get("transient"))
    return isinstance(exc, TimeoutError | ConnectionError)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: retry when the failed state holds a transient error."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - the state re-raises what the task raised
        return is_transient(exc)
    return False
