"""The pre-deploy artifact gate on the real stack: good candidates pass, bad ones are
rejected at the right stage with a message that names the fix, and production keeps
serving what it served. ``check`` by alias runs through the console script (its JSON report
and stderr progress); the other commands run in the test process
(:func:`tests.inprocess.run_inprocess`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flows.check import run_check
from model_registry.client import point_mlflow_at
from modelship.clients import Clients
from modelship.errors import ModelNotFound, ModelshipError
from modelship.policy import Policy, policy_for
from modelship.settings import Settings
from modelship.triton.infer import TritonInference
from modelship.triton.model_config import from_pbtxt, to_json, with_versions
from tests import models
from tests.conftest import run_cli
from tests.inprocess import run_inprocess

pytestmark = pytest.mark.integration

MODEL = "gate"


@dataclass
class Production:
    version: int
    outputs: dict[str, np.ndarray]
    feed: dict[str, np.ndarray]
    report: Any  # its check: a fresh one (new bytes), staged, with Data Docs


def _check(stack_settings: Settings, clients: Clients, tmp: Path, *, version: int | None = None,
           alias: str | None = None, policy: Policy | None = None, stage: bool = False,
           model: str = MODEL, docs: bool = False) -> Any:
    """``run_check`` as ``modelship check`` runs it; GX Data Docs only where a test reads
    them (``docs``: a build renders every validation this process has run so far)."""
    return run_check(stack_settings, clients, policy or Policy(), model=model, version=version,
                     alias=alias, workdir=tmp, stage=stage, docs=docs)


@pytest.fixture(scope="module")
def production(stack_settings: Settings, clients: Clients,
               tmp_path_factory: pytest.TempPathFactory) -> Production:
    """v1 of the model: checked, staged, aliased `production` and served by replica 0."""
    uri = str(stack_settings.mlflow_tracking_uri)
    version = models.register_sklearn(uri, MODEL)
    report = _check(stack_settings, clients, tmp_path_factory.mktemp("prod"), version=version,
                    stage=True, docs=True)
    assert report.verdict == "passed"
    for suite in ("inputs", "outputs"):  # the Data Docs of both suites, as the CLI builds them
        assert Path(report.checks[suite]["docs_path"]).is_file(), report.checks[suite]
    assert clients.registry is not None
    clients.registry.set_alias(MODEL, "production", version)
    replica = clients.replicas[0]
    config = with_versions(from_pbtxt(report.config_pbtxt), [version])
    replica.load_model(MODEL, config_json=to_json(config))
    feed = {"input": np.random.default_rng(1).standard_normal((8, models.N_FEATURES))
            .astype(np.float32)}
    inference = TritonInference(replica.endpoint.http, timeout_s=10)
    answer = inference.infer(MODEL, feed, outputs=["label", "probabilities"])
    inference.close()
    assert answer.model_version == str(version)
    return Production(version=version, outputs=answer.outputs, feed=feed, report=report)


def _assert_production_untouched(clients: Clients, production: Production) -> None:
    replica = clients.replicas[0]
    assert replica.is_model_ready(MODEL, str(production.version))
    inference = TritonInference(replica.endpoint.http, timeout_s=10)
    answer = inference.infer(MODEL, production.feed, outputs=["label", "probabilities"])
    inference.close()
    assert answer.model_version == str(production.version)
    np.testing.assert_array_equal(answer.outputs["label"], production.outputs["label"])
    assert clients.registry is not None
    assert clients.registry.production_version(MODEL) == production.version
    # Other tests share the stack: look only at this model's entries.
    loaded = [m for m in replica.repository_index()
              if m.get("state") == "READY" and m.get("name") == MODEL]
    assert [int(m["version"]) for m in loaded] == [production.version]


CACHED_STAGES = ("input_checks", "export", "output_checks", "trial_load")


def test_a_passed_check_of_the_same_bytes_is_reused_and_a_corrupt_entry_rebuilt(
        stack_settings: Settings, clients: Clients, production: Production,
        tmp_path: Path) -> None:
    # The production fixture's check of these bytes passed: it is in the cache.
    hit = run_check(stack_settings, clients, Policy(), model=MODEL, version=production.version,
                    workdir=tmp_path / "hit", docs=False)
    assert hit.verdict == "passed" and hit.cache is not None and hit.cache["hit"], hit.cache
    key = hit.cache["key"]
    assert {s["stage"]: s.get("cache") for s in hit.stages if s["stage"] in CACHED_STAGES} \
        == dict.fromkeys(CACHED_STAGES, key)

    fresh = run_check(stack_settings, clients, Policy(), model=MODEL,
                      version=production.version, workdir=tmp_path / "fresh", docs=False,
                      cache=False)
    assert fresh.cache == {"hit": False, "disabled": True}
    assert not any("cache" in s for s in fresh.stages)
    # the cache gives what a fresh check gives: the same graph bytes, config and verdicts
    assert hit.exported.onnx_path.read_bytes() == fresh.exported.onnx_path.read_bytes()
    assert hit.config_pbtxt == fresh.config_pbtxt and hit.exported.spec == fresh.exported.spec
    assert hit.exported.parity == fresh.exported.parity
    for name in hit.outputs:
        np.testing.assert_array_equal(hit.outputs[name], fresh.outputs[name])
    assert hit.checks["trial_load"]["outputs"] == fresh.checks["trial_load"]["outputs"]

    entry = Path(stack_settings.home) / "cache" / "check" / key
    (entry / "files" / "model.onnx").write_bytes(b"not the graph")
    rebuilt = run_check(stack_settings, clients, Policy(), model=MODEL,
                        version=production.version, workdir=tmp_path / "rebuilt", docs=False)
    assert rebuilt.verdict == "passed"
    assert rebuilt.cache is not None and not rebuilt.cache["hit"]
    assert rebuilt.cache["key"] == key and "sha256" in rebuilt.cache["discarded"]
    assert rebuilt.cache["stored"] is True
    assert (entry / "files" / "model.onnx").read_bytes() \
        == fresh.exported.onnx_path.read_bytes()


def test_good_sklearn_candidate_passes_and_stages_a_verifiable_release(
        stack_settings: Settings, clients: Clients, production: Production,
        tmp_path: Path) -> None:
    """The production fixture's check is a full, fresh check of new sklearn bytes: every
    stage ran and passed. The same artifact registered as a new version passes again (the
    cache's pass of those bytes) and stages a release that verifies, which Triton loads
    from S3; production keeps serving."""
    import mlflow

    from modelship.repository import verify_staged

    fresh = production.report
    assert fresh.cache is not None and not fresh.cache["hit"], fresh.cache
    assert [s["stage"] for s in fresh.stages] == ["preflight", "resolve", "golden",
                                                  "input_checks", "export", "validate",
                                                  "output_checks", "trial_load", "stage"]
    assert fresh.golden.source == "input_example"
    assert fresh.checks["trial_load"]["outputs"]["label"]["passed"]

    assert clients.registry is not None
    point_mlflow_at(str(stack_settings.mlflow_tracking_uri))
    source = mlflow.MlflowClient().get_model_version(MODEL, str(production.version)).source
    version = int(mlflow.register_model(source, MODEL).version)
    report = _check(stack_settings, clients, tmp_path, version=version, stage=True)
    assert report.verdict == "passed" and report.version == version
    assert report.staged is not None and not report.staged["already_staged"]
    assert clients.storage is not None
    manifest = verify_staged(clients.storage, model=MODEL, version=version,
                             repository_prefix=stack_settings.repository_prefix)
    assert manifest["provenance"]["mlflow_uri"] == f"models:/{MODEL}/{version}"
    assert set(manifest["files"]) == {"model.onnx"}

    # Triton loads the staged version from S3 (a canary load, then gone again).
    canary = clients.canary
    assert canary is not None
    canary.load_model(MODEL, config_json=to_json(with_versions(
        from_pbtxt(report.config_pbtxt), [version])))
    try:
        assert canary.is_model_ready(MODEL, str(version))
    finally:
        canary.unload_model(MODEL)

    again = _check(stack_settings, clients, tmp_path / "again", version=version, stage=True)
    assert again.staged["already_staged"] and again.staged["bytes_uploaded"] == 0
    _assert_production_untouched(clients, production)


def test_good_onnx_candidate_with_external_data_passes(
        stack_settings: Settings, clients: Clients, tmp_path: Path) -> None:
    import mlflow

    uri = str(stack_settings.mlflow_tracking_uri)
    point_mlflow_at(uri)
    with mlflow.start_run():
        info = mlflow.onnx.log_model(models.sklearn_onnx(), name="model",
                                     registered_model_name="gate-onnx",
                                     signature=models.tensor_signature(),
                                     save_as_external_data=True,
                                     pip_requirements=models.ONNX_REQUIREMENTS)
    report = _check(stack_settings, clients, tmp_path, model="gate-onnx",
                    version=int(info.registered_model_version))
    assert report.verdict == "passed"
    assert report.golden.source == "synthetic"


def test_onnx_candidate_without_signature_gets_golden_rows_from_its_graph(
        stack_settings: Settings, clients: Clients, tmp_path: Path) -> None:
    import mlflow

    point_mlflow_at(str(stack_settings.mlflow_tracking_uri))
    with mlflow.start_run():
        info = mlflow.onnx.log_model(models.sklearn_onnx(), name="model",
                                     registered_model_name="gate-nosig",
                                     pip_requirements=models.ONNX_REQUIREMENTS)
    report = _check(stack_settings, clients, tmp_path, model="gate-nosig",
                    version=int(info.registered_model_version))
    assert report.verdict == "passed"
    assert report.golden.source == "synthetic" and report.golden.rows > 0


def test_sklearn_candidate_without_signature_gets_golden_rows_from_its_features(
        stack_settings: Settings, clients: Clients, tmp_path: Path) -> None:
    import mlflow

    model, _ = models.sklearn_classifier()
    point_mlflow_at(str(stack_settings.mlflow_tracking_uri))
    with mlflow.start_run():
        info = mlflow.sklearn.log_model(model, name="model",
                                        registered_model_name="gate-sk-nosig",
                                        pip_requirements=["scikit-learn"])
    report = _check(stack_settings, clients, tmp_path, model="gate-sk-nosig",
                    version=int(info.registered_model_version))
    assert report.verdict == "passed"
    assert report.golden.source == "synthetic"
    assert report.exported.spec.inputs[0].dims == (models.N_FEATURES,)


Builder = Callable[[str, Path], int]


def _onnx_case(graph: Callable[[], Any], **signature: Any) -> Builder:
    def build(uri: str, tmp: Path) -> int:
        return models.register_onnx(uri, MODEL, graph(),
                                    signature=models.tensor_signature(**signature))
    return build


def _dir_case(make: Callable[[Path], Path]) -> Builder:
    def build(uri: str, tmp: Path) -> int:
        return models.register_directory(uri, MODEL, make(tmp))
    return build


def _golden_with_nulls(uri: str, tmp: Path) -> int:
    frame, _ = models.training_data()
    frame = frame.head(32).copy()
    frame.loc[3, "f2"] = np.nan
    return models.register_sklearn(uri, MODEL, golden=frame)


def _breaking(uri: str, tmp: Path) -> int:
    return models.register_sklearn(uri, MODEL, n_features=models.N_FEATURES + 1)


BAD_CANDIDATES: list[tuple[str, Builder, dict[str, Any], str, str]] = [
    ("corrupt_onnx", _dir_case(models.corrupt_onnx_dir), {}, "export", "not a valid ONNX"),
    ("opset_above_policy", _onnx_case(lambda: models.sklearn_onnx(opset=19)),
     {"export": {"max_opset": 18}}, "export", "opset"),
    ("input_name_mismatch", _onnx_case(models.sklearn_onnx, name="features"), {}, "",
     "'features'"),
    ("dtype_mismatch", _onnx_case(models.sklearn_onnx, dtype=np.float64), {}, "", "float64"),
    ("dims_mismatch", _onnx_case(models.sklearn_onnx, width=models.N_FEATURES + 1), {}, "",
     "dims"),
    ("nan_outputs", _onnx_case(lambda: models.onnx_graph("nan")), {}, "output_checks",
     "NaN"),
    ("probabilities_out_of_range", _onnx_case(lambda: models.onnx_graph("scaled")), {},
     "output_checks", "probabilities"),
    ("parity_failure", _dir_case(models.parity_mismatch_dir), {}, "export", "label"),
    ("unsupported_flavor", _dir_case(models.pyfunc_only_dir), {}, "export", "python_function"),
    ("golden_violates_expectations", _golden_with_nulls, {}, "input_checks", "f2"),
    ("breaking_io_change", _breaking, {}, "validate", "changes the I/O"),
]


@pytest.mark.parametrize(("case", "build", "policy", "stage", "fragment"), BAD_CANDIDATES,
                         ids=[c[0] for c in BAD_CANDIDATES])
def test_bad_candidate_is_rejected_at_its_stage_and_production_keeps_serving(
        stack_settings: Settings, clients: Clients, production: Production, tmp_path: Path,
        case: str, build: Builder, policy: dict[str, Any], stage: str, fragment: str) -> None:
    version = build(str(stack_settings.mlflow_tracking_uri), tmp_path)
    policy_file = models.write_policy(tmp_path / "policy.yaml", policy)
    with pytest.raises(ModelshipError) as info:
        _check(stack_settings, clients, tmp_path / "run", version=version,
               policy=policy_for(MODEL, tmp_path, policy_file), stage=True)
    error = info.value
    assert error.exit_code in (2, 3), error
    assert fragment in str(error), str(error)
    assert error.hint, "every rejection says what to do"
    failed_stage = error.details["stage"]
    if stage:
        assert failed_stage == stage, (failed_stage, str(error))
    else:  # contract problems are found by export's graph checks or by validate
        assert failed_stage in {"export", "validate"}, (failed_stage, str(error))
    assert error.details["report"]["verdict"] == "rejected"
    assert clients.storage is not None
    assert not clients.storage.exists(
        f"{stack_settings.repository_prefix}/{MODEL}/{version}/release.json")
    _assert_production_untouched(clients, production)


def test_missing_version_and_alias_name_what_exists(
        stack_settings: Settings, clients: Clients, production: Production,
        tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="has no version 999") as info:
        _check(stack_settings, clients, tmp_path, version=999)
    assert info.value.exit_code == 2
    with pytest.raises(ModelNotFound, match="has no alias 'nope'") as info:
        _check(stack_settings, clients, tmp_path, alias="nope")
    assert "production -> v" in str(info.value) and "--version" in str(info.value)
    _assert_production_untouched(clients, production)


def test_cli_check_by_alias_prints_one_json_report(
        stack_settings: Settings, production: Production) -> None:
    done = run_cli("check", MODEL, "--alias", "production", "--json",
                   home=stack_settings.home)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["verdict"] == "passed" and report["version"] == production.version
    assert "trial_load ok" in done.stderr


def test_cli_lint_failing_policy_is_refused_with_exit_2(
        stack_settings: Settings, production: Production, tmp_path: Path) -> None:
    policy = models.write_policy(tmp_path / "bad.yaml", {"triton": {"max_batch_size": 0}})
    done = run_inprocess("check", MODEL, "--version", str(production.version), "--policy",
                         str(policy), "--json", home=stack_settings.home)
    assert done.returncode == 2, done.stderr[-2000:]
    error = json.loads(done.stdout)
    assert "max_batch_size" in error["message"] and str(policy) in error["message"]


def test_cli_staging_different_bytes_under_an_existing_version_is_refused(
        stack_settings: Settings, clients: Clients, production: Production,
        tmp_path: Path) -> None:
    policy = models.write_policy(tmp_path / "other.yaml", {"triton": {"max_batch_size": 16}})
    done = run_inprocess("stage", MODEL, "--version", str(production.version), "--policy",
                         str(policy), "--json", home=stack_settings.home)
    assert done.returncode == 3, done.stderr[-2000:]
    error = json.loads(done.stdout)
    assert error["error"] == "StagingError" and "immutable" in error["message"]
    _assert_production_untouched(clients, production)


def test_cli_wrong_s3_credentials_and_unreachable_mlflow(
        stack_settings: Settings, production: Production) -> None:
    wrong = run_inprocess("check", MODEL, "--version", str(production.version), "--json",
                          home=stack_settings.home,
                          env={"AWS_ACCESS_KEY_ID": "intruder",
                               "AWS_SECRET_ACCESS_KEY": "nope"})
    assert wrong.returncode == 2, wrong.stderr[-2000:]
    assert "refused the credentials" in json.loads(wrong.stdout)["message"]

    from modelship.stack.process import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    down = run_inprocess("check", MODEL, "--version", str(production.version), "--json",
                         home=stack_settings.home, env={"MLFLOW_TRACKING_URI": dead})
    assert down.returncode == 1, down.stderr[-2000:]
    error = json.loads(down.stdout)
    assert error["error"] == "PreflightError" and dead in error["message"]
    assert "did not answer" in error["message"]
