"""The check's cache: a passed check's export and verdicts, reused when its inputs are
byte-identical.

What a check computes from the candidate's bytes alone (the exported ONNX graph and its
parity, the GX input and output checks, the trial load's answers) is a function of:

- the artifact's content (:func:`artifact_digest`: every file the version holds; of the
  ``MLmodel`` file, everything but what MLflow writes per registration),
- the golden rows (the digest of the parquet file the check read),
- the policy sections the check reads (``export``, ``validation``, ``triton``),
- modelship's version and the source of the modules that do the check,
- the versions of the libraries that export, run and check the graph,
- the Triton runtime of the trial load (the canary's server version and target).

:func:`cache_key` hashes those (pure, table-tested). A check with the same key reuses the
earlier result; anything that differs is a miss and a fresh check. Only a PASS is stored:
a failure always runs again. The stages that read outside state (preflight, resolve,
golden, validate against production, stage) always run.

The cache lives in the stack home (``<home>/cache/check/<key>/``) so it survives
processes. An entry is written under a temporary name and renamed into place (a reader
never sees half an entry), and it lists the sha256 of each of its files: an entry whose
files do not match (corrupt, truncated, edited) is deleted and the check runs fresh;
it is never trusted. ``MODELSHIP_CHECK_CACHE=0`` or ``modelship check --no-cache`` turns
the cache off.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from modelship.jsonable import jsonable

#: Bump when the entry's layout or meaning changes: older entries become misses.
CACHE_FORMAT = 1

#: What MLflow writes into ``MLmodel`` per registration: not the model's content.
RUN_SPECIFIC_MLMODEL_KEYS = frozenset({
    "artifact_path", "model_id", "model_uuid", "run_id", "utc_time_created"})

#: Files MLflow adds to a download of ``models:/NAME/N``: the registered name and version
#: (``registered_model_meta``), not the model's content. Hashing them made every version a
#: miss, even a byte-identical registration of the same artifact.
REGISTRATION_FILES = frozenset({"registered_model_meta"})

#: The libraries whose versions change what a check computes (export, parity, GX, Triton).
LIBRARIES = ("great-expectations", "mlflow", "numpy", "onnx", "onnxruntime", "pandas",
             "scikit-learn", "skl2onnx", "skops", "torch", "tritonclient")

#: The modules whose source decides the check's result.
CHECK_MODULES = ("tasks.check", "tasks.check_cache", "tasks.export", "tasks.expectations",
                 "tasks.trial_load", "tasks.validate", "modelship.triton.model_config",
                 "modelship.triton.target")

#: The policy sections the cached stages read.
POLICY_SECTIONS = ("export", "validation", "triton")

ENTRY_FILE = "entry.json"
OUTPUTS_FILE = "outputs.npz"


@dataclass(frozen=True)
class CheckInputs:
    """Everything a cached check's result is a function of (digests and versions)."""

    artifact: str
    flavor: str
    golden: str
    policy: str
    modelship: str
    libraries: tuple[tuple[str, str], ...]
    triton: str


