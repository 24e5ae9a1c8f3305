"""The S3 Triton repository, read side: its key layout, and reading and verifying staged versions.

Layout inside the bucket (``P`` is the repository prefix Triton serves)::

    P/<model>/config.pbtxt               written only when absent; the swap owns it after
    P/<model>/<version>/<file>           model.onnx, model.onnx.data, ...
    P/<model>/<version>/config.pbtxt     the candidate's own rendered config, for the record
    P/<model>/<version>/release.json     the manifest, written LAST
    blobs/sha256/<digest>                content-addressed store, OUTSIDE P

A version without a valid ``release.json`` does not exist as far as modelship is concerned.
Writing (staging, pruning) is :mod:`tasks.stage`; this port only reads, so canary, swap,
reconcile, evidence and the payload depend on it and not on the staging stage. All I/O goes
through the :class:`~modelship.storage.S3Storage` passed in; the key helpers are pure.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modelship.errors import ModelNotFound, StagingError, UsageError
from modelship.signing import signature_problem
from modelship.storage import S3Storage
from modelship.triton.infer import GoldenProbe
from modelship.triton.model_config import ModelConfig, from_pbtxt

SCHEMA_VERSION = 1
MANIFEST_NAME = "release.json"
CONFIG_NAME = "config.pbtxt"
RESERVED_NAMES = frozenset({MANIFEST_NAME, CONFIG_NAME})
DEFAULT_BLOB_PREFIX = "blobs/sha256"
SHA256_METADATA = "sha256"  # user metadata key (x-amz-meta-sha256) on every object we write
PROBE_FIELD = "probe"  # the manifest's golden probe (GoldenProbe.to_dict), signed with it
HASH_CHUNK_BYTES = 8 * 1024 * 1024
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


# --------------------------------------------------------------------------------------
# value types


@dataclass(frozen=True)
class FileDigest:
    """The identity of one file: its sha256 (hex) and size (bytes)."""

    sha256: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size}


# --------------------------------------------------------------------------------------
# keys and names (pure)


def clean_prefix(prefix: str) -> str:
    """A bucket prefix without leading or trailing slashes."""
    return prefix.strip("/")


def model_prefix(repository_prefix: str, model: str) -> str:
    """``P/<model>``: the model's folder in the Triton repository."""
    return f"{clean_prefix(repository_prefix)}/{model}".lstrip("/")


def version_prefix(repository_prefix: str, model: str, version: int) -> str:
    """``P/<model>/<version>``: one Triton version folder (no trailing slash)."""
    return f"{model_prefix(repository_prefix, model)}/{version}"


def manifest_key(repository_prefix: str, model: str, version: int) -> str:
    """Where a version's ``release.json`` lives."""
    return f"{version_prefix(repository_prefix, model, version)}/{MANIFEST_NAME}"


def blob_key(blob_prefix: str, sha256: str) -> str:
    """The content-addressed key of a blob."""
    return f"{clean_prefix(blob_prefix)}/{sha256}"


def check_model(model: str) -> None:
    """Refuse a model name that cannot be a Triton model folder (UsageError)."""
    if not model or "/" in model or model in {".", ".."} or model != model.strip():
        raise UsageError(
            f"model name {model!r} cannot be a Triton model folder",
            hint="use the MLflow registered-model name, without '/' or surrounding spaces",
            model=model,
        )


def check_version(version: int) -> None:
    """Refuse a version that cannot be a Triton version folder (UsageError)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise UsageError(
            f"version {version!r} cannot be a Triton version folder",
            hint="use the MLflow version number (an integer >= 1)",
            version=version,
        )


# --------------------------------------------------------------------------------------
# reading the remote state


def remote_digest(head: Mapping[str, Any] | None) -> FileDigest | None:
    """The digest an object's HEAD reports (sha256 metadata, size); None when absent."""
    if head is None:
        return None
    meta = {str(k).lower(): str(v) for k, v in dict(head.get("metadata") or {}).items()}
    return FileDigest(meta.get(SHA256_METADATA, ""), int(head["size"]))


