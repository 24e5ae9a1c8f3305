"""The real fleet swap against the fake Triton fleet (bench/fake_triton.py): 5 replicas.

The coordinator is the one ``modelship swap`` runs (:func:`tasks.fleet.swap_unlocked`, with
clients built from settings); the candidate is staged, signed and verified in a private
SeaweedFS; only the replicas are simulated, in one process. What each replica was asked
to do is read back from the fake's call log, and what it serves from the fake's state,
never from the swap's own report. Timing belongs to ``bench/fleet_scale.py``, not here.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.fake_triton import FakeFleet, fake_model_config
from bench.fleet_scale import (
    MODEL,
    Bench,
    fleet_settings,
    stage_fake_versions,
    swap_once,
)
from bench.staging import seaweed
from modelship.clients import build_clients
from modelship.errors import InfrastructureError, PreflightError
from modelship.policy import Policy, StagingPolicy, SwapPolicy
from modelship.settings import TritonEndpoint
from modelship.signing import generate_key, key_bytes
from modelship.triton.client import TritonServer
from modelship.triton.infer import TritonInference
from modelship.triton.model_config import to_json
from tasks.fleet import swap_unlocked

pytestmark = pytest.mark.integration

P, C = 1, 2
REPLICAS = 5


@pytest.fixture(scope="module")
def bench() -> Iterator[Bench]:
    signing_key = generate_key()
    with tempfile.TemporaryDirectory(prefix="fleet-fake-") as tmp, \
            seaweed(Path(tmp) / "seaweedfs") as server:
        stage_fake_versions(server.storage(StagingPolicy()), Path(tmp), model=MODEL,
                            versions=(P, C), signing_key=key_bytes(signing_key))
        with FakeFleet(REPLICAS, models=[MODEL], versions=(P, C), load_s=0.1) as fleet:
            settings = fleet_settings(fleet, home=Path(tmp) / "home",
                                      s3_endpoint=server.endpoint,
                                      access_key=server.access_key,
                                      secret_key=server.secret_key, signing_key=signing_key)
            policy = Policy(swap=SwapPolicy(deadline_s=10.0, probe_timeout_s=2.0))
            yield Bench(fleet, settings, policy)


def loads(calls: list[dict[str, Any]], replica: str) -> list[tuple[list[int], bool]]:
    """The (versions, dynamic batching) of each load a replica received, in order."""
    return [(c["versions"], c["dynamic_batching"]) for c in calls
            if c["replica"] == replica and c["call"] == "load"]


def on(state: dict[str, Any], version: int) -> bool:
    """A live replica serving exactly ``version`` with its production config (batching on)."""
    serving = state["models"].get(MODEL, {})
    return bool(state["alive"] and serving.get("versions") == [version]
                and serving.get("dynamic_batching"))


def test_clean_swap_moves_every_replica_through_pause_switch_resume(bench: Bench) -> None:
    bench.fleet.reset(MODEL, P)
    report, aborted, _ = swap_once(bench)
    assert not aborted, report.get("reason")
    assert report["kind"] == "swap" and report["from_version"] == P
    calls = bench.fleet.calls()
    for name, state in bench.fleet.state().items():
        assert on(state, C), (name, state)
        # pause batching on P, switch to C with batching still off, resume C's production
        # config; never an unload (unload-then-load is an outage)
        assert loads(calls, name) == [([P], False), ([C], False), ([C], True)], name
    assert not [c for c in calls if c["call"] in ("unload", "load_failed", "died")]
    # every replica answered the golden probe as C (the fake computed C's outputs)
    assert sorted(report["timeline"]) == sorted(bench.fleet.names)
    assert all(s["ok"] and s["version"] == C for s in report["final_states"].values())


@pytest.mark.parametrize("fault", ["die_on_load", "fail_load"])
def test_one_faulty_replica_aborts_and_every_other_replica_ends_on_p(bench: Bench,
                                                                     fault: str) -> None:
    bench.fleet.reset(MODEL, P)
    faulty = bench.fleet.names[2]
    bench.fleet.set_faults([faulty], **{fault: C if fault == "die_on_load" else [C]})
    report, aborted, _ = swap_once(bench)
    assert aborted and report["aborted"]
    assert faulty in str(report["reason"])
    calls, states = bench.fleet.calls(), bench.fleet.state()
    for name, state in states.items():
        if name == faulty:
            continue
        assert on(state, P), (name, state)
        received = loads(calls, name)
        # the abort restored P's production config (batching on) after whatever moved
        assert received[0] == ([P], False) and received[-1] == ([P], True), (name, received)
    assert not [c for c in calls if c["call"] == "unload"]
    final = report["final_states"][faulty]
    if fault == "die_on_load":
        assert not states[faulty]["alive"]
        assert [c["call"] for c in calls if c["replica"] == faulty][-1] == "died"
        assert final["ok"] is False  # reported stranded, not silently "on P"
    else:
        # a failed load leaves the old version serving: it never switched to C
        assert on(states[faulty], P)
        assert not [c for c in calls if c["replica"] == faulty and c["call"] == "switched"
                    and c["versions"] == [C]]
        assert [c["call"] for c in calls if c["replica"] == faulty].count("load_failed") == 1


def test_a_dead_replica_before_the_swap_refuses_it_without_a_control_call(bench: Bench
                                                                            ) -> None:
    bench.fleet.reset(MODEL, P)
    dead = bench.fleet.names[0]
    bench.fleet.kill([dead])
    clients = build_clients(bench.settings)
    try:
        with pytest.raises(PreflightError) as refused:
            swap_unlocked(bench.settings, clients, bench.policy, model=MODEL, target=C)
    finally:
        clients.close()
    assert dead in refused.value.message
    assert not [c for c in bench.fleet.calls() if c["call"] in ("load", "unload")]
    served = bench.fleet.served(MODEL)
    assert served[dead] == [] and all(served[n] == [P] for n in bench.fleet.names if n != dead)


def test_the_fake_serves_the_old_version_while_a_reload_builds_the_new(bench: Bench) -> None:
    """The semantics the bench's figures rest on (DESIGN §4, measured on Triton 2.51)."""
    bench.fleet.reset(MODEL, P, load_s=3.0)
    endpoint = TritonEndpoint(**bench.fleet.endpoints[0])
    server = TritonServer(endpoint, timeout_s=5.0, control_timeout_s=10.0)
    inference = TritonInference(endpoint.http, timeout_s=5.0)
    feed = {"input": np.zeros((1, 4), dtype=np.float32)}
    loader = threading.Thread(target=server.load_model, args=(MODEL,),
                              kwargs={"config_json": to_json(fake_model_config(
                                  MODEL, versions=[C]))})
    try:
        # both clients built and connected first: the request "during" the reload must
        # not pay an import on a busy machine (the reload lasts 3 s, not forever)
        server.warm()
        assert inference.infer(MODEL, feed, outputs=["label"]).model_version == str(P)
        loader.start()
        give_up = time.monotonic() + 5.0
        while not [c for c in bench.fleet.calls() if c["call"] == "load"]:
            assert time.monotonic() < give_up, "the load never reached the replica"
            time.sleep(0.02)
        during = inference.infer(MODEL, feed, outputs=["label"]).model_version
        loader.join(timeout=10)
        after = inference.infer(MODEL, feed, outputs=["label"]).model_version
        bench.fleet.set_faults([endpoint.name or ""], fail_load=[P], load_s=0.0)
        with pytest.raises(InfrastructureError, match="UNAVAILABLE state"):
            server.load_model(MODEL, config_json=to_json(fake_model_config(MODEL,
                                                                           versions=[P])))
        after_failure = inference.infer(MODEL, feed, outputs=["label"]).model_version
    finally:
        inference.close()
        server.close()
    assert (during, after, after_failure) == (str(P), str(C), str(C))
