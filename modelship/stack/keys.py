"""What the embedded stack must keep across ``stack down``: its keys and its ports.

``stack down`` deletes ``stack.json`` (it lists the processes), but the data in
``$MODELSHIP_HOME/data`` stays, and some of that data can only be read with the key that
wrote it. Each ``stack up`` used to make new keys, so the second ``up`` of a home failed:
MLflow keeps its webhooks' HMAC secrets encrypted with ``MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY``
(Fernet) in ``data/mlflow.db``, and with a new key it answers 500 to every webhook call.

Every secret the stack generates is therefore made once per home and kept in
``$MODELSHIP_HOME/stack-keys.json`` (0600, next to ``manifest-signing.key``, never in the
bucket). The audit of each one (does data written under it need it later?):

====================== ==============================================================
key                    what depends on it
====================== ==============================================================
mlflow_webhook_key     **data**: the webhook secrets encrypted in ``data/mlflow.db``.
manifest signing key   **data**: every staged version's signed manifest (own file,
                       ``manifest-signing.key``, kept since it was introduced).
access_key/secret_key  SeaweedFS ``weed mini`` takes them from its environment and
                       stores no identity (checked: after a restart with new keys the
                       old ones get ``InvalidAccessKeyId``), so no data needs them; kept
                       so that settings exported from ``stack status`` keep working.
slack_token            the emulator checks it per call; no stored message needs it.
slack_signing_secret   clicks are signed when made; no stored approval needs it.
mlflow_webhook_secret  the receiver re-registers its webhook with it at every start
                       (``ensure_mlflow_webhook`` updates url and secret).
seaweed JWT keys       sign 10-second tokens between SeaweedFS's own servers; nothing
                       stored is signed with them.
====================== ==============================================================

Keeping the ones no data needs costs nothing and makes a restarted stack the same stack.

The ports are kept too (``data/ports.json``): links written before a restart (Prefect flow
runs in the ledger and in Slack threads, the approvals endpoint in the emulator) point at
them, so ``up`` takes the same ports again when they are all free, and says so when not.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import sqlite3
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

KEYS_FILE = "stack-keys.json"
PORTS_FILE = "ports.json"


def _fernet_key() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()


#: How each generated secret is made (see the table in the module docstring).
KEY_MAKERS: dict[str, Callable[[], str]] = {
    "access_key": lambda: "ms" + secrets.token_hex(8),
    "secret_key": lambda: secrets.token_hex(20),
    "slack_token": lambda: "xoxb-modelship-" + secrets.token_hex(8),
    "slack_signing_secret": lambda: secrets.token_hex(16),
    "mlflow_webhook_secret": lambda: secrets.token_hex(24),
    "mlflow_webhook_key": _fernet_key,
    "seaweed_write_key": lambda: secrets.token_hex(24),
    "seaweed_read_key": lambda: secrets.token_hex(24),
    "seaweed_filer_write_key": lambda: secrets.token_hex(24),
    "seaweed_filer_read_key": lambda: secrets.token_hex(24),
}


def complete_keys(existing: Mapping[str, Any],
                  makers: Mapping[str, Callable[[], str]] = KEY_MAKERS
                  ) -> tuple[dict[str, str], list[str]]:
    """The kept keys plus a new one for each missing or empty entry (pure but for the
    makers); returns the keys and the names that were made now."""
    keys = {k: str(v) for k, v in existing.items() if isinstance(v, str) and v}
    made = [name for name in makers if name not in keys]
    for name in made:
        keys[name] = makers[name]()
    return keys, made


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def stack_keys(home: Path) -> tuple[dict[str, str], list[str]]:
    """The home's keys, made once and kept in ``stack-keys.json`` (0600); also returns the
    names made by this call (all of them on a new home)."""
    path = home / KEYS_FILE
    keys, made = complete_keys(_read_json(path))
    if made or not path.exists():
        _write_private(path, json.dumps(keys, indent=2, sort_keys=True))
    path.chmod(0o600)
    return keys, made


def saved_ports(home: Path) -> dict[str, Any]:
    """The ports the last ``up`` of this home used (empty when none were kept)."""
    return _read_json(home / "data" / PORTS_FILE)


def save_ports(home: Path, ports: Mapping[str, Any]) -> None:
    _write_private(home / "data" / PORTS_FILE, json.dumps(dict(ports), indent=2))


def reusable_ports(saved: Mapping[str, Any], *, count: int, is_busy: Callable[[int], bool],
                   derived: Callable[[list[int]], list[int]] = lambda _: []
                   ) -> tuple[list[int], int, int] | None:
    """The saved ports (the stack's ``count``, then the approvals and webhooks ports) when
    they are all there and none is busy now, nor any port the stack derives from them
    (SeaweedFS dials its admin port + 10000); else None, and ``up`` picks new ones."""
    ports, extra = saved.get("ports"), [saved.get("approvals"), saved.get("webhooks")]
    if not isinstance(ports, list) or len(ports) != count:
        return None
    every = [*ports, *extra]
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in every):
        return None
    if any(is_busy(p) for p in [*every, *derived(ports)]):
        return None
    return [int(p) for p in ports], int(extra[0]), int(extra[1])  # type: ignore[arg-type]


def drop_undecryptable_webhooks(db_path: Path, key: str) -> list[str]:
    """Delete the MLflow webhooks whose secret ``key`` cannot decrypt; their urls.

    Such rows make MLflow answer 500 to every webhook call. They come from a home whose
    stack made a new encryption key at each ``up`` (before the keys were kept): their
    secrets cannot be recovered, and the stack's receiver registers its webhook again at
    start. Run before MLflow starts (it is a SQLite file); a missing file or table is no-op.
    """
    from cryptography.fernet import Fernet, InvalidToken  # lazy: only `stack up` needs it

    if not db_path.is_file():
        return []
    cipher = Fernet(key.encode())
    dropped: list[str] = []
    with sqlite3.connect(db_path, timeout=10) as db:
        try:
            rows = db.execute("SELECT webhook_id, url, secret FROM webhooks").fetchall()
        except sqlite3.OperationalError:  # no webhooks table yet
            return []
        for webhook_id, url, secret in rows:
            if secret is None:
                continue
            try:
                cipher.decrypt(str(secret).encode())
            except InvalidToken:
                db.execute("DELETE FROM webhook_events WHERE webhook_id = ?", (webhook_id,))
                db.execute("DELETE FROM webhooks WHERE webhook_id = ?", (webhook_id,))
                dropped.append(str(url))
    return dropped
