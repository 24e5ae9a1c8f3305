"""Evidence binding: a swap serves only a candidate whose passing canary is on record.

The record must be for exactly the candidate's digest (the staged manifest's sha256, so a
re-staged or tampered version has no evidence) and against the version that serves now. A
rollback to a version that served before needs none. ``--force`` skips the check, and the
release record says so.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from modelship.candidate import ReleaseCandidate
from modelship.errors import EvidenceMissing, ModelNotFound, StagingError
from modelship.ledger import (
    Ledger,
    ReleaseRecord,
    candidate_digest,
    passing_canary,
    served_before,
)
from modelship.repository import PROBE_FIELD, manifest_key
from modelship.storage import S3Storage

if TYPE_CHECKING:  # annotation only: tasks.check imports the whole check
    from tasks.check import CheckReport


def read_candidate_digest(storage: S3Storage, *, repository_prefix: str, model: str,
                          version: int) -> dict[str, Any]:
    """The digest of a staged version, from its manifest (one read; a manifest that is no
    JSON object gives a digest without files).

    Raises:
        ModelNotFound: the version is not staged.
    """
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
    return candidate_digest(model, version, manifest, hashlib.sha256(body).hexdigest())


def release_candidate(report: CheckReport) -> ReleaseCandidate:
    """The candidate a release carries from its stage on, from a check that staged it
    (``run_check(stage=True)``, or the promote flow's check and stage stages): what the
    check resolved, its golden feed and rendered config, and the digest and probe of the
    manifest the stage verified (``report.staged``: ``StagedVersion.to_dict()``, with the
    sha256 of the manifest's bytes as read back). Pure: nothing is read again.

    Raises:
        StagingError: the report carries no verified manifest of this version (a dry
            run's plan, or a check that did not stage); the release stops before its
            canary.
    """
    resolved, staged = report.resolved, report.staged or {}
    model = resolved.name if resolved is not None else report.model
    version = resolved.version if resolved is not None else report.version
    manifest, sha256 = staged.get("manifest"), staged.get("manifest_sha256")
    if resolved is None or report.golden is None or report.config_pbtxt is None \
            or not isinstance(manifest, dict) or not isinstance(sha256, str) \
            or len(sha256) != 64 or manifest.get("model") != model \
            or manifest.get("version") != version:
        raise StagingError(
            f"the stage of {model} v{version} handed over no verified manifest of it "
            f"(manifest_sha256 {sha256!r}), so the release has no digest to bind its canary, "
            "approval and swap to",
            hint=f"stage it again (`modelship stage {model} --version {version}`), then "
            f"`modelship promote {model} --version {version}`", model=model, version=version)
    return ReleaseCandidate(resolved=resolved, feed=report.feed,
                            feed_source=report.golden.source,
                            config_pbtxt=report.config_pbtxt,
                            digest=candidate_digest(resolved.name, resolved.version,
                                                    manifest, sha256),
                            probe=manifest.get(PROBE_FIELD))


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
