"""Block Kit messages of a release thread, built with ``slack_sdk.models.blocks``.

Pure functions of the release record (a plain dict, as the ledger stores it): the parent
message that shows the release's current state, one reply per stage, and the approval
request (canary numbers, the plot, Approve/Reject buttons bound to the candidate digest),
which is replaced by its outcome once decided.

Notices carry a severity, so that "still waiting" pings stay quiet (a context line) while
failures stand out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from slack_sdk.models.blocks import (
    ActionsBlock,
    ButtonElement,
    ContextBlock,
    DividerBlock,
    HeaderBlock,
    ImageBlock,
    MarkdownTextObject,
    SectionBlock,
)

from modelship.approvals.wire import APPROVE, REJECT, button_value

STATUS_ICON = {
    "running": ":hourglass_flowing_sand:", "released": ":white_check_mark:",
    "rejected": ":no_entry:", "failed": ":x:", "rolled_back": ":leftwards_arrow_with_hook:",
    "interrupted": ":warning:", "noop": ":white_check_mark:", "passed": ":white_check_mark:",
}
OUTCOME_ICON = {"ok": ":white_check_mark:", "failed": ":x:", "skipped": ":fast_forward:",
                "running": ":hourglass_flowing_sand:", "interrupted": ":warning:"}
MAX_TEXT = 2900  # Slack cuts section text at 3000 characters


def _v(version: Any) -> str:
    return "nothing" if version is None else f"v{version}"


def _who(user: Any) -> str:
    """A Slack user id as a mention (Slack shows the name), anything else as written."""
    if isinstance(user, str) and re.fullmatch(r"[UW][A-Z0-9]{2,}", user):
        return f"<@{user}>"
    return str(user or "unknown")


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 1] + "…"


def title(record: Mapping[str, Any]) -> str:
    """One line: what the release does, for notifications and the fallback text."""
    kind = record["kind"]
    return (f"{kind} {record['model']} {_v(record.get('from_version'))} -> "
            f"{_v(record.get('to_version'))}: {record['status']}")


def parent_blocks(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The thread's parent message: the release's current state, updated in place."""
    icon = STATUS_ICON.get(record["status"], ":grey_question:")
    stages = "  ".join(f"{OUTCOME_ICON.get(s['outcome'], '')} {s['name']}"
                       for s in record.get("stages", [])) or "starting"
    fields = [
        MarkdownTextObject(text=f"*Model*\n{record['model']}"),
        MarkdownTextObject(text=f"*Versions*\n{_v(record.get('from_version'))} → "
                           f"{_v(record.get('to_version'))}"),
        MarkdownTextObject(text=f"*Requested by*\n{_who(record.get('requester'))} "
                           f"({record.get('trigger')})"),
        MarkdownTextObject(text=f"*Status*\n{icon} {record['status']}"),
    ]
    blocks: list[Any] = [
        HeaderBlock(text=f"{record['kind'].capitalize()} {record['model']} "
                    f"{_v(record.get('to_version'))}"[:150]),
        SectionBlock(fields=fields),
        SectionBlock(text=MarkdownTextObject(text=_cut(f"*Stages* {stages}"))),
    ]
    if record.get("reason"):
        blocks.append(SectionBlock(text=MarkdownTextObject(
            text=_cut(f"*Why* {record['reason']}"))))
    blocks.append(ContextBlock(elements=[MarkdownTextObject(
        text=f"release `{record['id']}`" + (" · forced (no canary evidence)"
                                            if record.get("forced") else ""))]))
    return [b.to_dict() for b in blocks]


