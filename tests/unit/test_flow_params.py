"""The promote flow's parameters go to the Prefect API as pydantic's JSON of them: the same
document FastAPI's jsonable_encoder (Prefect's default) gives, without importing FastAPI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.encoders import jsonable_encoder

from flows.promote import PromoteParams, promote_flow
from tasks.prefect_tasks import ModelParamsFlow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("params", [
    PromoteParams(model="m", version=3),
    PromoteParams(model="m", alias="candidate", policy_file="/tmp/p.yaml", dry_run=True,
                  force=True, require_approval=False, approvers=["U1", "U2"],
                  requested_by="U3", trigger="cli", allow_breaking_changes=True),
    PromoteParams(model="m é", version=None, approvers=[], trigger="webhook"),
])
def test_model_parameters_are_serialized_as_prefect_would(params: PromoteParams) -> None:
    assert isinstance(promote_flow, ModelParamsFlow)
    assert promote_flow.serialize_parameters({"params": params}) == {
        "params": jsonable_encoder(params)}


@pytest.mark.parametrize("parameters", [
    {"params": PromoteParams(model="m"), "n": 3},  # not every value is a model
    {"path": Path("/tmp/x")},
    {},
])
def test_other_parameters_take_prefects_own_path(parameters: dict[str, object]) -> None:
    assert promote_flow.serialize_parameters(parameters) == {
        key: jsonable_encoder(value) for key, value in parameters.items()}


def test_a_flow_run_start_does_not_import_fastapi() -> None:
    code = ("import sys; from flows.promote import PromoteParams, promote_flow; "
            "promote_flow.serialize_parameters({'params': PromoteParams(model='m')}); "
            "print('fastapi' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=True)
    assert done.stdout.strip() == "False"
