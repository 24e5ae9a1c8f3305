"""The lock's decisions and the stack's kept keys and ports, as tables (pure functions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelship.cli.demo import flow_run_links
from modelship.cli.locks import render_locks
from modelship.locks import Decision, LockHolder, Observed, decide, lock_key, slot_key
from modelship.stack.components import prefect_env, prefect_ui_url
from modelship.stack.keys import KEY_MAKERS, complete_keys, reusable_ports, stack_keys

HOLDER = LockHolder(model="m", release_id="r1", kind="promote", host="h1", pid=42,
                    pid_start=777, since=0.0, heartbeat=0.0, lease_id="t1")


def _alive(holder: LockHolder) -> bool:
    return holder.release_id == "live"


LIVE = LockHolder(**{**HOLDER.__dict__, "release_id": "live"})


@pytest.mark.parametrize(("seen", "action", "took_over"), [
    (Observed(etag=None), "create", None),                                # never taken
    (Observed(etag='"e"', released=True), "replace", None),               # released
    (Observed(etag='"e"', holder=LIVE, age_s=5), "refuse", None),         # a live holder
    (Observed(etag='"e"', holder=HOLDER, age_s=5), "replace", HOLDER),    # a gone holder
    (Observed(etag='"e"', holder=HOLDER, age_s=500), "replace", HOLDER),  # gone, old
    (Observed(etag='"e"', age_s=5), "refuse", None),                      # unknown, fresh
    (Observed(etag='"e"', age_s=None), "refuse", None),                   # unknown, no clock
    (Observed(etag='"e"', age_s=60), "replace", None),                    # unknown, a lease
    (Observed(etag='"e"', age_s=59.9), "refuse", None),                   # just under it
])
def test_decide(seen: Observed, action: str, took_over: LockHolder | None) -> None:
    decision = decide(seen, alive=_alive, lease_s=60)
    assert (decision.action, decision.took_over) == (action, took_over)
    assert decision.reason


def test_an_unreadable_document_is_refused_with_its_age_named() -> None:
    decision = decide(Observed(etag='"e"', age_s=12), alive=_alive, lease_s=60)
    assert decision == Decision("refuse", reason="unreadable lock document, written 12 s ago")
    assert Observed(etag='"e"', age_s=12).unreadable
    assert not Observed(etag='"e"', released=True).unreadable
    assert not Observed(etag=None).unreadable


def test_lock_keys_quote_model_names() -> None:
    assert lock_key("fraud") == "locks/release/fraud.json"
    assert lock_key("team/fraud v2") == "locks/release/team%2Ffraud%20v2.json"
    assert slot_key("canary") == "locks/canary/canary.json"


@pytest.mark.parametrize(("existing", "made"), [
    ({}, sorted(KEY_MAKERS)),
    ({name: "kept" for name in KEY_MAKERS}, []),
    ({**{name: "kept" for name in KEY_MAKERS}, "mlflow_webhook_key": ""}, ["mlflow_webhook_key"]),
    ({"access_key": "kept", "unknown_extra": "x"}, sorted(set(KEY_MAKERS) - {"access_key"})),
])
def test_complete_keys_keeps_what_exists_and_makes_only_what_is_missing(
        existing: dict[str, Any], made: list[str]) -> None:
    keys, new = complete_keys(existing)
    assert sorted(new) == made
    assert set(keys) >= set(KEY_MAKERS)
    for name, value in existing.items():
        if value:
            assert keys[name] == value


def test_stack_keys_are_made_once_per_home_and_private(tmp_path: Path) -> None:
    first, made = stack_keys(tmp_path)
    assert sorted(made) == sorted(KEY_MAKERS)
    assert (tmp_path / "stack-keys.json").stat().st_mode & 0o777 == 0o600
    again, made_again = stack_keys(tmp_path)
    assert again == first and made_again == []
    from cryptography.fernet import Fernet

    Fernet(first["mlflow_webhook_key"].encode())  # a valid Fernet key


SAVED = {"ports": [1, 2, 3], "approvals": 4, "webhooks": 5}


@pytest.mark.parametrize(("saved", "busy", "expected"), [
    (SAVED, set(), ([1, 2, 3], 4, 5)),
    (SAVED, {2}, None),                                  # one is taken now
    (SAVED, {5}, None),                                  # the webhooks port is taken
    (SAVED, {10001}, None),                              # a port derived from one of them
    ({**SAVED, "ports": [1, 2]}, set(), None),           # another replica count
    ({**SAVED, "approvals": None}, set(), None),         # written by an older modelship
    ({}, set(), None),                                   # a new home
    ({**SAVED, "ports": [1, "x", 3]}, set(), None),      # not ports
])
def test_reusable_ports(saved: dict[str, Any], busy: set[int],
                        expected: tuple[list[int], int, int] | None) -> None:
    assert reusable_ports(saved, count=3, is_busy=lambda p: p in busy,
                          derived=lambda ports: [ports[0] + 10000]) == expected


def test_prefect_runs_with_its_ui_pointed_at_its_own_api_and_durable_leases() -> None:
    env = prefect_env({"PREFECT_UI_API_URL": "http://elsewhere/api", "PATH": "/bin"},
                      prefect_home=Path("/h"), db_path=Path("/h/p.db"), port=4321)
    assert env["PREFECT_UI_ENABLED"] == "true"
    assert env["PREFECT_UI_API_URL"] == "http://127.0.0.1:4321/api"
    assert env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"].endswith("lease_storage.filesystem")
    assert prefect_ui_url("http://127.0.0.1:4321/api") == "http://127.0.0.1:4321"
    assert prefect_ui_url("http://127.0.0.1:4321/api/") == "http://127.0.0.1:4321"


def test_demo_links_each_release_to_its_flow_run_page() -> None:
    releases = [{"id": "r1", "holder": {"flow_run_id": "f1"}}, {"id": "r2", "holder": {}}]
    assert flow_run_links("http://ui", releases) == {"r1": "http://ui/runs/flow-run/f1"}
    assert flow_run_links(None, releases) == {}


def test_locks_table_says_how_to_free_a_gone_or_unknown_holder() -> None:
    gone = {"model": "m", "lock": "release", "held": True, "holder": HOLDER.to_dict(),
            "holder_alive": False}
    unknown = {"model": "n", "lock": "release", "held": True, "holder": None,
               "holder_alive": None}
    canary = {"model": "c", "lock": "canary", "held": True, "holder": HOLDER.to_dict(),
              "holder_alive": False}
    text = render_locks([gone, unknown, canary], None)
    assert "`modelship unlock m --release r1`" in text
    assert "`modelship unlock n`" in text and "unknown" in text
    assert "`modelship unlock c --canary --release r1`" in text
    assert render_locks([], "m") == "no lock is held for m"


def test_webhooks_encrypted_with_a_lost_key_are_dropped_and_the_rest_kept(
        tmp_path: Path) -> None:
    import sqlite3

    from cryptography.fernet import Fernet

    from modelship.stack.keys import drop_undecryptable_webhooks

    kept, lost = Fernet.generate_key(), Fernet.generate_key()
    db_path = tmp_path / "mlflow.db"
    with sqlite3.connect(db_path) as db:
        db.execute("CREATE TABLE webhooks (webhook_id TEXT, url TEXT, secret TEXT)")
        db.execute("CREATE TABLE webhook_events (webhook_id TEXT, entity TEXT)")
        for webhook_id, key in (("w-kept", kept), ("w-lost", lost)):
            db.execute("INSERT INTO webhooks VALUES (?, ?, ?)", (
                webhook_id, f"http://x/{webhook_id}", Fernet(key).encrypt(b"s").decode()))
            db.execute("INSERT INTO webhook_events VALUES (?, 'model_version')", (webhook_id,))
        db.execute("INSERT INTO webhooks VALUES ('w-none', 'http://x/none', NULL)")
    assert drop_undecryptable_webhooks(db_path, kept.decode()) == ["http://x/w-lost"]
    with sqlite3.connect(db_path) as db:
        assert sorted(r[0] for r in db.execute("SELECT webhook_id FROM webhooks")) == [
            "w-kept", "w-none"]
        assert [r[0] for r in db.execute("SELECT webhook_id FROM webhook_events")] == ["w-kept"]
    assert drop_undecryptable_webhooks(tmp_path / "absent.db", kept.decode()) == []
