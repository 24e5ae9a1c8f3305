"""The pre-deploy artifact gate: resolve, export, validate, trial load, and (optionally) stage.

Each stage is a plain function of ``tasks/`` and ``model_registry/``. :func:`run_check` is
what ``modelship check`` and ``modelship stage`` call (no Prefect server needed), the
promote flow's ``check`` task (:mod:`tasks.prefect_tasks`) and
:func:`flows.prefect_flows.check_flow` wrap it. Nothing here touches a serving model:
production keeps serving whatever it served.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_registry.client import PRODUCTION_ALIAS
from model_registry.golden import load_golden
from modelship.candidate import ExportedModel, GoldenInputs, ResolvedVersion
from modelship.clients import Clients, check_endpoints
from modelship.errors import ModelshipError, PreflightError, UsageError, ValidationFailed
from modelship.jsonable import jsonable
from modelship.policy import Policy
from modelship.progress import Progress, quiet
from modelship.repository import version_prefix
from modelship.settings import Settings
from modelship.signing import key_bytes
from modelship.triton.infer import TritonInference
from modelship.triton.model_config import from_pbtxt, to_pbtxt
from tasks import check_cache, export, validate
from tasks import stage as staging
from tasks.record import NextStep, StageRecorder

if TYPE_CHECKING:
    from modelship.triton.model_config import ModelConfig
    from tasks.check_cache import CachedCheck


@dataclass
class CheckReport:
    """What each stage found; the CLI prints it and the release record keeps it."""

    model: str
    version: int | None = None
    verdict: str = "running"
    stages: list[dict[str, Any]] = field(default_factory=list)
    resolved: ResolvedVersion | None = None
    golden: GoldenInputs | None = None
    exported: ExportedModel | None = None
    production_version: int | None = None
    config_pbtxt: str | None = None
    checks: dict[str, Any] = field(default_factory=dict)
    staged: dict[str, Any] | None = None
    cache: dict[str, Any] | None = None
    feed: dict[str, Any] = field(default_factory=dict, repr=False)
    outputs: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "verdict": self.verdict,
            "production_version": self.production_version,
            "stages": self.stages,
            "resolved": self.resolved.to_dict() if self.resolved else None,
            "golden": self.golden.to_dict() if self.golden else None,
            "export": self.exported.to_dict() if self.exported else None,
            "checks": self.checks,
            "config_pbtxt": self.config_pbtxt,
            "staged": self.staged,
            "cache": self.cache,
        }


class CheckStages(StageRecorder[dict[str, Any]]):
    """The check's stages in its report (``report.stages``): an error carries the stage
    (and the check within it) and the report so far, and sets the verdict."""

    def __init__(self, report: CheckReport, progress: Progress) -> None:
        self.report, self.progress = report, progress

    def _begin(self, name: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"stage": name, "ok": False}
        self.report.stages.append(entry)
        return entry

    def _failed(self, name: str, entry: dict[str, Any], exc: ModelshipError, seconds: float,
                next_step: NextStep | None) -> None:
        entry["error"] = exc.message
        entry["seconds"] = seconds
        self.report.verdict = "rejected" if exc.exit_code in (2, 3) else "error"
        check = exc.details.get("stage")
        if check and check != name:
            exc.details["check"] = check  # e.g. "contract" within the validate stage
        exc.details["stage"] = name
        exc.details["report"] = self.report.to_dict()

    def _ended(self, name: str, entry: dict[str, Any], seconds: float
               ) -> tuple[str, str | None]:
        entry["ok"] = True
        entry["seconds"] = seconds
        return "ok", None


def _stage(report: CheckReport, name: str, progress: Progress
           ) -> AbstractContextManager[dict[str, Any]]:
    """Time one stage, record its outcome, and attach the report to any error."""
    return CheckStages(report, progress).stage(name)


def preflight(clients: Clients, settings: Settings, *, need_storage: bool) -> None:
    """Ping what this run needs before anything happens; one error lists every failure."""
    needed = Clients(registry=clients.registry, storage=clients.storage if need_storage
                     else None, prefect=None, slack=None, replicas=[], canary=clients.canary)
    ignored = {"prefect", "slack", "triton", *(() if need_storage else ("s3",))}
    failed = [c for c in check_endpoints(needed, settings)
              if not c.ok and c.component not in ignored]
    lines = [f"{c.component} ({c.endpoint}): {c.reason}" for c in failed]
    codes = {c.exit_code for c in failed}
    if clients.canary is None:
        lines.append("canary Triton: not configured (set MODELSHIP_TRITON_CANARY)")
        codes.add(2)
    if lines:
        error = PreflightError(
            "cannot reach what this release needs: " + "; ".join(lines),
            hint="start the stack (`modelship stack up`) or fix the endpoints and "
            "credentials, then check with `modelship doctor`",
            unreachable=lines,
        )
        # Wrong settings (credentials, missing endpoints) are the user's to fix: exit 2.
        error.exit_code = 2 if codes == {2} else 1
        raise error


def run_check(
    settings: Settings,
    clients: Clients,
    policy: Policy,
    *,
    model: str,
    version: int | None = None,
    alias: str | None = None,
    workdir: Path,
    stage: bool = False,
    allow_breaking_changes: bool = False,
    dry_run: bool = False,
    docs: bool = True,
    cache: bool | None = None,
    progress: Progress = quiet,
) -> CheckReport:
    """Run the artifact gate on one candidate; raise the first stage's error.

    ``docs=False`` builds no GX Data Docs (for a ``workdir`` nobody reads afterwards).
    ``cache`` (default: ``settings.check_cache``) reuses a passed check of byte-identical
    inputs (:mod:`tasks.check_cache`); ``False`` forces a fresh check."""
    report = CheckReport(model=model)
    with _stage(report, "preflight", progress):
        preflight(clients, settings, need_storage=True)
    assert clients.registry is not None and clients.storage is not None \
        and clients.canary is not None
    resolved = _resolve(report, clients, model, version, alias, workdir, progress)
    golden = _golden(report, clients, policy, resolved, workdir, progress)
    lookup = _CacheLookup.open(settings, clients, policy, resolved, report,
                               settings.check_cache if cache is None else cache, progress)
    hit = lookup.hit
    _input_checks(report, policy, resolved, golden, workdir, docs, progress,
                  hit=None if docs else hit)
    exported = _export(report, policy, resolved, golden, workdir, progress, hit=hit)
    staged_config = _validate(report, settings, clients, policy, resolved, exported, golden,
                              allow_breaking_changes, progress)
    feed = export.golden_feed(golden, exported.spec, resolved.signature)
    outputs = _output_checks(report, policy, resolved, exported, feed, workdir, docs,
                             progress, hit=None if docs else hit)
    _trial_load(report, settings, clients, policy, resolved, exported, staged_config, feed,
                progress, hit=hit)
    report.feed, report.outputs = feed, outputs
    lookup.store(report, exported, outputs)
    if stage:
        stage_checked(settings, clients, policy, report, dry_run=dry_run, progress=progress)
    report.verdict = "passed"
    return report


@dataclass
class _CacheLookup:
    """The check cache for one check: its key and what it found (``hit``), or nothing
    when the cache is off or the inputs cannot be digested."""

    cache: Any = None
    key: str | None = None
    hit: Any = None

    @classmethod
    def open(cls, settings: Settings, clients: Clients, policy: Policy,
             resolved: ResolvedVersion, report: CheckReport, enabled: bool,
             progress: Progress) -> _CacheLookup:
        if not enabled:
            report.cache = {"hit": False, "disabled": True}
            return cls()
        assert clients.canary is not None and report.golden is not None
        runtime = check_cache.triton_runtime(clients.canary)
        if runtime is None:
            report.cache = {"hit": False, "reason": "the canary Triton names no version"}
            return cls()
        key = check_cache.cache_key(check_cache.CheckInputs(
            artifact=check_cache.artifact_digest(resolved.local_dir), flavor=resolved.flavor,
            golden=check_cache.file_sha256(report.golden.path),
            policy=check_cache.policy_digest(policy),
            modelship=check_cache.modelship_digest(),
            libraries=check_cache.library_versions(), triton=runtime))
        store = check_cache.CheckCache(Path(settings.home) / "cache" / "check")
        hit = store.load(key)
        if hit is not None:
            report.cache = hit.describe()
            progress(f"check cache: hit {key[:12]} (a passed check of {hit.subject}, "
                     f"{hit.stored_at}); `--no-cache` checks afresh")
        else:
            report.cache = {"hit": False, "key": key}
            if store.last_discarded:
                report.cache["discarded"] = store.last_discarded
                progress(f"check cache: discarded a corrupt entry ({store.last_discarded})")
        return cls(cache=store, key=key, hit=hit)

    def store(self, report: CheckReport, exported: ExportedModel,
              outputs: dict[str, Any]) -> None:
        """Keep a passed check's results (only on a miss; a hit is already there)."""
        if self.cache is None or self.key is None or self.hit is not None:
            return
        stored = self.cache.store(
            self.key, subject=f"{report.model} v{report.version}",
            stored_at=datetime.now(UTC).isoformat(timespec="seconds"),
            files=exported.files, opset=exported.opset, parity=exported.parity,
            checks={name: report.checks[name] for name in REQUIRED_CHECKS},
            outputs=outputs)
        if report.cache is not None:
            report.cache["stored"] = stored


