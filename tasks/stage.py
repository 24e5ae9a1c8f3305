"""Stage 4, stage: publish a candidate into the S3 Triton repository, atomically.

The layout inside the bucket (version folders under the repository prefix ``P``, the blob
store ``blobs/sha256/`` beside it) is drawn in :mod:`modelship.repository`. Why this shape:

- **Content addressing.** Every file is hashed (sha256, streamed) and uploaded once to the
  blob store, then copied server-side into the version folder. A file that did not change
  (the same weights under a new version) is never uploaded again. The blob store lives
  outside the repository prefix because Triton treats every folder under P as a model.
- **Atomic publish.** A version without a valid ``release.json`` does not exist as far as
  modelship is concerned. The manifest goes up only after every file has been checked in
  place, and it is removed again if the final check fails, so a manifest never points at
  missing files.
- **Immutable versions.** Triton hot-swaps an object overwritten in place, so a staged version
  never changes: staging the same content again is a no-op, staging different content under
  it is refused. A folder with files but no manifest (a crashed staging) is overwritten.

All I/O goes through the :class:`~modelship.storage.S3Storage` passed in; the planning and
comparison helpers are pure. This module is the write side; the layout's keys and the read
side (listing, reading and verifying staged versions) are the port
:mod:`modelship.repository`, which the stages that only read import instead.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np

from modelship.errors import StagingError, UsageError
from modelship.policy import StagingPolicy
from modelship.progress import Progress, quiet
from modelship.repository import (
    CONFIG_NAME,
    DEFAULT_BLOB_PREFIX,
    MANIFEST_NAME,
    PROBE_FIELD,
    RESERVED_NAMES,
    SCHEMA_VERSION,
    SHA256_METADATA,
    FileDigest,
    VerifiedVersion,
    blob_key,
    check_model,
    check_version,
    clean_prefix,
    digest_mismatch,
    model_prefix,
    read_manifest_body,
    read_verified,
    remote_digest,
    version_folders,
    version_prefix,
)
from modelship.signing import sign
from modelship.storage import S3Storage
from modelship.triton.infer import GoldenProbe

PROBE_ROWS = 4  # golden rows recorded with their outputs in the manifest
MAX_PARALLEL_FILES = 4


ActionKind = Literal["upload", "copy", "skip", "delete"]


# --------------------------------------------------------------------------------------
# value types


@dataclass(frozen=True)
class StagingAction:
    """One step of a staging plan.

    Attributes:
        kind: ``upload`` (local file to a blob), ``copy`` (blob to the version folder,
            server-side), ``skip`` (already in place) or ``delete`` (a leftover of a crashed
            staging that is not part of this version).
        key: The object written, kept or deleted.
        name: The file name inside the version folder.
        sha256: The content digest (hex); empty for ``delete``.
        size: The file size, in bytes.
        source: The local file name (``upload``) or blob key (``copy``), else None.
    """

    kind: ActionKind
    key: str
    name: str
    sha256: str = ""
    size: int = 0
    source: str | None = None

    def describe(self) -> str:
        """One line for ``--dry-run`` output."""
        mb = f"{self.size / 1e6:.1f} MB"
        short = self.sha256[:12]
        if self.kind == "upload":
            return f"upload {self.name} ({mb}, sha256 {short}) -> {self.key}"
        if self.kind == "copy":
            return f"copy   {self.source} -> {self.key} ({mb}, server-side)"
        if self.kind == "skip":
            return f"skip   {self.key} (already in place, sha256 {short})"
        return f"delete {self.key} (left over by an unfinished staging)"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "name": self.name, "sha256": self.sha256,
                "size": self.size, "source": self.source}


@dataclass(frozen=True)
class StagingPlan:
    """What :func:`stage_version` would do, found without changing anything (``--dry-run``).

    Attributes:
        model: Triton model name (the MLflow registered-model name).
        version: Triton version (the MLflow version number).
        version_prefix: ``P/<model>/<version>``.
        digests: The local files, by name in the version folder.
        config_sha256: Digest of the candidate's rendered ``config.pbtxt``.
        actions: The steps, uploads first; empty when already staged.
        already_staged: The version has a manifest with exactly this content.
        model_config_exists: ``P/<model>/config.pbtxt`` is there (it is then left alone).
        manifest_read: When already staged: its manifest and the sha256 of its bytes, as
            read for the plan (the verification that follows does not read it again).
    """

    model: str
    version: int
    version_prefix: str
    digests: dict[str, FileDigest]
    config_sha256: str
    actions: list[StagingAction]
    already_staged: bool
    model_config_exists: bool
    manifest_read: tuple[dict[str, Any], str] | None = None

    def describe(self) -> list[str]:
        """Human-readable lines, one per step."""
        if self.already_staged:
            return [f"{self.model}/{self.version} is already staged with this content: nothing "
                    "to do"]
        lines = [a.describe() for a in self.actions]
        lines.append(f"write  {self.version_prefix}/{CONFIG_NAME}")
        if not self.model_config_exists:
            lines.append(f"write  {self.version_prefix.rsplit('/', 1)[0]}/{CONFIG_NAME} "
                         "(absent; the swap owns it afterwards)")
        lines.append(f"write  {self.version_prefix}/{MANIFEST_NAME} (last)")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "version_prefix": self.version_prefix,
            "files": {n: d.to_dict() for n, d in self.digests.items()},
            "config_sha256": self.config_sha256,
            "actions": [a.to_dict() for a in self.actions],
            "already_staged": self.already_staged,
            "model_config_exists": self.model_config_exists,
        }


@dataclass
class StagedVersion:
    """The outcome of :func:`stage_version`.

    Attributes:
        bytes_uploaded: Model-file bytes sent from this machine (blob uploads); 0 when
            every file was already in the blob store.
        bytes_copied: Bytes copied server-side from the blob store into the version folder.
        metadata_bytes: Bytes of ``config.pbtxt`` and ``release.json`` written.
        skipped: Files already in place (a resumed staging), not copied again.
        seconds: Wall time of the whole staging, hashing included, in s.
        manifest: The published manifest, as the stage's verification read it back.
        manifest_sha256: The sha256 of its bytes, as read back: the digest the release is
            bound to (:func:`modelship.ledger.candidate_digest`), so no later stage reads
            the manifest again.
    """

    model: str
    version: int
    manifest_key: str
    files: dict[str, FileDigest]
    bytes_uploaded: int
    bytes_copied: int
    metadata_bytes: int
    skipped: list[str]
    already_staged: bool
    model_config_written: bool
    seconds: float
    manifest: dict[str, Any]
    manifest_sha256: str
    actions: list[StagingAction] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "manifest_key": self.manifest_key,
            "files": {n: d.to_dict() for n, d in self.files.items()},
            "bytes_uploaded": self.bytes_uploaded,
            "bytes_copied": self.bytes_copied,
            "metadata_bytes": self.metadata_bytes,
            "skipped": list(self.skipped),
            "already_staged": self.already_staged,
            "model_config_written": self.model_config_written,
            "seconds": round(self.seconds, 3),
            "actions": [a.to_dict() for a in self.actions],
            "manifest": self.manifest,
            "manifest_sha256": self.manifest_sha256,
        }


# --------------------------------------------------------------------------------------
# keys and names (pure)


def _check_file_name(name: str) -> None:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in {"", ".", ".."} for p in parts) \
            or name in RESERVED_NAMES:
        raise UsageError(
            f"file name {name!r} cannot go into a Triton version folder",
            hint="use a relative name such as 'model.onnx'; 'config.pbtxt' and 'release.json' "
            "are written by modelship",
            file=name,
        )


def _check_prefixes(repository_prefix: str, blob_prefix: str) -> None:
    repo, blobs = clean_prefix(repository_prefix), clean_prefix(blob_prefix)
    if not blobs or not repo or blobs == repo or blobs.startswith(repo + "/"):
        raise UsageError(
            f"blob prefix {blob_prefix!r} must be a non-empty prefix outside the repository "
            f"prefix {repository_prefix!r}",
            hint="Triton lists every folder under the repository prefix as a model; keep the "
            f"blob store beside it (the default is {DEFAULT_BLOB_PREFIX!r})",
        )


# --------------------------------------------------------------------------------------
# pure planning


def plan_staging(
    digests: Mapping[str, FileDigest],
    *,
    existing_blobs: Mapping[str, FileDigest],
    existing_files: Mapping[str, FileDigest],
    version_prefix: str,
    blob_prefix: str = DEFAULT_BLOB_PREFIX,
) -> list[StagingAction]:
    """The steps that put ``digests`` into a version folder, uploading only unknown content.

    Args:
        digests: The local files, by name in the version folder.
        existing_blobs: Blobs found in the store, by digest, with the size and sha256 their
            metadata reports. One whose size or digest disagrees is uploaded again.
        existing_files: Objects already in the version folder (a crashed staging), by
            name, with the sha256 of their metadata ("" when absent). A file whose digest
            and size match is skipped; other names, except config.pbtxt and release.json
            (always rewritten), are deleted.
        version_prefix: ``P/<model>/<version>``.
        blob_prefix: The blob store prefix, outside the repository prefix.

    Returns:
        Uploads first (one per distinct digest), then copies and skips by file name, then
        deletes, so that ``--dry-run`` prints them in the order they run.
    """
    uploads: list[StagingAction] = []
    placements: list[StagingAction] = []
    uploading: set[str] = set()
    for name in sorted(digests):
        digest = digests[name]
        blob = blob_key(blob_prefix, digest.sha256)
        key = f"{version_prefix}/{name}"
        if existing_files.get(name) == digest:
            placements.append(StagingAction("skip", key, name, digest.sha256, digest.size))
            continue
        if existing_blobs.get(digest.sha256) != digest and digest.sha256 not in uploading:
            uploading.add(digest.sha256)
            uploads.append(StagingAction("upload", blob, name, digest.sha256, digest.size,
                                         source=name))
        placements.append(StagingAction("copy", key, name, digest.sha256, digest.size,
                                        source=blob))
    deletes = [
        StagingAction("delete", f"{version_prefix}/{name}", name)
        for name in sorted(existing_files)
        if name not in digests and name not in RESERVED_NAMES
    ]
    return uploads + placements + deletes


def manifest_conflicts(
    manifest: Mapping[str, Any], digests: Mapping[str, FileDigest], config_sha256: str
) -> list[str]:
    """Why a staged manifest differs from new content; empty when it is the same content.

    Each entry reads ``file X: sha A != B`` (staged digest first, 12 hex digits), with
    ``absent`` for a file on one side only.
    """
    staged = {name: str(entry.get("sha256", "")) if isinstance(entry, Mapping) else ""
              for name, entry in dict(manifest.get("files") or {}).items()}
    problems = []
    for name in sorted(set(staged) | set(digests)):
        old = staged.get(name, "absent")
        new = digests[name].sha256 if name in digests else "absent"
        if old != new:
            problems.append(f"file {name}: sha {old[:12]} != {new[:12]}")
    old_config = str(manifest.get("config_sha256", "absent"))
    if old_config != config_sha256:
        problems.append(f"file {CONFIG_NAME}: sha {old_config[:12]} != {config_sha256[:12]}")
    return problems


def versions_to_prune(existing: Iterable[int], keep: int, protect: Iterable[int]) -> list[int]:
    """The oldest versions beyond the newest ``keep``, never a protected one, oldest first.

    Protected versions (production and the previous one, for rollback) survive even when
    older than the newest ``keep``, so at most ``keep + len(protect)`` folders remain.
    """
    if keep < 1:
        raise UsageError(f"keep must be at least 1, got {keep}",
                         hint="set staging.keep_versions (>= 2) in the model's policy")
    ordered = sorted(set(existing), reverse=True)
    protected = set(protect)
    return sorted(v for v in ordered[keep:] if v not in protected)


def golden_probe(feed: Mapping[str, Any], outputs: Mapping[str, Any], tolerance: Any, *,
                 rows: int = PROBE_ROWS) -> GoldenProbe:
    """The probe recorded in the manifest: the first golden rows and the candidate's outputs.

    Args:
        feed: The golden inputs (name to array, batch first).
        outputs: The candidate's outputs on ``feed`` (ONNX Runtime, as Triton's backend).
        tolerance: An object with ``atol`` and ``rtol`` (the policy's parity tolerances).
        rows: How many rows to keep.
    """
    return GoldenProbe.record({k: np.asarray(v) for k, v in feed.items()},
                              {k: np.asarray(v) for k, v in outputs.items()}, rows=rows,
                              atol=float(tolerance.atol), rtol=float(tolerance.rtol))


# --------------------------------------------------------------------------------------
# hashing


def sha256_file(path: Path) -> FileDigest:
    """sha256 and size (bytes) of a local file, read in a stream (constant memory)."""
    try:
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
            size = fh.tell()
    except OSError as exc:
        raise StagingError(
            f"cannot read {path} to stage it ({exc.strerror or exc})",
            hint="check that the exported model files exist and are readable",
            file=str(path),
        ) from exc
    return FileDigest(digest, size)


def digest_files(files: Mapping[str, Path]) -> dict[str, FileDigest]:
    """Hash every file, in parallel (hashlib releases the GIL on large reads)."""
    names = sorted(files)
    if len(names) <= 1:
        return {n: sha256_file(files[n]) for n in names}
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_FILES, len(names))) as pool:
        return dict(zip(names, pool.map(lambda n: sha256_file(files[n]), names), strict=True))


def _sha256_bytes(data: bytes) -> FileDigest:
    return FileDigest(hashlib.sha256(data).hexdigest(), len(data))


# --------------------------------------------------------------------------------------
# reading the remote state


def prepare_staging(
    storage: S3Storage,
    *,
    model: str,
    version: int,
    files: Mapping[str, Path],
    config_pbtxt: str,
    repository_prefix: str,
    blob_prefix: str = DEFAULT_BLOB_PREFIX,
    digests: Mapping[str, FileDigest] | None = None,
) -> StagingPlan:
    """Hash the files and read the remote state: the plan, with nothing changed yet.

    This is what ``--dry-run`` prints. It reads (HEAD/GET/LIST) and never writes.

    Raises:
        UsageError: a bad model name, version, file name or blob prefix.
        StagingError: the version is already staged with different content (versions are
            immutable), or its manifest is invalid.
        StorageError, CredentialsRejected: S3 failed or refused a request.
    """
    check_model(model)
    check_version(version)
    _check_prefixes(repository_prefix, blob_prefix)
    if not files:
        raise UsageError(f"nothing to stage for {model}/{version}: no files given",
                         hint="pass the exported model files (e.g. model.onnx)")
    for name in files:
        _check_file_name(name)
    local = dict(digests) if digests is not None else digest_files(files)
    config_sha = _sha256_bytes(config_pbtxt.encode()).sha256
    vprefix = version_prefix(repository_prefix, model, version)
    mkey = f"{vprefix}/{MANIFEST_NAME}"
    model_config_exists = storage.exists(f"{model_prefix(repository_prefix, model)}/{CONFIG_NAME}")

    staged = read_manifest_body(storage, mkey)
    if staged is not None:
        conflicts = manifest_conflicts(staged[0], local, config_sha)
        if conflicts:
            raise StagingError(
                f"version {version} of {model} is already staged with different content "
                f"({'; '.join(conflicts)}); versions are immutable",
                hint="register a new MLflow version instead",
                model=model, version=version, conflicts=conflicts, manifest_key=mkey,
            )
        return StagingPlan(model, version, vprefix, local, config_sha, [], True,
                           model_config_exists, staged)

    existing_files: dict[str, FileDigest] = {}
    for key in storage.list_keys(vprefix + "/"):
        found = remote_digest(storage.head(key))
        if found is not None:
            existing_files[key[len(vprefix) + 1:]] = found
    existing_blobs: dict[str, FileDigest] = {}
    for sha in sorted({d.sha256 for d in local.values()}):
        found = remote_digest(storage.head(blob_key(blob_prefix, sha)))
        if found is not None:
            existing_blobs[sha] = found
    actions = plan_staging(local, existing_blobs=existing_blobs, existing_files=existing_files,
                           version_prefix=vprefix, blob_prefix=blob_prefix)
    return StagingPlan(model, version, vprefix, local, config_sha, actions, False,
                       model_config_exists)


# --------------------------------------------------------------------------------------
# staging


def stage_version(
    storage: S3Storage,
    *,
    model: str,
    version: int,
    files: Mapping[str, Path],
    config_pbtxt: str,
    provenance: Mapping[str, Any],
    policy: StagingPolicy,
    repository_prefix: str,
    signing_key: bytes,
    probe: GoldenProbe | None = None,
    blob_prefix: str = DEFAULT_BLOB_PREFIX,
    progress: Progress = quiet,
) -> StagedVersion:
    """Publish one model version into the Triton repository; idempotent.

    Steps: hash the files; upload the blobs the store lacks; copy them server-side into
    ``P/<model>/<version>/``; check every file in place; write the version's config.pbtxt
    (and the model's, when absent); write ``release.json`` last, signed with
    ``signing_key``; verify the result (bytes hashed, signature checked).

    Args:
        storage: The S3 client (all I/O goes through it).
        model: Triton model name (the MLflow registered-model name).
        version: Triton version (the MLflow version number, >= 1).
        files: Local files by name in the version folder, e.g. ``{"model.onnx": path}``.
        config_pbtxt: The candidate's rendered Triton config.
        provenance: JSON-ready facts for the manifest (MLflow URI, run id, opset,
            validation result id, ...).
        policy: Multipart sizes for uploads and copies.
        repository_prefix: The Triton repository prefix inside the bucket.
        signing_key: The manifest signing key (:func:`modelship.signing.key_bytes` of the
            settings' ``manifest_signing_key``); it never goes into the bucket.
        probe: Golden rows and the candidate's outputs on them, recorded in the manifest:
            the swap requires every replica to answer them within tolerance, and refuses
            a version staged without a probe.
        blob_prefix: The blob store prefix; must lie outside ``repository_prefix``.
        progress: Receives one human line per step.

    Raises:
        StagingError: the version is already staged with different content, a file did
            not land intact, or the final verification failed (an already staged version
            whose manifest is unsigned or signed with another key included).
        UsageError: bad names or prefixes.
        StorageError: S3 failed a request (bucket, server); CredentialsRejected when it
            refuses the keys.
    """
    started = time.monotonic()
    total = sum(_file_size(p) for p in files.values())
    progress(f"{model}/{version}: hashing {len(files)} file(s), {total / 1e6:.1f} MB")
    plan = prepare_staging(storage, model=model, version=version, files=files,
                           config_pbtxt=config_pbtxt, repository_prefix=repository_prefix,
                           blob_prefix=blob_prefix)
    mkey = f"{plan.version_prefix}/{MANIFEST_NAME}"
    if plan.already_staged:
        progress(f"{model}/{version}: already staged with this content; verifying")
        found = read_verified(storage, model=model, version=version, deep=False,
                              repository_prefix=repository_prefix, signing_key=signing_key,
                              manifest_read=plan.manifest_read)
        return StagedVersion(model, version, mkey, plan.digests, 0, 0, 0, [], True, False,
                             time.monotonic() - started, found.manifest,
                             found.manifest_sha256)

    provenance_json = _json_provenance(plan, provenance)
    _execute(storage, plan, files, policy, progress)
    _check_in_place(storage, plan)
    _delete_leftovers(storage, plan, progress)
    config_bytes = config_pbtxt.encode()
    metadata_bytes, model_config_written = _write_configs(storage, plan, config_bytes,
                                                          repository_prefix, progress)
    manifest = _manifest_document(plan, provenance_json, config_size=len(config_bytes),
                                  blob_prefix=blob_prefix, probe=probe)
    metadata_bytes += _publish_manifest(storage, mkey, sign(manifest, signing_key), progress)
    verified = _verify_or_unpublish(storage, plan, mkey, repository_prefix=repository_prefix,
                                    signing_key=signing_key)
    return _staged_report(plan, mkey, verified, metadata_bytes=metadata_bytes,
                          model_config_written=model_config_written, started=started,
                          progress=progress)


def _json_provenance(plan: StagingPlan, provenance: Mapping[str, Any]) -> dict[str, Any]:
    """``provenance`` as plain JSON, refused before anything is written when it is not.

    Raises:
        UsageError: a value JSON cannot hold.
    """
    try:
        return dict(json.loads(json.dumps(dict(provenance))))
    except (TypeError, ValueError) as exc:
        raise UsageError(
            f"provenance of {plan.model}/{plan.version} is not JSON-serialisable ({exc})",
            hint="pass strings, numbers, booleans, lists and mappings only") from exc


def _delete_leftovers(storage: S3Storage, plan: StagingPlan, progress: Progress) -> None:
    """Remove the files in the version folder that the plan does not stage."""
    for action in plan.actions:
        if action.kind == "delete":
            progress(f"{plan.model}/{plan.version}: deleting leftover {action.key}")
            storage.delete_key(action.key)


def _write_configs(storage: S3Storage, plan: StagingPlan, config_bytes: bytes,
                   repository_prefix: str, progress: Progress) -> tuple[int, bool]:
    """Write the version's config.pbtxt, and the model's when it has none yet.

    Returns:
        The bytes written, and whether the model's config was written.
    """
    storage.put_bytes(f"{plan.version_prefix}/{CONFIG_NAME}", config_bytes,
                      metadata={SHA256_METADATA: plan.config_sha256})
    if plan.model_config_exists:
        return len(config_bytes), False
    model_config_key = f"{model_prefix(repository_prefix, plan.model)}/{CONFIG_NAME}"
    if storage.exists(model_config_key):  # the swap may have written it meanwhile
        return len(config_bytes), False
    progress(f"{plan.model}: writing {model_config_key} (first version of this model)")
    storage.put_bytes(model_config_key, config_bytes,
                      metadata={SHA256_METADATA: plan.config_sha256})
    return 2 * len(config_bytes), True


def _manifest_document(plan: StagingPlan, provenance: dict[str, Any], *, config_size: int,
                       blob_prefix: str, probe: GoldenProbe | None) -> dict[str, Any]:
    """The version's ``release.json`` before signing: what was staged and where from."""
    manifest: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "model": plan.model,
        "version": plan.version,
        "created_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "provenance": provenance,
        "files": {n: d.to_dict() for n, d in sorted(plan.digests.items())},
        "config_sha256": plan.config_sha256,
        "config_size": config_size,
        "blob_prefix": clean_prefix(blob_prefix),
    }
    if probe is not None:
        manifest[PROBE_FIELD] = probe.to_dict()
    return manifest


def _publish_manifest(storage: S3Storage, mkey: str, manifest: dict[str, Any],
                      progress: Progress) -> int:
    """Write the signed manifest, last: it is what makes the version exist. Returns its
    size in bytes."""
    body = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    progress(f"{manifest['model']}/{manifest['version']}: writing {mkey} (publishes the "
             "version)")
    storage.put_bytes(mkey, body, metadata={SHA256_METADATA: hashlib.sha256(body).hexdigest()})
    return len(body)


def _verify_or_unpublish(storage: S3Storage, plan: StagingPlan, mkey: str, *,
                         repository_prefix: str, signing_key: bytes) -> VerifiedVersion:
    """Verify the version just published (its files by HEAD, its manifest and config read
    back); on any failure delete its manifest, so no manifest is left that points at bad
    files."""
    try:
        return read_verified(storage, model=plan.model, version=plan.version, deep=False,
                             repository_prefix=repository_prefix, signing_key=signing_key)
    except Exception:
        storage.delete_key(mkey)
        raise


def _staged_report(plan: StagingPlan, mkey: str, verified: VerifiedVersion, *,
                   metadata_bytes: int, model_config_written: bool, started: float,
                   progress: Progress) -> StagedVersion:
    """What staging moved (uploaded, copied server-side, skipped) and how long it took."""
    uploaded = sum(a.size for a in plan.actions if a.kind == "upload")
    copied = sum(a.size for a in plan.actions if a.kind == "copy")
    skipped = [a.name for a in plan.actions if a.kind == "skip"]
    seconds = time.monotonic() - started
    progress(f"{plan.model}/{plan.version}: staged in {seconds:.1f} s "
             f"({uploaded / 1e6:.1f} MB uploaded, {copied / 1e6:.1f} MB copied server-side, "
             f"{len(skipped)} skipped)")
    return StagedVersion(plan.model, plan.version, mkey, plan.digests, uploaded, copied,
                         metadata_bytes, skipped, False, model_config_written, seconds,
                         verified.manifest, verified.manifest_sha256, list(plan.actions))


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise StagingError(f"cannot read {path} to stage it ({exc.strerror or exc})",
                           hint="check that the exported model files exist and are readable",
                           file=str(path)) from exc


def _execute(storage: S3Storage, plan: StagingPlan, files: Mapping[str, Path],
             policy: StagingPolicy, progress: Progress) -> None:
    """Run uploads and copies; one worker per distinct digest (upload, then its copies)."""
    sizes = {"multipart_threshold_bytes": policy.multipart_threshold_bytes,
             "multipart_chunk_bytes": policy.multipart_chunk_bytes}
    by_digest: dict[str, list[StagingAction]] = {}
    for action in plan.actions:
        if action.kind in {"upload", "copy"}:
            by_digest.setdefault(action.sha256, []).append(action)
    where = f"{plan.model}/{plan.version}"

    def run(actions: list[StagingAction]) -> None:
        for action in actions:
            meta = {SHA256_METADATA: action.sha256}
            if action.kind == "upload":
                assert action.source is not None
                progress(f"{where}: uploading {action.name} ({action.size / 1e6:.1f} MB) "
                         f"to {action.key}")
                storage.upload_file_parts(files[action.source], action.key, metadata=meta,
                                          **sizes)
            else:
                assert action.source is not None
                progress(f"{where}: copying {action.name} from {action.source} (server-side)")
                storage.copy_object(action.source, action.key, metadata=meta, **sizes)

    for action in plan.actions:
        if action.kind == "skip":
            progress(f"{where}: {action.name} already in place")
    groups = list(by_digest.values())
    if len(groups) <= 1:
        for group in groups:
            run(group)
        return
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_FILES, len(groups))) as pool:
        for future in [pool.submit(run, g) for g in groups]:
            future.result()


