"""Signing of staging manifests (``release.json``) with a key that is not in the bucket.

Why: anyone who can write to the bucket can rewrite a model file *and* the digests that
describe it. A manifest signed with a key held outside the bucket (settings, or the
embedded stack's 0600 key file) turns "the bytes match the manifest" into "the bytes match
what modelship staged". HMAC-SHA256 over a canonical JSON form is enough here: the same
party signs (stage) and verifies (swap, reconcile), and the key never travels.

The signature sits in the manifest itself under ``signature``::

    {"alg": "hmac-sha256", "key_id": "<16 hex>", "value": "<64 hex>"}

``key_id`` is a short digest of the key, so a manifest signed with another stack's key is
told apart from a forged one in messages. Pure, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr

from modelship.errors import UsageError

__all__ = [
    "ALGORITHM",
    "MIN_KEY_BYTES",
    "SIGNATURE_FIELD",
    "canonical_bytes",
    "generate_key",
    "key_bytes",
    "key_id",
    "sign",
    "signature_problem",
]

ALGORITHM = "hmac-sha256"
SIGNATURE_FIELD = "signature"
MIN_KEY_BYTES = 32


def generate_key() -> str:
    """A fresh random key (64 hex characters, 256 bits)."""
    return secrets.token_hex(32)


def key_bytes(key: SecretStr | str | bytes | None) -> bytes:
    """The raw key from settings, or a UsageError saying how to configure one.

    Raises:
        UsageError: no key, or one shorter than :data:`MIN_KEY_BYTES` bytes.
    """
    if isinstance(key, SecretStr):
        key = key.get_secret_value()
    raw = key.encode() if isinstance(key, str) else key
    if not raw:
        raise UsageError(
            "no manifest signing key is configured, so staged versions cannot be signed or "
            "verified",
            hint="set MODELSHIP_MANIFEST_SIGNING_KEY (at least 32 random characters, kept out "
            "of the bucket), or run `modelship stack up`, which generates one",
        )
    if len(raw) < MIN_KEY_BYTES:
        raise UsageError(
            f"the manifest signing key is {len(raw)} bytes long; at least {MIN_KEY_BYTES} are "
            "needed",
            hint="set MODELSHIP_MANIFEST_SIGNING_KEY to a longer random value (e.g. `python -c "
            "'import secrets; print(secrets.token_hex(32))'`)",
        )
    return raw


def key_id(key: bytes) -> str:
    """A short public name of the key (16 hex digits of its sha256)."""
    return hashlib.sha256(b"modelship-manifest-key:" + key).hexdigest()[:16]


def canonical_bytes(document: Mapping[str, Any]) -> bytes:
    """The bytes that are signed: the document without its signature, as canonical JSON."""
    body = {k: v for k, v in document.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def _mac(document: Mapping[str, Any], key: bytes) -> str:
    return hmac.new(key, canonical_bytes(document), hashlib.sha256).hexdigest()


def sign(document: Mapping[str, Any], key: bytes) -> dict[str, Any]:
    """A copy of ``document`` with its ``signature`` field (any previous one replaced)."""
    signed = {k: v for k, v in document.items() if k != SIGNATURE_FIELD}
    signed[SIGNATURE_FIELD] = {"alg": ALGORITHM, "key_id": key_id(key),
                               "value": _mac(signed, key)}
    return signed


def signature_problem(document: Mapping[str, Any], key: bytes) -> str | None:
    """Why ``document``'s signature does not verify with ``key``; None when it does."""
    signature = document.get(SIGNATURE_FIELD)
    if signature is None:
        return "it is not signed"
    if not isinstance(signature, Mapping) or signature.get("alg") != ALGORITHM \
            or not isinstance(signature.get("value"), str):
        return f"its signature is not an {ALGORITHM} signature"
    if not hmac.compare_digest(str(signature["value"]), _mac(document, key)):
        if signature.get("key_id") != key_id(key):
            return (f"it was signed with another key (key id {signature.get('key_id')!r}, "
                    f"ours is {key_id(key)!r})")
        return "its signature does not match its content (forged or altered)"
    return None
