"""Pure approval decisions: is this decision valid for the approval that waits now?

The same checks run in two places: in the interactivity endpoint before it resumes the
paused run, and in the flow on every input it receives, because the Prefect UI form (the
fallback channel) resumes the run without passing through the endpoint.

A pending approval is one entry of the release record's ``approvals`` list (so it is in
the ledger, in S3, and survives a restart of the approvals service)::

    {"kind": "request", "status": "pending" | "approved" | "rejected" | "expired",
     "release_id", "flow_run_id", "digest": {model, version, onnx_sha256, canary_report_id},
     "approvers": [U…, S…], "requester", "requested_at", "expires_at" (epoch s),
     "slack": {"channel", "ts"} | {}}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prefect.input import RunInput

from modelship.approvals.wire import approval_digest

Decision = Literal["approve", "reject"]
#: Resolves a Slack user group id (``S…``) to its members' user ids.
GroupResolver = Callable[[str], Sequence[str]]


class ApprovalInput(RunInput):
    """What a paused release receives when it is resumed (Slack click or Prefect UI form).

    The flow checks every field against the pending approval before acting on it.
    """

    decision: Decision
    user: str
    release_id: str
    digest: dict[str, Any]
    channel: str = "prefect-ui"
    reason: str | None = None
    at: str | None = None


@dataclass(frozen=True)
class Verdict:
    """The answer to one decision: accepted, or refused with a code and an HTTP status.

    Attributes:
        ok: The decision may resume the run.
        code: A short machine-readable reason (``not_an_approver``, ``stale_digest``…).
        status: The HTTP status the endpoint answers with.
        message: What the clicker is told, in words.
    """

    ok: bool
    code: str
    status: int
    message: str


def is_group(approver: str) -> bool:
    """Slack user group ids start with S (user ids with U or W)."""
    return approver.startswith("S")


def resolve_approvers(approvers: Iterable[str], resolve_group: GroupResolver | None
                      ) -> tuple[set[str], list[str]]:
    """The user ids allowed to approve, and the groups that could not be resolved.

    A group that cannot be resolved (Slack down, unknown group) grants nobody: fail closed.
    """
    users: set[str] = set()
    unresolved: list[str] = []
    for approver in approvers:
        if not is_group(approver):
            users.add(approver)
            continue
        if resolve_group is None:
            unresolved.append(approver)
            continue
        try:
            users.update(resolve_group(approver))
        except Exception:  # noqa: BLE001 - any failure to resolve grants nobody
            unresolved.append(approver)
    return users, unresolved


def check_decision(pending: Mapping[str, Any] | None, *, decision: str, user: str,
                   release_id: str, digest: Mapping[str, Any], allowed: set[str],
                   now: float) -> Verdict:
    """Whether ``user``'s ``decision`` for ``release_id``/``digest`` may resume the run.

    Checks, in order: an approval waits for this release; it has not expired; the click is
    bound to the candidate that waits now; the user may decide (approvers, and four-eyes:
    the requester can never approve, though they may reject their own release).
    """
    if decision not in ("approve", "reject"):
        return Verdict(False, "malformed_payload", 400, f"unknown decision {decision!r}")
    if pending is None or pending.get("release_id") != release_id:
        return Verdict(False, "no_pending_approval", 409,
                       f"release {release_id} has no approval waiting")
    if pending.get("status") != "pending":
        return Verdict(False, "already_decided", 409,
                       f"release {release_id} is already {pending.get('status')}")
    if float(pending.get("expires_at") or 0) <= now:
        return Verdict(False, "expired", 409,
                       f"the approval of release {release_id} expired")
    if approval_digest(digest) != approval_digest(pending.get("digest") or {}):
        return Verdict(False, "stale_digest", 409,
                       f"this button is for another candidate than the one waiting now "
                       f"({_short(digest)} vs {_short(pending.get('digest') or {})}); "
                       "use the newest approval message")
    requester = pending.get("requester")
    if decision == "approve" and user == requester:
        return Verdict(False, "requester_cannot_approve", 403,
                       f"<@{user}> asked for this release, so they cannot approve it "
                       "(four-eyes); another approver must")
    if user not in allowed and not (decision == "reject" and user == requester):
        return Verdict(False, "not_an_approver", 403,
                       f"<@{user}> is not an approver of {pending['digest'].get('model')}; "
                       f"the approvers are {', '.join(pending.get('approvers') or [])}")
    return Verdict(True, "ok", 200, f"{decision} by <@{user}>")


def _short(digest: Mapping[str, Any]) -> str:
    sha = str(digest.get("onnx_sha256") or "")[:12]
    return f"v{digest.get('version')} onnx {sha} canary {digest.get('canary_report_id')}"


def pending_entry(records_approvals: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The newest approval request of a record (pending or decided), or None."""
    for entry in reversed(records_approvals):
        if entry.get("kind") == "request":
            return dict(entry)
    return None