def _resolve(report: CheckReport, clients: Clients, model: str, version: int | None,
             alias: str | None, workdir: Path, progress: Progress) -> ResolvedVersion:
    """The resolve stage: the version and its artifacts (downloaded), and what serves."""
    registry = clients.registry
    assert registry is not None
    with _stage(report, "resolve", progress) as entry:
        resolved = registry.resolve(model, version=version, alias=alias,
                                    download_dir=workdir / "artifacts")
        report.resolved, report.version = resolved, resolved.version
        report.production_version = registry.aliases(model).get(PRODUCTION_ALIAS)
        entry.update(flavor=resolved.flavor, uri=resolved.uri)
    return resolved


def _golden(report: CheckReport, clients: Clients, policy: Policy,
            resolved: ResolvedVersion, workdir: Path, progress: Progress) -> Any:
    """The golden stage: the golden rows (a DataFrame)."""
    assert clients.registry is not None
    with _stage(report, "golden", progress) as entry:
        golden_info, golden = load_golden(
            clients.registry, resolved, workdir=workdir / "golden",
            max_rows=policy.export.golden_max_rows,
            allow_synthetic=policy.export.allow_synthetic_golden)
        report.golden = golden_info
        entry.update(source=golden_info.source, rows=golden_info.rows,
                     synthetic=golden_info.source == "synthetic")
    return golden


