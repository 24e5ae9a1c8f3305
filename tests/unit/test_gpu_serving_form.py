"""The serving form of a staged config (issue 13): one staged version, rendered for the
policy's target, loaded in the fleet's actual form. The decision is pure and table-tested;
the detection reads recorded GPU-server metrics text (tests/fixtures/triton_gpu_metrics)
from loopback servers, and is cached per server."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as pb

from modelship.errors import PreflightError
from modelship.policy import Target, TritonPolicy
from modelship.settings import TritonEndpoint
from modelship.triton.client import TritonServer
from modelship.triton.gpu import parse_gpu_metrics
from modelship.triton.model_config import (
    ModelSpec,
    TensorSpec,
    for_target,
    from_live_json,
    render_model_config,
    serving_digest,
    to_json,
    with_versions,
)
from modelship.triton.swap_plan import ReplicaView, plan_swap
from modelship.triton.target import (
    decide_target,
    detect_targets,
    render_for_servers,
    staged_target,
    with_visible_gpus,
)
from tasks.reconcile import Pin, plan_reconcile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "triton_gpu_metrics"
SPEC = ModelSpec("fraud", inputs=(TensorSpec("x", "float32", (8,)),),
                 outputs=(TensorSpec("y", "float32", (2,)),))
GPU_POLICY = TritonPolicy.model_validate({
    "target": "gpu", "instance_group": {"count": 2, "gpus": [0]},
    "gpu": {"accelerator": "tensorrt", "tensorrt": {"precision": "FP16"}}})
STAGED_GPU = render_model_config(SPEC, GPU_POLICY, versions=[4], golden_shapes={"x": (16, 8)})
STAGED_CPU = render_model_config(SPEC, TritonPolicy(), versions=[4])


def gpu_text() -> str:
    return (FIXTURES / "replica_roomy.txt").read_text()


def cpu_text() -> str:
    keep = [ln for ln in gpu_text().splitlines() if "nv_gpu_" not in ln and "nv_energy" not in ln]
    return "\n".join(keep) + "\n"


# --------------------------------------------------------------------------- pure decision


DECISIONS: list[tuple[str, dict[str, Target | None], object, Target, str]] = [
    # id, what each server's metrics said, staged config, form, source
    ("cpu fleet, gpu staged", {"r0": "cpu", "r1": "cpu"}, STAGED_GPU, "cpu", "detected"),
    ("gpu fleet, gpu staged", {"r0": "gpu", "r1": "gpu"}, STAGED_GPU, "gpu", "detected"),
    ("gpu fleet, cpu staged", {"r0": "gpu"}, STAGED_CPU, "gpu", "detected"),
    ("one unread replica follows the others", {"r0": "cpu", "r1": None}, STAGED_GPU, "cpu",
     "detected"),
    ("nothing read keeps the staged gpu form", {"r0": None, "r1": None}, STAGED_GPU, "gpu",
     "staged"),
    ("nothing read keeps the staged cpu form", {"r0": None}, STAGED_CPU, "cpu", "staged"),
    ("no servers keeps the staged form", {}, STAGED_GPU, "gpu", "staged"),
]


@pytest.mark.parametrize(("found", "staged", "target", "source"), [c[1:] for c in DECISIONS],
                         ids=[c[0] for c in DECISIONS])
def test_decide_target_table(found: dict[str, Target | None], staged: pb.ModelConfig,
                             target: Target, source: str) -> None:
    decided = decide_target(found, staged=staged)
    assert (decided.target, decided.source, decided.servers) == (target, source, found)
    assert decided.target in decided.describe()


def test_a_fleet_of_gpu_and_cpu_servers_is_refused_with_each_kind_named() -> None:
    with pytest.raises(PreflightError) as caught:
        decide_target({"r0": "gpu", "r1": "cpu", "r2": None}, staged=STAGED_GPU, what="fraud")
    err = caught.value
    assert err.exit_code == 1 and "r0: gpu; r1: cpu" in err.message
    assert "nothing was changed" in (err.hint or "")


@pytest.mark.parametrize(("cfg", "target"), [(STAGED_GPU, "gpu"), (STAGED_CPU, "cpu")])
def test_staged_target_reads_the_instance_kind(cfg: pb.ModelConfig, target: Target) -> None:
    assert staged_target(cfg) == target


def test_the_staged_gpu_config_has_what_the_policy_asks_and_its_cpu_form_has_none() -> None:
    (group,) = STAGED_GPU.instance_group
    assert (group.kind, group.count, list(group.gpus)) == (pb.ModelInstanceGroup.KIND_GPU, 2, [0])
    (accel,) = STAGED_GPU.optimization.execution_accelerators.gpu_execution_accelerator
    assert accel.name == "tensorrt" and accel.parameters["precision_mode"] == "FP16"
    assert [w.batch_size for w in STAGED_GPU.model_warmup] == [1, 16]
    cpu = for_target(STAGED_GPU, decide_target({"r0": "cpu"}, staged=STAGED_GPU).target)
    (cpu_group,) = cpu.instance_group
    assert (cpu_group.kind, cpu_group.count, list(cpu_group.gpus)) == (
        pb.ModelInstanceGroup.KIND_CPU, 2, [])
    assert not cpu.HasField("optimization") and not cpu.model_warmup
    assert list(cpu.version_policy.specific.versions) == [4]


# --------------------------------------------------------------------------- like with like


def _live(cfg: pb.ModelConfig) -> pb.ModelConfig:
    """What a replica reports after loading ``cfg`` (the JSON round trip, as Triton echoes)."""
    import json

    return from_live_json(json.loads(to_json(cfg)))


def test_a_fleet_serving_the_cpu_form_is_a_noop_swap_and_reconciled() -> None:
    """The swap plans and reconcile compare the live configs with the *rendered* form:
    comparing with the staged GPU form would never match, so a no-op would be a swap and
    reconcile would reload forever."""
    form = for_target(STAGED_GPU, "cpu")
    live = _live(with_versions(form, [4]))
    views = [ReplicaView(f"r{i}", True, (4,), serving_digest(live)) for i in range(2)]

    plan = plan_swap("fraud", views, target=4, candidate_config=form, production_config=live,
                     pause_batching=True, candidate_verified=True)
    assert plan.kind == "noop"
    unrendered = plan_swap("fraud", views, target=4, candidate_config=STAGED_GPU,
                           production_config=live, pause_batching=True,
                           candidate_verified=True)
    assert unrendered.kind == "swap"  # the bug the rendering fixes

    reconcile = plan_reconcile(Pin("fraud", 4, with_versions(form, [4])), views)
    assert [s.action for s in reconcile.steps] == ["ok", "ok"]
    stale = plan_reconcile(Pin("fraud", 4, STAGED_GPU), views)
    assert [s.action for s in stale.steps] == ["load", "load"]


# --------------------------------------------------------------------------- detection (I/O)


class MetricsServer:
    """A loopback ``/metrics`` endpoint answering a fixed text; counts its requests."""

    def __init__(self, body: str) -> None:
        self.hits = 0
        owner, payload = self, body.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                owner.hits += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _server(name: str, metrics: str) -> TritonServer:
    return TritonServer(TritonEndpoint(http="http://127.0.0.1:1", grpc="127.0.0.1:1",
                                       metrics=metrics, name=name), timeout_s=2,
                        control_timeout_s=2)


@pytest.fixture
def endpoints() -> Iterator[tuple[MetricsServer, MetricsServer, str]]:
    gpu, cpu = MetricsServer(gpu_text()), MetricsServer(cpu_text())
    dead = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    dead_url = f"http://127.0.0.1:{dead.server_address[1]}/metrics"
    dead.server_close()
    yield gpu, cpu, dead_url
    gpu.close()
    cpu.close()


def test_detection_reads_each_server_once_and_caches_only_answers(
        endpoints: tuple[MetricsServer, MetricsServer, str]) -> None:
    gpu, cpu, dead = endpoints
    servers = [_server("g", gpu.url), _server("c", cpu.url), _server("d", dead)]
    assert detect_targets(servers, timeout_s=2) == {"g": "gpu", "c": "cpu", "d": None}
    assert detect_targets(servers, timeout_s=2) == {"g": "gpu", "c": "cpu", "d": None}
    assert (gpu.hits, cpu.hits) == (1, 1)  # cached on the server objects
    assert [s.target for s in servers] == ["gpu", "cpu", None]


def test_texts_already_scraped_are_used_and_a_failed_scrape_is_not_retried(
        endpoints: tuple[MetricsServer, MetricsServer, str]) -> None:
    gpu, cpu, _ = endpoints
    servers = [_server("g", gpu.url), _server("c", cpu.url)]
    found = detect_targets(servers, timeout_s=2, texts={"g": cpu_text(), "c": None})
    assert found == {"g": "cpu", "c": None} and (gpu.hits, cpu.hits) == (0, 0)


def test_render_for_a_cpu_server_gives_the_cpu_form_and_says_how(
        endpoints: tuple[MetricsServer, MetricsServer, str]) -> None:
    gpu, cpu, dead = endpoints
    cfg, form = render_for_servers(STAGED_GPU, [_server("c", cpu.url), _server("d", dead)],
                                   timeout_s=2)
    assert cfg == for_target(STAGED_GPU, "cpu") and form.target == "cpu"
    assert form.to_dict() == {"target": "cpu", "source": "detected",
                              "servers": {"c": "cpu", "d": None}}
    same, on_gpu = render_for_servers(STAGED_GPU, [_server("g", gpu.url)], timeout_s=2)
    assert same == STAGED_GPU and on_gpu.target == "gpu"
    with pytest.raises(PreflightError):
        render_for_servers(STAGED_GPU, [_server("g", gpu.url), _server("c", cpu.url)],
                           timeout_s=2)


def _gpu_groups(cfg: pb.ModelConfig) -> list[list[int]]:
    return [list(g.gpus) for g in cfg.instance_group if g.kind == pb.ModelInstanceGroup.KIND_GPU]


def test_groups_without_gpus_get_every_visible_gpu_as_triton_places_them() -> None:
    all_gpus = render_model_config(SPEC, TritonPolicy.model_validate(
        {"target": "gpu", "instance_group": {"count": 2}}), versions=[4])
    assert _gpu_groups(all_gpus) == [[]]
    assert _gpu_groups(with_visible_gpus(all_gpus, 2)) == [[0, 1]]
    assert _gpu_groups(all_gpus) == [[]]  # a copy: the staged config is untouched
    assert _gpu_groups(with_visible_gpus(STAGED_GPU, 4)) == [[0]]  # named GPUs are kept
    assert with_visible_gpus(STAGED_CPU, 2) == STAGED_CPU


def test_a_gpu_fleet_loads_the_gpus_its_metrics_show(
        endpoints: tuple[MetricsServer, MetricsServer, str]) -> None:
    gpu, _, _ = endpoints
    shown = len(parse_gpu_metrics(gpu_text()))
    all_gpus = render_model_config(SPEC, TritonPolicy.model_validate(
        {"target": "gpu", "instance_group": {"count": 1}}), versions=[4])
    servers = [_server("g0", gpu.url), _server("g1", gpu.url)]
    cfg, form = render_for_servers(all_gpus, servers, timeout_s=2)
    assert form.target == "gpu" and [s.gpu_count for s in servers] == [shown, shown]
    assert shown >= 1 and _gpu_groups(cfg) == [list(range(shown))]
