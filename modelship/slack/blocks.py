"""Block Kit messages of a release thread, built with ``slack_sdk.models.blocks``.

Pure functions of the release record (a plain dict, as the ledger stores it): the parent
message that shows the release's current state, and one reply per stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from slack_sdk.models.blocks import (
    ContextBlock,
    DividerBlock,
    HeaderBlock,
    MarkdownTextObject,
    SectionBlock,
)

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
        MarkdownTextObject(text=f"*Requested by*\n{record.get('requester') or 'unknown'} "
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
