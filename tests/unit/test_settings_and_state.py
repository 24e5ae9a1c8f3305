"""Settings sources, the stack state file and the stack's command lines (pure pieces)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from modelship.errors import ModelshipError, StackError, UsageError
from modelship.settings import Settings, load_settings, settings_from_stack_state
from modelship.stack import components
from modelship.stack.process import ProcessRecord, free_ports, process_start_ticks
from modelship.stack.state import read_state, status_document, write_state

STATE = {
    "version": 1,
    "mlflow_uri": "http://127.0.0.1:5001",
    "s3_endpoint": "http://127.0.0.1:8333",
    "bucket": "models",
    "repository_prefix": "triton",
    "access_key": "key",
    "secret_key": "s3-private-value",
    "region": "us-east-1",
    "prefect_api_url": "http://127.0.0.1:4200/api",
    "slack_api_url": "http://127.0.0.1:3000/api/",
    "slack_token": "xoxb-test",
    "approvals_url": None,
    "triton": {
        "replicas": [{"name": "triton-0", "http": "http://127.0.0.1:8000",
                      "grpc": "127.0.0.1:8001", "metrics": "http://127.0.0.1:8002/metrics"}],
        "canary": {"name": "canary", "http": "http://127.0.0.1:9000",
                   "grpc": "127.0.0.1:9001", "metrics": "http://127.0.0.1:9002/metrics"},
    },
    "processes": [{"name": "mlflow", "pid": 1234, "start_ticks": 99, "ports": [5001],
                   "log": "/tmp/mlflow.log"}],
}

ENV_KEYS = ("MLFLOW_TRACKING_URI", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
            "PREFECT_API_URL", "MLFLOW_S3_ENDPOINT_URL", "AWS_DEFAULT_REGION")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("MODELSHIP_") or key in ENV_KEYS:
            monkeypatch.delenv(key, raising=False)


def _home_with_state(tmp_path: Path) -> Path:
    home = tmp_path / ".modelship"
    write_state(home / "stack.json", STATE)
    return home


def test_settings_fall_back_to_the_stack_file(tmp_path: Path) -> None:
    settings = load_settings(home=_home_with_state(tmp_path))
    assert settings.mlflow_tracking_uri == "http://127.0.0.1:5001"
    assert settings.bucket == "models"
    assert settings.aws_secret_access_key is not None
    assert settings.aws_secret_access_key.get_secret_value() == "s3-private-value"
    assert "s3-private-value" not in repr(settings)
    assert settings.triton_replicas[0].grpc == "127.0.0.1:8001"
    assert settings.triton_canary is not None and settings.triton_canary.name == "canary"
    assert settings.repository_url == "s3://127.0.0.1:8333/models/triton"


def test_environment_beats_the_stack_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.prod:5000")
    monkeypatch.setenv("MODELSHIP_BUCKET", "prod-models")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "prod-key")
    settings = load_settings(home=_home_with_state(tmp_path))
    assert settings.mlflow_tracking_uri == "http://mlflow.prod:5000"
    assert settings.bucket == "prod-models"
    assert settings.aws_access_key_id == "prod-key"
    assert settings.prefect_api_url == "http://127.0.0.1:4200/api"  # still from the file


def test_home_from_the_environment_selects_the_stack_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELSHIP_HOME", str(_home_with_state(tmp_path)))
    assert Settings().s3_endpoint == "http://127.0.0.1:8333"


def test_no_stack_file_means_defaults(tmp_path: Path) -> None:
    settings = load_settings(home=tmp_path / "nothing")
    assert settings.mlflow_tracking_uri is None and settings.triton_replicas == []
    with pytest.raises(UsageError, match="MODELSHIP_S3_ENDPOINT"):
        _ = settings.repository_url


def test_replicas_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("MODELSHIP_TRITON_REPLICAS", json.dumps(STATE["triton"]["replicas"]))
    assert load_settings(home=tmp_path).triton_replicas[0].http == "http://127.0.0.1:8000"


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("MODELSHIP_HTTP_TIMEOUT_S", "0", "http_timeout_s"),
    ("MODELSHIP_HTTP_TIMEOUT_S", "soon", "http_timeout_s"),
    ("MODELSHIP_TRITON_REPLICAS", "[{\"http\": 1}]", "triton_replicas"),
])
def test_invalid_settings_name_the_field(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         key: str, value: str, needle: str) -> None:
    monkeypatch.setenv(key, value)
    with pytest.raises(UsageError, match=needle) as info:
        load_settings(home=tmp_path)
    assert info.value.exit_code == 2


def test_corrupt_stack_file_is_a_usage_error_with_the_fix(tmp_path: Path) -> None:
    home = tmp_path / ".modelship"
    home.mkdir()
    (home / "stack.json").write_text("{")
    with pytest.raises(UsageError, match="stack.json") as info:
        load_settings(home=home)
    assert "stack down" in str(info.value)


def test_state_file_is_private_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "home" / "stack.json"
    write_state(path, STATE)
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_state(path) == STATE
    assert read_state(tmp_path / "absent.json") is None


@pytest.mark.parametrize("content", ["[1, 2]", '{"version": 99}', "not json"])
def test_unusable_state_file_says_what_to_do(tmp_path: Path, content: str) -> None:
    path = tmp_path / "stack.json"
    path.write_text(content)
    with pytest.raises(StackError) as info:
        read_state(path)
    assert "stack up" in str(info.value)


def test_status_document_has_the_design_schema() -> None:
    doc = status_document(STATE, {"mlflow": True})
    assert set(doc) >= {"mlflow_uri", "s3_endpoint", "bucket", "prefect_api_url",
                        "slack_api_url", "approvals_url", "triton"}
    assert doc["triton"]["replicas"] == [{"http": "http://127.0.0.1:8000",
                                          "grpc": "127.0.0.1:8001",
                                          "metrics": "http://127.0.0.1:8002/metrics"}]
    assert set(doc["triton"]["canary"]) == {"http", "grpc", "metrics"}
    assert doc["running"] is True
    assert status_document(STATE, {"mlflow": False})["running"] is False


def test_settings_mapping_skips_missing_values() -> None:
    assert settings_from_stack_state({"bucket": "b"}) == {"bucket": "b"}


def test_every_server_binds_to_loopback_only() -> None:
    ports = dict(zip(components.SEAWEED_PORT_NAMES, range(20000, 20010), strict=True))
    weed = components.seaweed_command(Path("weed"), data_dir=Path("/d"), bucket="b", ports=ports)
    assert "-ip.bind=127.0.0.1" in weed and "-master.telemetry=false" in weed
    assert all(f"={p}" in " ".join(weed) for p in ports.values())
    mlflow = components.mlflow_command(Path("bin"), db_path=Path("/m.db"), port=5000, bucket="b")
    assert mlflow[mlflow.index("--host") + 1] == "127.0.0.1"
    prefect = components.prefect_command(Path("bin"), port=4200)
    assert prefect[prefect.index("--host") + 1] == "127.0.0.1"
    env = components.mlflow_env({}, s3_endpoint="http://s3", access_key="k", secret_key="s",
                                region="r")
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert env["MLFLOW_DISABLE_TELEMETRY"] == "true"


def test_free_ports_are_distinct_and_leave_room_for_grpc_offsets() -> None:
    ports = free_ports(12)
    assert len(set(ports)) == 12 and max(ports) <= 55000


def test_process_record_round_trip_and_start_ticks() -> None:
    record = ProcessRecord("x", os.getpid(), process_start_ticks(os.getpid()), (1, 2), "log")
    assert ProcessRecord.from_dict(record.to_dict()) == record
    assert process_start_ticks(999_999_999) is None


def test_errors_carry_hint_and_exit_code() -> None:
    error = StackError("it broke", hint="do this", component="x")
    assert str(error) == "it broke. Do this."
    assert error.to_dict()["details"] == {"component": "x"}
    assert isinstance(error, ModelshipError) and error.exit_code == 1


def test_kubernetes_discovery_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert load_settings(home=tmp_path).kubernetes_discovery() is None
    monkeypatch.setenv("MODELSHIP_K8S_NAMESPACE", "serving")
    monkeypatch.setenv("MODELSHIP_K8S_SERVICE", "triton")
    monkeypatch.setenv("MODELSHIP_HTTP_TIMEOUT_S", "4")
    found = load_settings(home=tmp_path).kubernetes_discovery()
    assert found == {"namespace": "serving", "service": "triton", "http_port_name": "http",
                     "grpc_port_name": "grpc", "metrics_port_name": "metrics",
                     "timeout_s": 4.0}


def test_stopping_a_dead_leader_still_stops_its_orphaned_children(tmp_path: Path) -> None:
    import signal
    import time

    from modelship.stack.process import group_members, start_process, stop_process

    proc, record = start_process("fake-triton", ["sh", "-c", "sleep 60 & sleep 60 & wait"],
                                 env=dict(os.environ), log_path=tmp_path / "x.log")
    deadline = time.monotonic() + 5
    while len(group_members(record.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = [p for p in group_members(record.pid) if p != record.pid]
    assert len(children) == 2
    os.kill(record.pid, signal.SIGKILL)  # the leader dies on its own, as a crashed server
    proc.wait(timeout=5)
    assert stop_process(record) is False  # it was not running any more...
    deadline = time.monotonic() + 5
    while group_members(record.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(record.pid) == []  # ...but what it left behind is gone too