def stage_blocks(stage: Mapping[str, Any], *, next_step: str | None = None,
                 lines: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One reply for a stage that ended: its outcome, its reason, what to do next."""
    icon = OUTCOME_ICON.get(stage["outcome"], "")
    head = f"{icon} *{stage['name']}* {stage['outcome']}"
    if stage.get("reason"):
        head += f": {stage['reason']}"
    blocks: list[Any] = [SectionBlock(text=MarkdownTextObject(text=_cut(head)))]
    if lines:
        blocks.append(SectionBlock(text=MarkdownTextObject(text=_cut("\n".join(lines)))))
    if next_step:
        blocks.append(ContextBlock(elements=[MarkdownTextObject(
            text=_cut(f"Next: {next_step}"))]))
    return [b.to_dict() for b in blocks]


def gate_lines(gates: Mapping[str, Any]) -> list[str]:
    """The gate verdicts as short lines: rule, verdict, value against threshold."""
    lines = []
    for rule in gates.get("results", []):
        icon = {"passed": ":white_check_mark:", "failed": ":x:",
                "inconclusive": ":grey_question:", "error": ":warning:"}.get(
                    rule.get("verdict"), "")
        lines.append(f"{icon} `{rule.get('rule')}` {rule.get('verdict')}: "
                     f"{rule.get('message', '')}")
    return lines


def summary_blocks(record: Mapping[str, Any], links: Sequence[str]) -> list[dict[str, Any]]:
    """The last reply: the outcome and where to look."""
    icon = STATUS_ICON.get(record["status"], "")
    text = f"{icon} *{title(record)}* (exit {record.get('exit_code')})"
    blocks: list[Any] = [SectionBlock(text=MarkdownTextObject(text=_cut(text)))]
    if links:
        blocks.append(DividerBlock())
        blocks.append(ContextBlock(elements=[MarkdownTextObject(text=_cut(" · ".join(links)))]))
    return [b.to_dict() for b in blocks]


#: Severity of a notice: how loud it is in the thread.
SEVERITY_ICON = {"info": ":information_source:", "warning": ":warning:",
                 "critical": ":rotating_light:"}


def notice_blocks(text: str, severity: str = "info") -> list[dict[str, Any]]:
    """A notice in the thread; ``info`` is a quiet context line, the others a section."""
    icon = SEVERITY_ICON.get(severity, SEVERITY_ICON["info"])
    if severity == "info":
        return [ContextBlock(elements=[MarkdownTextObject(text=_cut(f"{icon} {text}"))]
                             ).to_dict()]
    return [SectionBlock(text=MarkdownTextObject(
        text=_cut(f"{icon} *{severity.upper()}* {text}"))).to_dict()]


def _approval_head(request: Mapping[str, Any], record: Mapping[str, Any]) -> list[Any]:
    digest = request.get("digest") or {}
    approvers = ", ".join(f"<@{a}>" if not str(a).startswith("S") else f"<!subteam^{a}>"
                          for a in request.get("approvers") or [])
    fields = [
        MarkdownTextObject(text=f"*Model*\n{digest.get('model')}"),
        MarkdownTextObject(text=f"*Versions*\n{_v(record.get('from_version'))} → "
                           f"{_v(digest.get('version'))}"),
        MarkdownTextObject(text=f"*Requested by*\n{_who(request.get('requester'))}"),
        MarkdownTextObject(text=f"*Approvers*\n{approvers or 'nobody'}"),
    ]
    gates = record.get("gates") or {}
    blocks: list[Any] = [
        HeaderBlock(text=f"Approve {digest.get('model')} {_v(digest.get('version'))}?"[:150]),
        SectionBlock(fields=fields),
    ]
    lines = gate_lines(gates)
    if lines:
        blocks.append(SectionBlock(text=MarkdownTextObject(
            text=_cut(f"*Canary* {gates.get('verdict')} against "
                      f"{_v(gates.get('baseline'))}\n" + "\n".join(lines)))))
    return blocks


def _digest_context(request: Mapping[str, Any]) -> Any:
    digest = request.get("digest") or {}
    return ContextBlock(elements=[MarkdownTextObject(text=_cut(
        f"release `{request.get('release_id')}` · onnx sha256 "
        f"`{str(digest.get('onnx_sha256'))[:16]}` · canary report "
        f"`{digest.get('canary_report_id')}`"))])


def approval_text(request: Mapping[str, Any]) -> str:
    """The fallback text of the approval message."""
    digest = request.get("digest") or {}
    return (f"approval needed: {digest.get('model')} {_v(digest.get('version'))} "
            f"(release {request.get('release_id')}): {request.get('status')}")


def approval_blocks(request: Mapping[str, Any], record: Mapping[str, Any], *,
                    file_id: str | None = None) -> list[dict[str, Any]]:
    """The approval request: canary numbers, the plot, and the two buttons.

    Both buttons carry the release id and the candidate digest, so a click approves
    exactly this candidate and nothing staged after it.
    """
    blocks = _approval_head(request, record)
    if file_id:
        blocks.append(ImageBlock(alt_text="canary report: latency and errors per version",
                                 slack_file={"id": file_id}))
    value = button_value(str(request["release_id"]), request.get("digest") or {})
    blocks.append(SectionBlock(text=MarkdownTextObject(text=_cut(
        f"Expires at {request.get('expires_at_iso')} (then the release is rejected)."))))
    blocks.append(ActionsBlock(block_id="approval", elements=[
        ButtonElement(text="Approve", action_id=APPROVE, value=value, style="primary"),
        ButtonElement(text="Reject", action_id=REJECT, value=value, style="danger"),
    ]))
    blocks.append(_digest_context(request))
    return [b.to_dict() for b in blocks]


def approval_outcome_blocks(request: Mapping[str, Any], record: Mapping[str, Any], *,
                            outcome: str, file_id: str | None = None
                            ) -> list[dict[str, Any]]:
    """The approval message once decided: the buttons replaced by the outcome."""
    blocks = _approval_head(request, record)
    if file_id:
        blocks.append(ImageBlock(alt_text="canary report: latency and errors per version",
                                 slack_file={"id": file_id}))
    icon = {"approved": ":white_check_mark:", "rejected": ":no_entry:",
            "expired": ":hourglass:"}.get(str(request.get("status")), ":grey_question:")
    blocks.append(SectionBlock(block_id="approval",
                               text=MarkdownTextObject(text=_cut(f"{icon} {outcome}"))))
    blocks.append(_digest_context(request))
    return [b.to_dict() for b in blocks]
