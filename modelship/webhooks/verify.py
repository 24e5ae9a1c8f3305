"""MLflow registry webhooks: verify a delivery, remember it, decide what it asks (pure).

MLflow (3.x, SQL backend) signs every delivery with HMAC-SHA256 over
``"{delivery_id}.{timestamp}.{raw body}"`` and sends three headers:

- ``X-MLflow-Delivery-Id``: a UUID, the same on MLflow's own retries;
- ``X-MLflow-Timestamp``: Unix seconds when it was sent;
- ``X-MLflow-Signature``: ``v1,<base64 digest>``.

:func:`verify` checks the signature on the **raw** body (before parsing), then the
timestamp window; :class:`DeliveryLog` refuses a delivery id seen before (a replay inside
the window); :func:`decide` turns a verified payload into an action. Every refusal is a
:class:`Rejected` with the HTTP status the receiver answers.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_HEADER = "X-MLflow-Delivery-Id"
SIGNATURE_VERSION = "v1"
#: How far a delivery's timestamp may be from now, in seconds (either way).
DEFAULT_TOLERANCE_S = 300.0
#: Bodies larger than this are refused unread (bytes).
MAX_BODY_BYTES = 1 << 20
CANDIDATE_ALIAS = "candidate"


class Rejected(Exception):  # noqa: N818 - an HTTP answer, not a modelship error
    """A delivery the receiver refuses: ``status`` is the HTTP answer, ``reason`` its body."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Delivery:
    """A delivery whose signature and timestamp checked out."""

    delivery_id: str
    timestamp: int
    payload: dict[str, Any]


@dataclass(frozen=True)
class StartPromote:
    """Start the ``promote`` deployment for this version."""

    model: str
    version: int
    alias: str


@dataclass(frozen=True)
class Ignore:
    """A valid delivery that asks for nothing (another event, another alias)."""

    reason: str


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The ``X-MLflow-Signature`` value MLflow would send (pure; tests sign with it too)."""
    content = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), content, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def _header(headers: Any, name: str) -> str | None:
    value = headers.get(name)
    if value is None:  # plain dicts in tests: match case-insensitively like HTTP does
        value = next((v for k, v in dict(headers).items() if k.lower() == name.lower()), None)
    return None if value is None else str(value).strip()


def verify(secret: str, headers: Any, body: bytes, *, now: float,
           tolerance_s: float = DEFAULT_TOLERANCE_S) -> Delivery:
    """Check signature, then timestamp, then parse (pure).

    Raises:
        Rejected: 401 when the signature is missing or wrong, or the timestamp is outside
            the window; 400 when a header or the JSON body is malformed.
    """
    if not secret:
        raise Rejected(500, "the receiver has no webhook secret configured")
    delivery_id = _header(headers, DELIVERY_HEADER)
    timestamp = _header(headers, TIMESTAMP_HEADER)
    signature = _header(headers, SIGNATURE_HEADER)
    if not signature:
        raise Rejected(401, f"missing {SIGNATURE_HEADER}: unsigned deliveries are refused")
    if not delivery_id or not timestamp:
        raise Rejected(400, f"missing {DELIVERY_HEADER} or {TIMESTAMP_HEADER}")
    if not signature.startswith(f"{SIGNATURE_VERSION},"):
        raise Rejected(401, f"unsupported signature version (expected {SIGNATURE_VERSION},...)")
    if not hmac.compare_digest(signature, sign(secret, delivery_id, timestamp, body)):
        raise Rejected(401, "signature mismatch: the body, delivery id or timestamp was "
                       "altered, or the secret differs")
    try:
        sent = int(timestamp)
    except ValueError:
        raise Rejected(400, f"{TIMESTAMP_HEADER} is not Unix seconds: {timestamp!r}") from None
    if not math.isfinite(now) or abs(now - sent) > tolerance_s:
        raise Rejected(401, f"stale delivery: sent at {sent}, now {int(now)} (window "
                       f"{tolerance_s:g} s)")
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Rejected(400, f"the body is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise Rejected(400, "the body is not a JSON object")
    return Delivery(delivery_id=delivery_id, timestamp=sent, payload=payload)


def decide(payload: dict[str, Any], *, alias: str = CANDIDATE_ALIAS) -> StartPromote | Ignore:
    """What a verified payload asks for (pure).

    Raises:
        Rejected: 400 when an alias event lacks its model name or a numeric version.
    """
    entity, action = payload.get("entity"), payload.get("action")
    if (entity, action) != ("model_version_alias", "created"):
        return Ignore(f"event {entity}.{action} starts nothing")
    data = payload.get("data")
    if not isinstance(data, dict):
        raise Rejected(400, "model_version_alias.created without a data object")
    name, version, set_alias = data.get("name"), data.get("version"), data.get("alias")
    if not isinstance(name, str) or not name or not isinstance(set_alias, str):
        raise Rejected(400, "model_version_alias.created needs data.name and data.alias")
    if set_alias != alias:
        return Ignore(f"alias {set_alias!r} on {name} starts nothing (only {alias!r} does)")
    try:
        number = int(str(version))
    except ValueError:
        raise Rejected(400, f"data.version {version!r} is not a version number") from None
    if number < 1:
        raise Rejected(400, f"data.version {number} is not a version number")
    return StartPromote(model=name, version=number, alias=set_alias)


class DeliveryLog:
    """Delivery ids seen inside the window, kept in a JSON file so a restart remembers them.

    Args:
        path: The file (None: memory only).
        keep_s: How long an id is remembered, in seconds; anything older is stale anyway.
    """

    def __init__(self, path: Path | None, *, keep_s: float = 2 * DEFAULT_TOLERANCE_S) -> None:
        self.path = path
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}
        if path is not None and path.is_file():
            try:
                self._seen = {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError, AttributeError):
                self._seen = {}

    def claim(self, delivery_id: str, *, now: float) -> bool:
        """Record ``delivery_id``; False when it was seen before (a replay)."""
        with self._lock:
            self._seen = {k: t for k, t in self._seen.items() if now - t <= self.keep_s}
            if delivery_id in self._seen:
                return False
            self._seen[delivery_id] = now
            self._save()
            return True

    def release(self, delivery_id: str) -> None:
        """Forget a claimed id whose action failed, so MLflow's retry may succeed."""
        with self._lock:
            self._seen.pop(delivery_id, None)
            self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".deliveries-")
        with os.fdopen(fd, "w") as handle:
            json.dump(self._seen, handle)
        os.replace(tmp, self.path)
