"""Evidence binding: a swap serves only a candidate whose passing canary is on record.

The record must be for exactly the candidate's digest (the staged manifest's sha256, so a
re-staged or tampered version has no evidence) and against the version that serves now. A
rollback to a version that served before needs none. ``--force`` skips the check, and the
release record says so.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from modelship.candidate import ReleaseCandidate, ResolvedVersion
from modelship.errors import EvidenceMissing, ModelNotFound
from modelship.ledger import (
    Ledger,
    ReleaseRecord,
    candidate_digest,
    passing_canary,
    served_before,
)
from modelship.repository import PROBE_FIELD, manifest_key
from modelship.storage import S3Storage


def read_candidate_digest(storage: S3Storage, *, repository_prefix: str, model: str,
                          version: int) -> dict[str, Any]:
    """The digest of a staged version, from its manifest (one read).

    Raises:
        ModelNotFound: the version is not staged.
    """
    return _read_manifest(storage, repository_prefix=repository_prefix, model=model,
                          version=version)[0]


def release_candidate(storage: S3Storage, *, repository_prefix: str,
                      resolved: ResolvedVersion, feed: dict[str, Any], feed_source: str,
                      config_pbtxt: str) -> ReleaseCandidate:
    """The candidate a release carries from its stage on: what the check resolved, its
    golden feed and rendered config, and the staged manifest's digest and probe (the one
    read of the manifest before the swap's verification).

    Raises:
        ModelNotFound: the version is not staged.
    """
    digest, manifest = _read_manifest(storage, repository_prefix=repository_prefix,
                                      model=resolved.name, version=resolved.version)
    return ReleaseCandidate(resolved=resolved, feed=feed, feed_source=feed_source,
                            config_pbtxt=config_pbtxt, digest=digest,
                            probe=manifest.get(PROBE_FIELD))


def _read_manifest(storage: S3Storage, *, repository_prefix: str, model: str,
                   version: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The digest of a staged version and its parsed manifest ({} when not JSON)."""
    key = manifest_key(repository_prefix, model, version)
    if not storage.exists(key):
        raise ModelNotFound(
            f"{model} v{version} is not staged (no {key} in the repository)",
            hint=f"run `modelship promote {model} --version {version}`, which checks, stages "
            "and canaries it", model=model, version=version)
    body = storage.get_bytes(key)
    try:
        manifest = json.loads(body)
    except ValueError:
        manifest = {}
    if not isinstance(manifest, dict):
        manifest = {}
    return (candidate_digest(model, version, manifest, hashlib.sha256(body).hexdigest()),
            manifest)


def require_evidence(records: list[ReleaseRecord], *, model: str, digest: dict[str, Any],
                     serving: int | None, force: bool) -> dict[str, Any]:
    """What allows this swap, or EvidenceMissing (exit 3). Pure over the ledger records.

    Returns:
        ``{"basis": "canary" | "served_before" | "forced" | "already_serving", ...}``
    """
    version = int(digest["version"])
    if serving == version:
        return {"basis": "already_serving"}
    evidence = passing_canary(records, digest=digest, baseline=serving)
    if evidence is not None:
        return {"basis": "canary", "release_id": evidence.id,
                "report": evidence.gates.get("report_keys")}
    if served_before(records, version):
        return {"basis": "served_before"}
    if force:
        return {"basis": "forced"}
    against = f"v{serving}" if serving is not None else "no consistent production"
    raise EvidenceMissing(
        f"no passing canary is on record for {model} v{version} (manifest "
        f"{str(digest.get('manifest_sha256'))[:12]}) against {against}, and v{version} never "
        "served",
        hint=f"run `modelship promote {model} --version {version}` (or `modelship canary "
        f"{model} --version {version}` first), or pass --force, which the record keeps",
        model=model, version=version, serving=serving)


def ledger_records(ledger: Ledger | None, model: str) -> list[ReleaseRecord]:
    return ledger.records(model) if ledger is not None else []