def read_manifest(storage: S3Storage, key: str) -> dict[str, Any] | None:
    """The parsed manifest, None when absent; StagingError when it is not valid."""
    found = read_manifest_body(storage, key)
    return None if found is None else found[0]


def read_manifest_body(storage: S3Storage, key: str) -> tuple[dict[str, Any], str] | None:
    """The parsed manifest and the sha256 of the bytes it was parsed from (one read), None
    when absent; StagingError when it is not valid."""
    if storage.head(key) is None:
        return None
    raw = storage.get_bytes(key)
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StagingError(f"manifest s3://{storage.bucket}/{key} is not valid JSON ({exc})",
                           hint=TAMPERED_HINT, key=key) from exc
    problems = _manifest_problems(manifest)
    if problems:
        raise StagingError(
            f"manifest s3://{storage.bucket}/{key} is invalid: {'; '.join(problems)}",
            hint=TAMPERED_HINT, key=key, problems=problems,
        )
    assert isinstance(manifest, dict)
    return manifest, hashlib.sha256(raw).hexdigest()


TAMPERED_HINT = (
    "the version folder was changed outside modelship; register a new MLflow version, or, if "
    "this version is not serving, delete its folder and stage it again"
)


def _manifest_problems(manifest: Any) -> list[str]:
    if not isinstance(manifest, dict):
        return ["not a JSON object"]
    problems = []
    schema = manifest.get("schema_version")
    if schema != SCHEMA_VERSION:
        problems.append(f"schema_version {schema!r} is not {SCHEMA_VERSION} (written by "
                        "another modelship release?)")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        problems.append("'files' must be a non-empty mapping of name -> {sha256, size}")
    else:
        for name, entry in files.items():
            if not isinstance(entry, dict) or not _HEX64.match(str(entry.get("sha256", ""))) \
                    or not isinstance(entry.get("size"), int) or entry["size"] < 0:
                problems.append(f"files.{name} must be {{sha256: 64 hex digits, size: bytes}}")
    if not _HEX64.match(str(manifest.get("config_sha256", ""))):
        problems.append("'config_sha256' must be 64 hex digits")
    if not isinstance(manifest.get("config_size"), int):
        problems.append("'config_size' must be an integer (bytes)")
    return problems


def digest_mismatch(name: str, expected: FileDigest, found: FileDigest | None) -> str | None:
    """Why ``found`` is not ``expected`` (one phrase naming ``name``); None when it is."""
    if found is None:
        return f"{name} is missing"
    if found.size != expected.size:
        return f"{name} has {found.size} bytes, the manifest says {expected.size}"
    if found.sha256 != expected.sha256:
        shown = found.sha256[:12] or "none"
        return f"{name} has sha256 {shown}, the manifest says {expected.sha256[:12]}"
    return None


# --------------------------------------------------------------------------------------
# verification and listing


def verify_staged(
    storage: S3Storage,
    *,
    model: str,
    version: int,
    repository_prefix: str,
    deep: bool = False,
    signing_key: bytes | None = None,
) -> dict[str, Any]:
    """Check that a staged version is complete and unchanged; returns its manifest.

    By default each file is checked by HEAD (size and the sha256 metadata written at
    staging); ``deep=True`` also streams and hashes every file, which catches an object
    rewritten with forged metadata (costs a full read). With ``signing_key`` the manifest
    must carry a valid signature made with that key (see :mod:`modelship.signing`), which
    catches a manifest rewritten to match tampered files.

    Raises:
        StagingError: the manifest is missing, invalid, unsigned or forged, or a file is
            missing or differs from it. Every problem is listed in one message.
    """
    return read_verified(storage, model=model, version=version,
                         repository_prefix=repository_prefix, deep=deep,
                         signing_key=signing_key).manifest