def _input_checks(report: CheckReport, policy: Policy, resolved: ResolvedVersion,
                  golden: Any, workdir: Path, docs: bool, progress: Progress, *,
                  hit: CachedCheck | None) -> None:
    """The input_checks stage: the golden rows checked by GX (or a cached pass of them)."""
    with _stage(report, "input_checks", progress) as entry:
        if hit is not None:
            report.checks["inputs"] = dict(hit.checks["inputs"], docs_path=None)
            entry.update(evaluated=report.checks["inputs"].get("evaluated"), docs=None,
                         cache=hit.key)
            return
        from tasks import expectations  # lazy: pandas (~0.5 s); GX when it runs

        inputs = expectations.check_inputs(
            golden, policy.validation, signature_columns=_signature_columns(resolved.signature),
            out_dir=workdir / "checks" / "inputs", docs=docs)
        report.checks["inputs"] = inputs.to_dict()
        expectations.raise_for_failures(inputs, f"{resolved.uri} golden inputs")
        entry.update(evaluated=inputs.evaluated, docs=report.checks["inputs"]["docs_path"])


def _export(report: CheckReport, policy: Policy, resolved: ResolvedVersion, golden: Any,
            workdir: Path, progress: Progress, *, hit: CachedCheck | None) -> ExportedModel:
    """The export stage: the checked ONNX graph and its parity (or the cached export of
    the same bytes, checked again)."""
    def signature_contract(candidate: ExportedModel) -> None:
        validate.check_contract(resolved.signature, candidate.spec, None)

    with _stage(report, "export", progress) as entry:
        if hit is not None:
            exported = export.reuse_export(hit.files, resolved, policy.export,
                                           workdir / "export", parity=hit.parity)
            signature_contract(exported)
            entry.update(cache=hit.key)
        else:
            exported = export.export_model(resolved, golden, policy.export,
                                           workdir / "export",
                                           before_parity=signature_contract)
        report.exported = exported
        entry.update(opset=exported.opset, parity=exported.parity)
    return exported


