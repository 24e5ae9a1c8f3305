"""The embedded stack's state file, ``$MODELSHIP_HOME/stack.json``.

It holds endpoints, credentials and the PIDs of what ``stack up`` started, so it is written
atomically with mode 0600. :func:`status_document` turns it into the public shape of
``modelship stack status --json`` (DESIGN §6).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from modelship.errors import StackError
from modelship.stack.process import ProcessRecord

STATE_VERSION = 1


def read_state(path: Path) -> dict[str, Any] | None:
    """The parsed state file, or None when there is none."""
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StackError(
            f"{path} is corrupt ({exc})",
            hint=f"stop any stack processes you started, delete {path}, then run "
            "`modelship stack up`",
        ) from exc
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise StackError(
            f"{path} was written by an incompatible modelship",
            hint=f"delete {path} after stopping its processes, then run `modelship stack up`",
        )
    return state


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Write the state atomically, readable by the owner only (it holds credentials)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".stack-", suffix=".json")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(state, handle, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def process_records(state: dict[str, Any]) -> list[ProcessRecord]:
    """The processes a state file says ``stack up`` started."""
    return [ProcessRecord.from_dict(p) for p in state.get("processes", [])]


def status_document(state: dict[str, Any], alive: dict[str, bool]) -> dict[str, Any]:
    """The ``stack status --json`` document: DESIGN §6 keys plus component health."""
    triton = state.get("triton", {})
    gateway = state.get("gateway") or {}

    def endpoint(e: dict[str, Any]) -> dict[str, Any]:
        return {"http": e["http"], "grpc": e["grpc"], "metrics": e["metrics"]}

    return {
        "mlflow_uri": state.get("mlflow_uri"),
        "s3_endpoint": state.get("s3_endpoint"),
        "bucket": state.get("bucket"),
        "prefect_api_url": state.get("prefect_api_url"),
        "slack_api_url": state.get("slack_api_url"),
        "approvals_url": state.get("approvals_url"),
        "webhooks_url": state.get("webhooks_url"),
        # production traffic goes here (the replicas and the canary behind it, by weight)
        "gateway_url": gateway.get("http"),
        "gateway": ({"http": gateway["http"], "grpc": gateway["grpc"],
                     "admin": gateway["admin"]} if gateway else None),
        "triton": {
            "replicas": [endpoint(r) for r in triton.get("replicas", [])],
            "canary": endpoint(triton["canary"]) if triton.get("canary") else None,
        },
        "running": bool(alive) and all(alive.values()),
        "components": [
            {"name": p.name, "pid": p.pid, "alive": alive.get(p.name, False), "log": p.log}
            for p in process_records(state)
        ],
    }
