"""``modelship approvals serve | click``: the Slack interactivity endpoint, and a local
click for the embedded stack."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from modelship.cli._common import JsonOpt, app, finish, run_reporting, settings
from modelship.errors import ModelshipError

approvals_app = typer.Typer(help="Slack approvals: the interactivity endpoint.",
                            no_args_is_help=True)
app.add_typer(approvals_app, name="approvals")


@approvals_app.command("serve")
def serve(host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
          port: Annotated[int, typer.Option(help="Port; 0 picks a free one.")] = 8090,
          audit_log: Annotated[Path | None, typer.Option(
              help="Audit log (JSON lines) of every refusal and decision; default "
              "$MODELSHIP_HOME/logs/approvals-audit.jsonl.")] = None) -> None:
    """The Slack interactivity endpoint: checks each click, then resumes the paused run.

    Prints one JSON line on stdout once it listens ({"event": "listening", "url": ...}),
    and stops on SIGTERM or SIGINT.
    """
    # lazy: the approvals service pulls prefect (~3 s); only when a command runs
    from modelship.approvals.server import build_service
    from modelship.approvals.server import serve as run

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        current = settings()
        path: Path | None = audit_log or current.home / "logs" / "approvals-audit.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
        except OSError as exc:  # a read-only filesystem (a pod): the log goes to stderr only
            print(f"approvals: no audit file ({exc}); audit lines go to stderr",
                  file=sys.stderr)
            path = None
        service = build_service(current, audit_path=path)
    except ModelshipError as exc:
        print(f"error: {exc}", file=sys.stderr)
        finish(exc.exit_code)
        return
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def ready(url: str) -> None:
        print(json.dumps({"event": "listening", "url": url,
                          "audit_log": str(path) if path else None,
                          "pid": os.getpid()}), flush=True)

    try:
        run(service, host=host, port=port, ready=ready, stop=stop)
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc}. Pick another --port.",
              file=sys.stderr)
        finish(1)


@approvals_app.command("click")
def click(release: Annotated[str, typer.Argument(help="The release id (see `history`).")],
          user: Annotated[str, typer.Option("--as", help="Slack user id who clicks.")],
          approve: Annotated[bool, typer.Option(
              "--approve/--reject", help="Which button to click.")],
          as_json: JsonOpt = False) -> None:
    """Click Approve or Reject as USER, signed as Slack would sign it (embedded stack only).

    Exit 0 when the click was accepted, 2 when the endpoint refused it.
    """
    # lazy: the approvals service pulls prefect (~3 s); only when a command runs
    from modelship.approvals.click import click as send_click

    def render(answer: dict[str, Any]) -> str:
        if answer.get("ok"):
            return (f"{answer['decision']} by {answer['user']} accepted for release "
                    f"{answer['release_id']}: {answer.get('status')}")
        return (f"refused ({answer.get('http_status')} {answer.get('error')}): "
                f"{answer.get('message')}")

    finish(run_reporting(lambda: send_click(settings(), release, user=user, approve=approve),
                         as_json=as_json, render=render, to_json=lambda d: d,
                         exit_code=lambda d: 0 if d.get("ok") else 2))