@dataclass(frozen=True)
class VerifiedVersion:
    """A staged version that passed verification, with what the swap needs from it.

    Attributes:
        manifest: The parsed (and, when a key was given, signature-checked) manifest.
        manifest_sha256: The sha256 of the manifest's bytes as read for this verification
            (what :func:`modelship.ledger.candidate_digest` binds a release to).
        config_pbtxt: The version's ``config.pbtxt`` as read (and hashed) during the check.
        probe: The golden probe recorded at staging, None when the manifest has none.
        bytes_hashed: Bytes streamed and hashed (0 unless ``deep``).
        seconds: Wall time of the verification, in s.
    """

    manifest: dict[str, Any]
    manifest_sha256: str
    config_pbtxt: str
    probe: GoldenProbe | None
    bytes_hashed: int
    seconds: float


def read_verified(
    storage: S3Storage,
    *,
    model: str,
    version: int,
    repository_prefix: str,
    deep: bool = True,
    signing_key: bytes | None = None,
    manifest_read: tuple[dict[str, Any], str] | None = None,
) -> VerifiedVersion:
    """Verify a staged version (see :func:`verify_staged`) and keep its config and probe.

    The config is taken from the bytes that were hashed, so it is exactly what verified
    (never read a second time). The swap preflight and reconcile call this with ``deep``
    and the signing key. ``manifest_read`` is the manifest and its sha256 as the caller
    has just read them (:func:`read_manifest_body`), so it is not read twice; it is
    verified all the same.

    Raises:
        StagingError: as :func:`verify_staged`, plus a malformed probe.
    """
    started = time.monotonic()
    check_model(model)
    check_version(version)
    vprefix = version_prefix(repository_prefix, model, version)
    mkey = f"{vprefix}/{MANIFEST_NAME}"
    manifest, manifest_sha256 = _trusted_manifest(
        storage, mkey, model=model, version=version, signing_key=signing_key,
        found=manifest_read if manifest_read is not None else read_manifest_body(storage, mkey))
    problems, config_bytes, hashed = _check_files(storage, vprefix, manifest, deep=deep)
    if problems:
        raise StagingError(
            f"version {version} of {model} failed verification against its manifest: "
            f"{'; '.join(problems)}",
            hint=TAMPERED_HINT, model=model, version=version, problems=problems,
        )
    probe = None
    if manifest.get(PROBE_FIELD) is not None:
        try:
            probe = GoldenProbe.from_dict(manifest[PROBE_FIELD])
        except (TypeError, ValueError) as exc:
            raise StagingError(f"manifest {mkey} has a malformed probe ({exc})",
                               hint=TAMPERED_HINT, model=model, version=version) from exc
    return VerifiedVersion(manifest, manifest_sha256, config_bytes.decode(), probe, hashed,
                           time.monotonic() - started)


def _trusted_manifest(storage: S3Storage, mkey: str, *, model: str, version: int,
                      signing_key: bytes | None, found: tuple[dict[str, Any], str] | None
                      ) -> tuple[dict[str, Any], str]:
    """The manifest at ``mkey`` (``found``: as read, with its bytes' sha256), once it is
    known to be signed (with a key) and to describe ``model``/``version``: the file digests
    it lists are then worth checking.

    Raises:
        StagingError: the manifest is missing, unsigned or forged, or names another version.
    """
    if found is None:
        raise StagingError(
            f"version {version} of {model} is not staged: s3://{storage.bucket}/{mkey} does "
            "not exist",
            hint=f"run `modelship stage {model} --version {version}` first",
            model=model, version=version, manifest_key=mkey,
        )
    manifest, sha256 = found
    if signing_key is not None:
        problem = signature_problem(manifest, signing_key)
        if problem is not None:
            raise StagingError(
                f"manifest s3://{storage.bucket}/{mkey} of {model}/{version} is refused: "
                f"{problem}",
                hint=TAMPERED_HINT + "; a version staged before manifests were signed, or "
                "with another stack's key, must be staged again the same way",
                model=model, version=version, manifest_key=mkey,
            )
    if manifest.get("model") != model or manifest.get("version") != version:
        raise StagingError(
            f"manifest {mkey} describes {manifest.get('model')}/{manifest.get('version')}, "
            f"not {model}/{version}",
            hint=TAMPERED_HINT, model=model, version=version, manifest_key=mkey,
        )
    return manifest, sha256


