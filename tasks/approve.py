"""Stage 7, approve: the seam where a human approves the candidate (DESIGN §2).

The Slack approvals channel (``modelship approvals serve``, the paused flow run and its
RunInput) is not built yet. Until it is, a release that needs approval is refused here
with exit 2, after its canary, instead of going ahead unapproved: approval is fail-closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelship.errors import ApprovalUnavailable
from modelship.policy import ApprovalPolicy


@dataclass(frozen=True)
class ApprovalRequest:
    """What this release needs: the policy's approval, with the CLI's overrides applied.

    Attributes:
        required: An approval click must come before the swap.
        approvers: Slack user ids allowed to approve.
        requester: Who asked for the release; never allowed to approve it (four-eyes).
        timeout_s: Seconds before the request expires and the release fails closed.
    """

    required: bool
    approvers: tuple[str, ...] = ()
    requester: str | None = None
    timeout_s: int = 3600
    digest: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"required": self.required, "approvers": list(self.approvers),
                "requester": self.requester, "timeout_s": self.timeout_s}


def approval_request(policy: ApprovalPolicy, *, require: bool | None = None,
                     approvers: list[str] | None = None,
                     requester: str | None = None) -> ApprovalRequest:
    """The policy's approval with ``--require-approval`` / ``--approvers`` applied (pure)."""
    return ApprovalRequest(
        required=policy.required if require is None else require or policy.required,
        approvers=tuple(approvers if approvers else policy.approvers),
        requester=requester, timeout_s=policy.timeout_s)


def approve(request: ApprovalRequest, *, model: str, version: int) -> dict[str, Any]:
    """Pass through a release that needs no approval; refuse one that does (fail closed).

    Raises:
        ApprovalUnavailable: approval is required, and no approval channel exists yet.
    """
    if not request.required:
        return {"required": False, "decision": "not required"}
    raise ApprovalUnavailable(
        f"{model} v{version} needs an approval (approval.required or --require-approval), "
        "and this modelship has no approval channel yet, so it will not swap unapproved",
        hint="release it without the approval requirement (a policy with approval.required: "
        "false), or wait for Slack approvals; production was not changed",
        model=model, version=version)