def _validate(report: CheckReport, settings: Settings, clients: Clients, policy: Policy,
              resolved: ResolvedVersion, exported: ExportedModel, golden: Any,
              allow_breaking_changes: bool, progress: Progress) -> ModelConfig:
    """The validate stage: the rendered configs linted, the contract, breaking changes
    against production. Returns the staged config (its text goes in the report)."""
    storage = clients.storage
    assert storage is not None
    with _stage(report, "validate", progress) as entry:
        graph = exported.spec
        # Staged: the policy target's config (KIND_GPU on the fleet). Both it and its CPU form
        # are rendered and linted (tasks/validate.py, issue 13); the contract is checked on
        # the CPU form, and the trial load renders the staged one for the canary it runs on
        # (modelship.triton.target), as the canary and the swap do.
        rendered = validate.render_checked_configs(
            graph, policy, versions=[resolved.version],
            golden=export.golden_feed(golden, graph, resolved.signature))
        config = rendered.cpu
        validate.check_contract(resolved.signature, graph, config)
        production_spec = None
        if report.production_version is not None and \
                report.production_version != resolved.version:
            folder = version_prefix(settings.repository_prefix, report.model,
                                    report.production_version)
            key = f"{folder}/config.pbtxt"
            if storage.exists(key):
                production_spec = validate.spec_of_config(
                    from_pbtxt(storage.get_bytes(key).decode()))
        changes = validate.check_breaking(
            production_spec, report.production_version, graph,
            allowed=allow_breaking_changes or policy.validation.allow_breaking_changes)
        report.config_pbtxt = to_pbtxt(rendered.staged)
        entry.update(breaking_changes=changes, contract="ok", lint="ok")
    return rendered.staged


def _output_checks(report: CheckReport, policy: Policy, resolved: ResolvedVersion,
                   exported: ExportedModel, feed: dict[str, Any], workdir: Path,
                   docs: bool, progress: Progress, *, hit: CachedCheck | None
                   ) -> dict[str, Any]:
    """The output_checks stage: the exported graph's answers on the golden feed, checked
    by GX (or the cached answers and pass of the same graph and rows). Returns the answers."""
    with _stage(report, "output_checks", progress) as entry:
        if hit is not None:
            report.checks["outputs"] = dict(hit.checks["outputs"], docs_path=None)
            entry.update(evaluated=report.checks["outputs"].get("evaluated"), docs=None,
                         cache=hit.key)
            return dict(hit.outputs)
        # lazy: pandas (~0.5 s) and onnxruntime (~0.1 s) only when the outputs are checked
        from tasks import expectations, trial_load

        outputs = trial_load.run_onnxruntime(exported.onnx_path, feed)
        result = expectations.check_outputs(outputs, policy.validation,
                                            out_dir=workdir / "checks" / "outputs",
                                            docs=docs)
        report.checks["outputs"] = result.to_dict()
        expectations.raise_for_failures(result, f"{resolved.uri} outputs on the golden inputs")
        entry.update(evaluated=result.evaluated, docs=report.checks["outputs"]["docs_path"])
    return outputs


def _trial_load(report: CheckReport, settings: Settings, clients: Clients, policy: Policy,
                resolved: ResolvedVersion, exported: ExportedModel, config: ModelConfig,
                feed: dict[str, Any], progress: Progress, *, hit: CachedCheck | None
                ) -> None:
    """The trial_load stage: load the staged config on the canary, answer the golden feed
    within parity, unload (or the cached pass of the same bytes on the same runtime)."""
    canary = clients.canary
    assert canary is not None
    with _stage(report, "trial_load", progress) as entry:
        if hit is not None:
            report.checks["trial_load"] = dict(hit.checks["trial_load"])
            entry.update(server=report.checks["trial_load"].get("server"),
                         load_s=report.checks["trial_load"].get("load_s"), cache=hit.key)
            return
        from tasks import trial_load  # lazy: onnxruntime (~0.1 s) only for a trial load

        inference = TritonInference(canary.endpoint.http, timeout_s=settings.http_timeout_s)
        try:
            trial = trial_load.trial_load(canary, inference, model=report.model,
                                          version=resolved.version, config=config,
                                          files=exported.files, feed=feed,
                                          parity=policy.export.parity)
        finally:
            inference.close()
        report.checks["trial_load"] = trial
        entry.update(server=trial["server"], load_s=trial["load_s"])


