"""Slack approvals (DESIGN §2, stage 7): what a click carries, who may click, and the
interactivity endpoint that checks a click before a paused release resumes.

- :mod:`modelship.approvals.wire`: the bytes on the wire (button values, signed
  interactivity requests). Light: the Slack emulator's web view imports it too.
- :mod:`modelship.approvals.rules`: pure decisions (is this click valid for this pending
  approval?), shared by the endpoint and by the flow, which re-checks every decision it
  receives, the Prefect UI fallback included.
- :mod:`modelship.approvals.server`: ``modelship approvals serve``.
"""
