"""Shared pieces of the ``modelship`` command: the app, options, settings and output."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from modelship.output import progress, run_reporting, table

if TYPE_CHECKING:  # the types only: importing them costs pydantic, numpy and tritonclient
    from modelship.clients import Clients
    from modelship.settings import Settings

T = TypeVar("T")

__all__ = ["AliasOpt", "BreakingOpt", "DryRunOpt", "ForceOpt", "JsonOpt", "ModelArg",
           "PolicyOpt", "VersionOpt", "app", "finish", "progress", "run_reporting",
           "settings", "stack_app", "table", "with_clients", "workdir"]

app = typer.Typer(
    help="Release pipeline that promotes MLflow-registered models to NVIDIA Triton.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
stack_app = typer.Typer(help="The embedded local stack of real servers.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
ModelArg = Annotated[str, typer.Argument(help="Registered model name (= Triton model name).")]
VersionOpt = Annotated[int | None, typer.Option("--version", "-v", help="Model version.")]
AliasOpt = Annotated[str | None, typer.Option("--alias", help="Model alias, e.g. candidate.")]
PolicyOpt = Annotated[
    Path | None, typer.Option("--policy", help="Release policy YAML (default policies/MODEL.yaml).")
]
BreakingOpt = Annotated[
    bool, typer.Option("--allow-breaking-changes",
                       help="Accept an I/O change against the production version.")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")]
ForceOpt = Annotated[bool, typer.Option(
    "--force", help="Skip the evidence check (no passing canary on record); recorded.")]


def settings() -> Settings:
    """This machine's settings (environment, then the stack's stack.json)."""
    from modelship.settings import load_settings  # lazy: pydantic (~0.3 s) when a command runs

    return load_settings()


def finish(code: int) -> None:
    raise typer.Exit(code)


def with_clients(body: Callable[[Settings, Clients], T]) -> T:
    """Run ``body(settings, clients)`` with clients built once and closed after."""
    # lazy: the clients pull pydantic, numpy and the Triton client (~0.8 s); when a command runs
    from modelship.clients import build_clients

    current = settings()
    clients = build_clients(current)
    try:
        return body(current, clients)
    finally:
        clients.close()


def workdir(current: Settings, model: str) -> Path:
    """A fresh folder for this run's artifacts (exported graph, GX results, Data Docs)."""
    path = current.home / "runs" / f"{model}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path
