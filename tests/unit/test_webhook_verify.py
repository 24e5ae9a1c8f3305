"""The MLflow webhook checks as tables: signature (MLflow's own signer), timestamp window,
replays, and what a verified payload asks for; plus the receiver's HTTP answers."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from mlflow.webhooks.delivery import _generate_hmac_signature

from modelship.webhooks.server import Receiver
from modelship.webhooks.verify import (
    DeliveryLog,
    Ignore,
    Rejected,
    StartPromote,
    decide,
    sign,
    verify,
)

SECRET = "s3cr3t-shared-with-mlflow"
NOW = 1_800_000_000.0


def _alias_payload(alias: str = "candidate", version: Any = "7",
                   name: str = "fraud") -> dict[str, Any]:
    return {"entity": "model_version_alias", "action": "created",
            "timestamp": "2026-12-01T00:00:00+00:00",
            "data": {"name": name, "alias": alias, "version": version}}


def _delivery(payload: Any, *, secret: str = SECRET, sent: float = NOW,
              delivery_id: str | None = None) -> tuple[dict[str, str], bytes]:
    body = json.dumps(payload)
    delivery_id = delivery_id or str(uuid.uuid4())
    stamp = str(int(sent))
    return ({"X-MLflow-Delivery-Id": delivery_id, "X-MLflow-Timestamp": stamp,
             "X-MLflow-Signature": _generate_hmac_signature(secret, delivery_id, stamp, body),
             "Content-Type": "application/json"}, body.encode())


def test_our_signature_is_mlflows() -> None:
    body = json.dumps(_alias_payload())
    assert sign(SECRET, "d1", "123", body.encode()) == \
        _generate_hmac_signature(SECRET, "d1", "123", body)


def test_a_good_delivery_verifies() -> None:
    headers, body = _delivery(_alias_payload())
    delivery = verify(SECRET, headers, body, now=NOW + 10)
    assert delivery.payload["data"]["version"] == "7" and delivery.timestamp == int(NOW)


def _tamper(case: str) -> tuple[dict[str, str], bytes, float]:
    headers, body = _delivery(_alias_payload())
    now = NOW
    if case == "wrong secret":
        headers, body = _delivery(_alias_payload(), secret="guessed")
    elif case == "body altered":
        body = body.replace(b'"7"', b'"8"')
    elif case == "id altered":
        headers["X-MLflow-Delivery-Id"] = str(uuid.uuid4())
    elif case == "timestamp altered":
        headers["X-MLflow-Timestamp"] = str(int(NOW) + 1)
    elif case == "no signature":
        del headers["X-MLflow-Signature"]
    elif case == "other version":
        headers["X-MLflow-Signature"] = "v2," + headers["X-MLflow-Signature"][3:]
    elif case == "stale":
        now = NOW + 301
    elif case == "from the future":
        now = NOW - 301
    elif case == "no delivery id":
        del headers["X-MLflow-Delivery-Id"]
    return headers, body, now


@pytest.mark.parametrize(("case", "status"), [
    ("wrong secret", 401), ("body altered", 401), ("id altered", 401),
    ("timestamp altered", 401), ("no signature", 401), ("other version", 401),
    ("stale", 401), ("from the future", 401), ("no delivery id", 400),
])
def test_refusals(case: str, status: int) -> None:
    headers, body, now = _tamper(case)
    with pytest.raises(Rejected) as caught:
        verify(SECRET, headers, body, now=now)
    assert caught.value.status == status


def test_exactly_at_the_window_edge_is_accepted() -> None:
    headers, body = _delivery(_alias_payload())
    assert verify(SECRET, headers, body, now=NOW + 300).delivery_id


def test_signed_garbage_is_a_bad_request() -> None:
    delivery_id, stamp, body = "d", str(int(NOW)), b"{not json"
    headers = {"X-MLflow-Delivery-Id": delivery_id, "X-MLflow-Timestamp": stamp,
               "X-MLflow-Signature": sign(SECRET, delivery_id, stamp, body)}
    with pytest.raises(Rejected) as caught:
        verify(SECRET, headers, body, now=NOW)
    assert caught.value.status == 400


@pytest.mark.parametrize(("payload", "expected"), [
    (_alias_payload(), StartPromote("fraud", 7, "candidate")),
    (_alias_payload(version=3), StartPromote("fraud", 3, "candidate")),
    (_alias_payload(alias="champion"), Ignore),
    ({"entity": "model_version", "action": "created", "data": {}}, Ignore),
    ({"entity": "model_version_alias", "action": "deleted", "data": {}}, Ignore),
    (_alias_payload(version="seven"), 400),
    (_alias_payload(version="0"), 400),
    (_alias_payload(name=""), 400),
    ({"entity": "model_version_alias", "action": "created", "data": "x"}, 400),
])
def test_decide(payload: dict[str, Any], expected: Any) -> None:
    if expected == 400:
        with pytest.raises(Rejected) as caught:
            decide(payload)
        assert caught.value.status == 400
    elif expected is Ignore:
        assert isinstance(decide(payload), Ignore)
    else:
        assert decide(payload) == expected


def test_the_delivery_log_refuses_replays_and_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "seen.json"
    log = DeliveryLog(path, keep_s=600)
    assert log.claim("a", now=NOW) and not log.claim("a", now=NOW + 1)
    assert not DeliveryLog(path, keep_s=600).claim("a", now=NOW + 2)  # restarted receiver
    log.release("a")
    assert log.claim("a", now=NOW + 3)
    assert DeliveryLog(path, keep_s=600).claim("a", now=NOW + 700)  # forgotten after keep_s


class _Starter:
    """Records what it was asked to start; optionally fails like an unreachable Prefect."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[StartPromote, str]] = []

    def start(self, action: StartPromote, delivery_id: str) -> str:
        from modelship.errors import Unreachable

        if self.fail:
            raise Unreachable("Prefect did not answer")
        self.calls.append((action, delivery_id))
        return f"run-{len(self.calls)}"


def test_the_receiver_starts_once_per_delivery_and_nothing_for_forgeries() -> None:
    starter = _Starter()
    receiver = Receiver(SECRET, starter, DeliveryLog(None))  # type: ignore[arg-type]
    headers, body = _delivery(_alias_payload())
    forged, _ = _delivery(_alias_payload(), secret="guessed")
    stale, stale_body = _delivery(_alias_payload(), sent=NOW - 3600)
    answers = [receiver.handle(forged, body, now=NOW)[0],
               receiver.handle(stale, stale_body, now=NOW)[0],
               receiver.handle(headers, body, now=NOW)[0],
               receiver.handle(headers, body, now=NOW + 1)[0]]
    assert answers == [401, 401, 201, 409]
    assert [(a.model, a.version) for a, _ in starter.calls] == [("fraud", 7)]
    ignored, ignored_body = _delivery(_alias_payload(alias="champion"))
    assert receiver.handle(ignored, ignored_body, now=NOW)[0] == 202
    assert len(starter.calls) == 1


def test_a_failed_start_is_503_and_the_retry_may_succeed() -> None:
    starter = _Starter(fail=True)
    receiver = Receiver(SECRET, starter, DeliveryLog(None))  # type: ignore[arg-type]
    headers, body = _delivery(_alias_payload())
    assert receiver.handle(headers, body, now=NOW)[0] == 503
    starter.fail = False
    status, doc = receiver.handle(headers, body, now=NOW + 2)
    assert status == 201 and doc["started"]["flow_run_id"] == "run-1"