def stage_checked(settings: Settings, clients: Clients, policy: Policy, report: CheckReport,
                  *, dry_run: bool = False, progress: Progress = quiet) -> None:
    """Stage a candidate that passed :func:`run_check` (``report.staged`` says what was
    done); with ``dry_run`` only the staging plan is computed."""
    registry, storage = clients.registry, clients.storage
    resolved, exported, golden_info = report.resolved, report.exported, report.golden
    if registry is None or storage is None or resolved is None or exported is None \
            or golden_info is None or report.config_pbtxt is None:
        raise UsageError("stage_checked needs a report from a passed check",
                         hint="run the check first")
    validation, problems = check_outcomes(report.checks)
    if problems:
        raise ValidationFailed(
            f"{report.model} v{resolved.version} is not staged: not every check recorded a "
            f"pass ({'; '.join(problems)})",
            hint="a check without a recorded pass counts as failed; run `modelship check` "
                 "again and read its report",
            stage="stage", checks=problems)
    graph, feed, outputs = exported.spec, report.feed, report.outputs
    model = report.model
    if dry_run:
        with _stage(report, "stage", progress) as entry:
            plan = staging.prepare_staging(
                storage, model=model, version=resolved.version, files=exported.files,
                config_pbtxt=report.config_pbtxt, repository_prefix=settings.repository_prefix)
            report.staged = {"dry_run": True, "plan": plan.describe(), **plan.to_dict()}
            for line in plan.describe():
                progress(f"plan: {line}")
            entry.update(dry_run=True)
    else:
        with _stage(report, "stage", progress) as entry:
            provenance = {
                "mlflow_uri": resolved.uri,
                "mlflow_tracking_uri": registry.tracking_uri,
                "source": resolved.source,
                "run_id": resolved.run_id,
                "flavor": resolved.flavor,
                "onnx_opset": exported.opset,
                "golden_source": golden_info.source,
                "parity": exported.parity,
                "validation": validation,
                "inputs": [t.__dict__ for t in graph.inputs],
                "outputs": [t.__dict__ for t in graph.outputs],
            }
            staged = staging.stage_version(
                storage, model=model, version=resolved.version, files=exported.files,
                config_pbtxt=report.config_pbtxt, provenance=jsonable(provenance),
                policy=policy.staging, repository_prefix=settings.repository_prefix,
                signing_key=key_bytes(settings.manifest_signing_key),
                probe=staging.golden_probe(feed, outputs, policy.export.parity),
                progress=progress)
            report.staged = staged.to_dict()
            entry.update(bytes_uploaded=staged.bytes_uploaded,
                         already_staged=staged.already_staged)


#: The checks :func:`run_check` records in ``report.checks``; staging needs each passed.
REQUIRED_CHECKS = ("inputs", "outputs", "trial_load")


def check_outcomes(checks: Mapping[str, object]) -> tuple[dict[str, bool], list[str]]:
    """Each recorded check's outcome, failing closed (pure).

    A check passed only when its result says ``"success": True``. A result without that
    key or with another value, and a required check with no result at all, count as
    failed; the second value says why, one line each (empty when all passed).
    """
    outcomes: dict[str, bool] = {}
    problems: list[str] = []
    for name in dict.fromkeys((*REQUIRED_CHECKS, *checks)):
        problem = _check_problem(checks.get(name))
        outcomes[name] = problem is None
        if problem is not None:
            problems.append(f"{name}: {problem}")
    return outcomes, problems


def _check_problem(result: object) -> str | None:
    if result is None:
        return "no result was recorded"
    if not isinstance(result, Mapping) or "success" not in result:
        return "its result says nothing of success"
    if result["success"] is not True:
        return f"its result says success={result['success']!r}"
    return None


def _signature_columns(signature: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    if not signature or not signature.get("inputs"):
        return None
    raw = signature["inputs"]
    specs = json.loads(raw) if isinstance(raw, str) else raw
    columns = [s for s in specs if s.get("type") != "tensor"]
    return columns or None


def parse_ref(version: int | None, alias: str | None) -> tuple[int | None, str | None]:
    """Exactly one of ``--version`` / ``--alias``."""
    if (version is None) == (alias is None):
        raise UsageError("pass exactly one of --version and --alias",
                         hint="e.g. `--version 3` or `--alias candidate`")
    return version, alias