def _check_in_place(storage: S3Storage, plan: StagingPlan) -> None:
    """Before the manifest: every file is in the version folder with its size and digest."""
    problems = []
    for name, digest in sorted(plan.digests.items()):
        key = f"{plan.version_prefix}/{name}"
        found = remote_digest(storage.head(key))
        problem = digest_mismatch(name, digest, found)
        if problem:
            problems.append(problem)
    if problems:
        raise StagingError(
            f"{plan.model}/{plan.version} did not land intact in s3://{storage.bucket}/"
            f"{plan.version_prefix}/: {'; '.join(problems)}; no manifest was written",
            hint="stage again (it resumes); if it keeps failing, see the S3 server's log",
            model=plan.model, version=plan.version, problems=problems,
        )


# --------------------------------------------------------------------------------------
# verification, listing, pruning


def prune_versions(
    storage: S3Storage,
    *,
    model: str,
    repository_prefix: str,
    keep: int,
    protect: set[int],
    progress: Progress = quiet,
) -> list[int]:
    """Delete the oldest version folders beyond ``keep``, never a protected one.

    Triton downloads every version folder on each load, so retired versions cost load time.
    Each pruned version loses its manifest first, so a half-deleted folder is never a valid
    version. Blobs stay in the blob store (other versions may share them).

    Args:
        keep: How many of the newest version folders to keep (``staging.keep_versions``).
        protect: Versions never deleted: production and the previous one.

    Returns:
        The pruned versions, ascending.
    """
    check_model(model)
    folders = version_folders(storage, model, repository_prefix)
    pruned = versions_to_prune(folders, keep, protect)
    for version in pruned:
        vprefix = version_prefix(repository_prefix, model, version)
        progress(f"{model}: pruning version {version} ({vprefix}/)")
        storage.delete_key(f"{vprefix}/{MANIFEST_NAME}")
        storage.delete_prefix(vprefix + "/")
    return pruned