def cache_key(inputs: CheckInputs) -> str:
    """The cache key of a check: sha256 of its inputs, canonical JSON (pure)."""
    body = json.dumps({"format": CACHE_FORMAT, **asdict(inputs)}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


# --------------------------------------------------------------------------------------
# the inputs' digests (I/O: files, package metadata)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def mlmodel_content(text: str) -> str:
    """The MLmodel file without what MLflow writes per registration, canonical (pure)."""
    parsed = yaml.safe_load(text) or {}
    if not isinstance(parsed, dict):
        return json.dumps(parsed, sort_keys=True, default=str)
    kept = {k: v for k, v in parsed.items() if k not in RUN_SPECIFIC_MLMODEL_KEYS}
    return json.dumps(kept, sort_keys=True, default=str)


def artifact_digest(local_dir: Path) -> str:
    """The digest of a downloaded model version: each file's path and bytes (the MLmodel
    file by :func:`mlmodel_content`; not :data:`REGISTRATION_FILES`)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(local_dir).as_posix()
        if rel in REGISTRATION_FILES:
            continue
        body = mlmodel_content(path.read_text()) if rel == "MLmodel" else file_sha256(path)
        digest.update(f"{rel}\0{body}\n".encode())
    return digest.hexdigest()


def policy_digest(policy: Any) -> str:
    """The digest of the policy sections the cached stages read."""
    sections = {name: getattr(policy, name).model_dump(mode="json") for name in POLICY_SECTIONS}
    return hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()


def modelship_digest() -> str:
    """modelship's version plus the source of the modules that decide a check."""
    digest = hashlib.sha256(_version("modelship").encode())
    for name in CHECK_MODULES:
        source = getattr(importlib.import_module(name), "__file__", None)
        digest.update(f"{name}\0{file_sha256(Path(source)) if source else '-'}\n".encode())
    return digest.hexdigest()


def library_versions() -> tuple[tuple[str, str], ...]:
    return tuple((name, _version(name)) for name in LIBRARIES)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def triton_runtime(canary: Any) -> str | None:
    """The canary Triton's runtime: its server version, extensions and target; None when
    the server names no version or its target cannot be read (then nothing is cached: the
    runtime is unknown). The target is read as the trial load reads it (and kept on
    ``canary``, so the trial load does not read it again)."""
    # lazy: the target probe pulls prometheus_client (~80 ms); only a trial load needs it
    from modelship.triton.target import detect_targets

    meta = canary.server_metadata()
    detect_targets([canary], timeout_s=canary.timeout_s)
    if not meta.get("version") or canary.target is None:
        return None
    return json.dumps({"name": meta.get("name"), "version": meta.get("version"),
                       "extensions": sorted(meta.get("extensions") or []),
                       "target": canary.target, "gpus": canary.gpu_count}, sort_keys=True)


# --------------------------------------------------------------------------------------
# the store


@dataclass(frozen=True)
class CachedCheck:
    """A passed check's reusable results, read back from a verified entry."""

    key: str
    subject: str
    """``model vN`` of the check that stored it."""
    stored_at: str
    files: dict[str, Path]
    """The exported graph's files inside the entry (verified)."""
    opset: int
    parity: dict[str, Any]
    checks: dict[str, Any]
    """``inputs``, ``outputs`` and ``trial_load`` as the check recorded them."""
    outputs: dict[str, np.ndarray]

    def describe(self) -> dict[str, Any]:
        """What a report says of a hit: the key and the check that stored it."""
        return {"hit": True, "key": self.key, "from": self.subject,
                "stored_at": self.stored_at}


class CheckCache:
    """Entries under ``root`` (``<home>/cache/check``), one folder per key."""

    def __init__(self, root: Path) -> None:
        self.root = root
        #: Why the last entry :meth:`load` found was discarded (None: none was).
        self.last_discarded: str | None = None

    def load(self, key: str) -> CachedCheck | None:
        """The entry of ``key``, verified; None when absent. An entry that does not verify
        is deleted (the caller rebuilds it)."""
        folder = self.root / key
        if not folder.is_dir():
            return None
        try:
            return _verified(folder, key)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            shutil.rmtree(folder, ignore_errors=True)
            self.last_discarded = f"{key}: {exc}"
            return None

    def store(self, key: str, *, subject: str, stored_at: str, files: Mapping[str, Path],
              opset: int, parity: Mapping[str, Any], checks: Mapping[str, Any],
              outputs: Mapping[str, np.ndarray]) -> bool:
        """Write one entry (atomically: a temporary folder renamed into place). False when
        the results cannot be stored as plain data (object arrays) or the entry exists."""
        if any(np.asarray(v).dtype.kind == "O" for v in outputs.values()):
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        scratch = self.root / f".tmp-{uuid.uuid4().hex}"
        scratch.mkdir()
        try:
            (scratch / "files").mkdir()
            digests = {}
            for name, path in files.items():
                shutil.copyfile(path, scratch / "files" / name)
                digests[name] = file_sha256(scratch / "files" / name)
            arrays: dict[str, Any] = {k: np.asarray(v) for k, v in outputs.items()}
            np.savez(scratch / OUTPUTS_FILE, **arrays)
            entry = {"format": CACHE_FORMAT, "key": key, "subject": subject,
                     "stored_at": stored_at, "files": digests,
                     "outputs": file_sha256(scratch / OUTPUTS_FILE), "opset": opset,
                     "parity": jsonable(dict(parity)), "checks": jsonable(dict(checks))}
            (scratch / ENTRY_FILE).write_text(json.dumps(entry, sort_keys=True))
            os.rename(scratch, self.root / key)
            return True
        except OSError:
            return False  # another check stored the same key first, or the disk refused
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _verified(folder: Path, key: str) -> CachedCheck:
    entry = json.loads((folder / ENTRY_FILE).read_text())
    if entry.get("format") != CACHE_FORMAT or entry.get("key") != key:
        raise ValueError("format or key differs")
    files: dict[str, Path] = {}
    for name, want in entry["files"].items():
        path = folder / "files" / name
        if file_sha256(path) != want:
            raise ValueError(f"{name}: sha256 differs from the entry's")
        files[name] = path
    if "model.onnx" not in files or file_sha256(folder / OUTPUTS_FILE) != entry["outputs"]:
        raise ValueError("no model.onnx, or the outputs' sha256 differs")
    with np.load(folder / OUTPUTS_FILE, allow_pickle=False) as saved:
        outputs = {name: saved[name] for name in saved.files}
    checks = entry["checks"]
    for name in ("inputs", "outputs", "trial_load"):
        if not isinstance(checks.get(name), dict) or checks[name].get("success") is not True:
            raise ValueError(f"check {name} has no recorded pass")
    return CachedCheck(key=key, subject=str(entry["subject"]),
                       stored_at=str(entry["stored_at"]), files=files,
                       opset=int(entry["opset"]), parity=dict(entry["parity"]),
                       checks=dict(checks), outputs=outputs)