def _check_files(storage: S3Storage, vprefix: str, manifest: dict[str, Any], *,
                 deep: bool) -> tuple[list[str], bytes, int]:
    """Each file against the manifest: by HEAD, and by content when ``deep`` (the config
    always, so the bytes kept are the ones that verified).

    Returns:
        Every problem found, the config's bytes, and the bytes hashed for ``deep``.
    """
    expected = {n: FileDigest(e["sha256"], e["size"]) for n, e in manifest["files"].items()}
    expected[CONFIG_NAME] = FileDigest(manifest["config_sha256"], manifest["config_size"])
    problems = []
    config_bytes = b""
    hashed = 0
    for name, digest in sorted(expected.items()):
        key = f"{vprefix}/{name}"
        found = remote_digest(storage.head(key))
        problem = digest_mismatch(name, digest, found)
        if problem is None and (deep or name == CONFIG_NAME):
            content, kept = _stream_digest(storage, key, keep=name == CONFIG_NAME)
            hashed += content.size if deep else 0
            config_bytes = kept if name == CONFIG_NAME else config_bytes
            problem = digest_mismatch(name, digest, content)
            if problem:
                problem += " (content)"
        if problem:
            problems.append(problem)
    return problems, config_bytes, hashed


def _stream_digest(storage: S3Storage, key: str, *, keep: bool) -> tuple[FileDigest, bytes]:
    """sha256 and size of an object's content, streamed; its bytes too when ``keep``."""
    hasher = hashlib.sha256()
    size = 0
    kept: list[bytes] = []
    for chunk in storage.iter_bytes(key, chunk_bytes=HASH_CHUNK_BYTES):
        hasher.update(chunk)
        size += len(chunk)
        if keep:
            kept.append(chunk)
    return FileDigest(hasher.hexdigest(), size), b"".join(kept)


def version_folders(storage: S3Storage, model: str, repository_prefix: str
                    ) -> dict[int, set[str]]:
    """Numeric folders under ``P/<model>/`` and the file names in each."""
    prefix = model_prefix(repository_prefix, model) + "/"
    folders: dict[int, set[str]] = {}
    for key in storage.list_keys(prefix):
        head, sep, rest = key[len(prefix):].partition("/")
        if sep and head.isdigit() and rest:
            folders.setdefault(int(head), set()).add(rest)
    return folders


def staged_versions(storage: S3Storage, *, model: str, repository_prefix: str) -> list[int]:
    """Versions of ``model`` that have a manifest, ascending (not verified: see verify_staged)."""
    check_model(model)
    folders = version_folders(storage, model, repository_prefix)
    return sorted(v for v, names in folders.items() if MANIFEST_NAME in names)


def staged_config(storage: S3Storage, *, repository_prefix: str, model: str,
                  version: int) -> ModelConfig:
    """The config staged with a version (``P/<model>/<V>/config.pbtxt``).

    Raises:
        ModelNotFound: nothing at all is staged for the model (an unknown or misspelt
            name), or this version is not staged (the message lists those that are).
    """
    key = f"{version_prefix(repository_prefix, model, version)}/{CONFIG_NAME}"
    if not storage.exists(key):
        staged = staged_versions(storage, model=model, repository_prefix=repository_prefix)
        if not staged:
            raise ModelNotFound(
                f"model {model!r} is unknown to the repository: no version of it is staged "
                f"under s3://{storage.bucket}/{model_prefix(repository_prefix, model)}/",
                hint="check the model name (the MLflow registered-model name); a new model "
                f"is released with `modelship promote {model} --version V`",
                model=model, version=version,
            )
        raise ModelNotFound(
            f"version {version} of {model} is not staged (staged: "
            f"{', '.join(f'v{v}' for v in staged)})",
            hint=f"release it with `modelship promote {model} --version {version}` (check, "
            f"stage, canary, swap), or stage it alone with `modelship stage {model} --version "
            f"{version}`; or pick a staged version",
            model=model, version=version, staged=staged,
        )
    return from_pbtxt(storage.get_bytes(key).decode())
