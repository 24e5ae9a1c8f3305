"""Each server of the embedded stack is the real thing (issue: foundation)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import pytest

from model_registry.client import point_mlflow_at
from modelship.clients import build_clients, check_endpoints
from modelship.errors import CredentialsRejected
from modelship.settings import Settings
from modelship.storage import S3Storage

pytestmark = pytest.mark.integration


def test_s3_accepts_the_stack_keys_and_refuses_others(stack_settings: Settings) -> None:
    clients = build_clients(stack_settings)
    assert clients.storage is not None
    clients.storage.ping()
    clients.storage.put_bytes("tests/hello.txt", b"hello")
    assert clients.storage.get_bytes("tests/hello.txt") == b"hello"

    forged = S3Storage(endpoint=str(stack_settings.s3_endpoint), bucket=stack_settings.bucket,
                       access_key="not-the-key", secret_key="not-the-secret", timeout_s=5)
    with pytest.raises(CredentialsRejected, match="refused the credentials") as info:
        forged.ping()
    assert "AWS_ACCESS_KEY_ID" in str(info.value)


def test_doctor_reports_every_endpoint_ok(stack_settings: Settings) -> None:
    clients = build_clients(stack_settings)
    checks = check_endpoints(clients, stack_settings)
    clients.close()
    names = [c.component for c in checks]
    assert names[:4] == ["mlflow", "s3", "prefect", "slack"]
    assert sum(n.startswith("triton") for n in names) == 3  # 2 replicas + canary
    assert all(c.ok for c in checks), [c.to_dict() for c in checks if not c.ok]


def test_mlflow_registers_a_model_whose_artifacts_land_in_s3(stack_settings: Settings) -> None:
    import mlflow
    from mlflow import MlflowClient
    from sklearn.linear_model import LogisticRegression

    point_mlflow_at(str(stack_settings.mlflow_tracking_uri))
    try:
        mlflow.set_experiment("stack-test")
        model = LogisticRegression().fit([[0.0], [1.0], [2.0], [3.0]], [0, 0, 1, 1])
        with mlflow.start_run():
            # explicit requirements, as the product's own logs do: without them MLflow
            # infers them in a Python subprocess that loads the model (~10 CPU-s)
            info = mlflow.sklearn.log_model(model, name="model",
                                            registered_model_name="stack-test-model",
                                            pip_requirements=["scikit-learn"])
        version = MlflowClient().get_model_version("stack-test-model",
                                                   str(info.registered_model_version))
        assert version.status == "READY"
    finally:
        mlflow.set_tracking_uri(None)
    storage = build_clients(stack_settings).storage
    assert storage is not None
    keys = list(storage.list_keys("mlflow/"))
    assert any(k.endswith("MLmodel") for k in keys), keys
    assert any(k.rsplit("/", 1)[-1].startswith("model.") for k in keys), keys  # the weights


def test_prefect_runs_a_flow_against_the_stack_server(stack_settings: Settings) -> None:
    code = textwrap.dedent("""
        from prefect import flow

        @flow(name="stack-smoke")
        def smoke() -> int:
            return 42

        assert smoke() == 42
    """)
    env = {"PATH": "/usr/bin:/bin", "PREFECT_API_URL": str(stack_settings.prefect_api_url),
           "PREFECT_HOME": str(stack_settings.home / "client-prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    request = urllib.request.Request(
        f"{stack_settings.prefect_api_url}/flow_runs/filter",
        data=json.dumps({"flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        runs = json.loads(response.read())
    assert any(run["state_type"] == "COMPLETED" for run in runs), runs


def test_slack_emulator_records_a_post_message(stack_settings: Settings) -> None:
    from slack_sdk import WebClient

    assert stack_settings.slack_token is not None
    client = WebClient(token=stack_settings.slack_token.get_secret_value(),
                       base_url=str(stack_settings.slack_api_url), timeout=5)
    posted = client.chat_postMessage(channel="#releases", text="stack smoke test")
    assert posted["ok"]
    base = str(stack_settings.slack_api_url).removesuffix("/api/")
    with urllib.request.urlopen(f"{base}/_emulator/messages", timeout=5) as response:
        messages = json.loads(response.read())["messages"]
    assert any(m["text"] == "stack smoke test" and m["ts"] == posted["ts"] for m in messages)


def _filer_request(url: str, method: str, data: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_filer_refuses_reads_and_writes_without_a_token(stack_settings: Settings) -> None:
    """Issue 10: the filer port was an unauthenticated write path into the bucket."""
    state = json.loads(stack_settings.stack_file.read_text())
    filer = state["seaweedfs"]["filer"]
    clients = build_clients(stack_settings)
    assert clients.storage is not None
    key = "tests/filer-door.txt"
    clients.storage.put_bytes(key, b"written through S3 with the keys")
    target = f"{filer}/buckets/{stack_settings.bucket}/{key}"

    assert _filer_request(target, "PUT", b"forged") == 401
    assert _filer_request(target, "POST", b"forged") == 401
    assert _filer_request(target, "DELETE") == 401
    assert _filer_request(target, "GET") == 401
    # S3 with the keys still reads and writes, and the object is untouched.
    assert clients.storage.get_bytes(key) == b"written through S3 with the keys"
    clients.storage.put_bytes(key, b"rewritten through S3")
    assert clients.storage.get_bytes(key) == b"rewritten through S3"


def test_the_stack_keeps_its_secrets_private(stack_settings: Settings) -> None:
    home = stack_settings.home
    assert stack_settings.manifest_signing_key is not None
    key = stack_settings.manifest_signing_key.get_secret_value()
    assert len(key) >= 32
    assert (home / "manifest-signing.key").read_text().strip() == key
    for path in (home, home / "data", home / "logs", home / "seaweedfs-conf"):
        assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
    for path in (home / "manifest-signing.key", home / "seaweedfs-conf" / "security.toml",
                 stack_settings.stack_file):
        assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
    # The key never goes into the bucket.
    clients = build_clients(stack_settings)
    assert clients.storage is not None
    for object_key in clients.storage.list_keys(""):
        if object_key.endswith(("release.json", ".pbtxt", ".key", ".toml")):
            assert key.encode() not in clients.storage.get_bytes(object_key), object_key
