"""``modelship status`` reads every source at once and ends by its deadline."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from pydantic import SecretStr

from modelship.clients import Clients, build_clients
from modelship.errors import StorageError, Unreachable
from modelship.settings import Settings
from tasks.status import read_within, status_report


def test_a_call_that_does_not_return_by_the_deadline_is_unreachable() -> None:
    never = threading.Event()

    def fails() -> None:
        raise StorageError("refused")

    began = time.monotonic()
    got = read_within({"fast": lambda: 7, "hung": never.wait, "fails": fails},
                      deadline_s=0.3)
    assert time.monotonic() - began < 2.0
    assert got["fast"] == 7 and isinstance(got["fails"], StorageError)
    assert isinstance(got["hung"], Unreachable)
    assert got["hung"].message == "no answer within 0.3 s"
    never.set()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_every_source_down_is_named_once_and_status_still_answers(tmp_path: Path) -> None:
    port = _closed_port()
    settings = Settings(home=tmp_path, mlflow_tracking_uri=f"http://127.0.0.1:{port}",
                        s3_endpoint=f"http://127.0.0.1:{port}", aws_access_key_id="k",
                        aws_secret_access_key=SecretStr("s"), prefect_api_url=f"http://127.0.0.1:{port}/api",
                        http_timeout_s=2.0)
    clients = build_clients(settings)
    try:
        doc = status_report(settings, clients, model="m")
    finally:
        clients.close()
    assert sorted(u["source"] for u in doc["unreachable"]) == ["mlflow", "prefect", "s3"]
    assert doc["unread"] == ["mlflow", "prefect", "s3"]
    assert [d["kind"] for d in doc["disagreements"]] == ["no_replicas"]
    assert not doc["consistent"] and doc["next"].startswith("`modelship stack up`")
    assert doc["record"] is None and doc["pin"] is None and doc["aliases"] == {}


class _SlowToImport:
    """A registry whose first call pays a local cost (MLflow's import, ~4 s and more under
    load) unless it was warmed first; the server itself answers at once."""

    def __init__(self, import_s: float) -> None:
        self.import_s = import_s
        self.warmed = False

    def warm(self) -> None:
        time.sleep(self.import_s)
        self.warmed = True

    def aliases(self, name: str) -> dict[str, int]:
        if not self.warmed:
            self.warm()
        return {"production": 3}


def test_the_deadline_times_the_servers_not_the_imports(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, http_timeout_s=0.25)  # deadline 0.5 s
    registry = _SlowToImport(import_s=1.0)
    clients = Clients(registry=registry, storage=None, prefect=None,  # type: ignore[arg-type]
                      slack=None)
    doc = status_report(settings, clients, model="m")
    assert doc["unreachable"] == []
    assert doc["aliases"] == {"production": 3}
