"""A fake Triton fleet: many replicas' control plane in one process, for scale benchmarks.

Dev-only (bench and tests): it lets the REAL swap executor (:func:`tasks.fleet.swap_unlocked`
→ :func:`tasks.swap.swap_fleet`) run against 100 replicas on a 2-core machine, where 100
tritonservers would not fit. Each replica listens on its own loopback ports and speaks what
modelship's clients speak to Triton:

- **gRPC** (``inference.GRPCInferenceService`` from ``tritonclient.grpc``'s own protos, one
  ``grpc.aio`` server per replica): ``ServerLive``, ``ServerReady``, ``ServerMetadata``,
  ``ModelReady``, ``ModelMetadata``, ``ModelConfig``, ``ModelStatistics``,
  ``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``, ``ModelInfer``.
- **HTTP/REST** (KServe v2, one ``aiohttp`` app for every replica, told apart by the local
  port): ``/v2/health/{live,ready}``, ``/v2/models/<m>[/versions/<v>]/infer`` with the binary
  tensor extension that ``tritonclient.http`` uses, and ``/metrics`` (a CPU server: no
  ``nv_gpu_*`` gauges). The swap's health pings and probes go over HTTP.

Load and unload follow what DESIGN §4 measured on Triton 2.51:

- A load (with or without a full-config override; the override *replaces* the config)
  builds the versions its ``version_policy`` names (``specific [V]``, ``latest``, ``all``)
  for ``load_s`` while the old ones keep serving, then switches atomically; the RPC returns
  when the new versions are ready. Loads of one model on one replica run one at a time.
- A failed load (a version the repository lacks, or the ``fail_load`` fault) leaves the
  old versions serving and answers ``INVALID_ARGUMENT`` as Triton does.
- An unload answers at once; the model stops being ready ``unload_s`` later.

A "model" version is a deterministic function (:func:`fake_outputs`): the outputs depend on
the model name, the version and the inputs, so a probe that checks the candidate's recorded
outputs (the swap's golden probe) passes only when that version really answers.

Faults, per replica, settable while the fleet runs (:class:`Faults`): extra latency on every
call, a slow load, a load that fails, a replica that dies (ports closed, open connections
reset) when it is told to load a version, and a hung replica (connections accepted, nothing
answered). Every control call and every switch of the served versions is recorded with its
``time.monotonic()`` (one clock for every process on the machine), so a benchmark can read
the server-side switch skew.

The fleet runs in its own process (``python -m bench.fake_triton``), so it does not share a
GIL with the coordinator it is measured against; :class:`FakeFleet` starts it, steers it
through a small admin HTTP API, and stops it (by its PID).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import select
import socket
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, np_to_triton_dtype, triton_to_np_dtype

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
N_CLASSES = 2
HANG_S = 3600.0  # how long a hung replica keeps a request open (the client gives up first)

# ----------------------------------------------------------------------------------------
# the fake model: config and outputs (pure, shared by the fake and whoever stages it)


def fake_model_config(model: str, *, features: int = 4, max_batch_size: int = 8,
                      versions: Sequence[int] = ()) -> Any:
    """The production config of a fake model (a ``model_config_pb2.ModelConfig``).

    One FP32 input ``input`` of ``features`` values; outputs ``label`` (INT64) and
    ``probabilities`` (FP32, 2 classes); dynamic batching on; ``specific [versions]`` when
    given.
    """
    cfg = mc.ModelConfig(name=model, backend="onnxruntime", max_batch_size=max_batch_size)
    cfg.input.add(name="input", data_type=mc.TYPE_FP32, dims=[features])
    cfg.output.add(name="label", data_type=mc.TYPE_INT64, dims=[1])
    cfg.output.add(name="probabilities", data_type=mc.TYPE_FP32, dims=[N_CLASSES])
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    cfg.dynamic_batching.max_queue_delay_microseconds = 100
    if versions:
        cfg.version_policy.specific.versions.extend(versions)
    return cfg


def fake_outputs(model: str, version: int, inputs: Mapping[str, np.ndarray]
                 ) -> dict[str, np.ndarray]:
    """What version ``version`` of the fake ``model`` answers for ``inputs`` (pure).

    A linear layer whose weights are seeded by ``model/version``, then softmax: other
    versions give other outputs, so a golden probe tells them apart.
    """
    x = np.asarray(inputs["input"], dtype=np.float32)
    x = x.reshape(x.shape[0], -1)
    seed = zlib.crc32(f"{model}/{version}".encode())
    weights = np.random.default_rng(seed).standard_normal((x.shape[1], N_CLASSES))
    logits = x.astype(np.float64) @ weights
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)
    label = probabilities.argmax(axis=1).astype(np.int64).reshape(-1, 1)
    return {"label": label, "probabilities": probabilities}


def versions_of(policy: Any, available: Sequence[int]) -> tuple[int, ...]:
    """The versions a ``ModelVersionPolicy`` selects among ``available`` (pure).

    Triton's rules: ``specific`` names them (a missing one is the caller's error to
    report), ``latest {num_versions}`` the highest n, ``all`` every one; no policy means
    ``latest 1``.
    """
    ordered = sorted(set(available))
    which = policy.WhichOneof("policy_choice") if policy is not None else None
    if which == "specific":
        return tuple(sorted(set(policy.specific.versions)))
    if which == "all":
        return tuple(ordered)
    n = max(1, policy.latest.num_versions) if which == "latest" else 1
    return tuple(ordered[-n:])


# ----------------------------------------------------------------------------------------
# faults and recorded calls


@dataclass
class Faults:
    """How one replica misbehaves; every field may change while the fleet runs.

    Attributes:
        load_s: How long a load builds its versions before it switches, in s.
        load_jitter_s: A uniform random extra on each load, in s.
        rpc_latency_s: Extra delay before every gRPC and HTTP answer, in s.
        slow_versions: Version (as a string, JSON keys) to the build time of a load of it,
            in s, overriding ``load_s`` (a version that is slow on this replica).
        fail_load: Versions whose load fails here (the old versions keep serving).
        die_on_load: A load of this version kills the replica ``die_after_s`` into it
            (ports closed, open connections reset): a replica that dies mid-swap.
        die_after_s: See ``die_on_load``, in s.
        hang_on_load: A load of this version never returns, and from then on the replica
            answers nothing (``hung``): a replica cut off mid-swap, whose connections stay
            open, so only deadlines notice.
        hung: Connections are accepted and nothing is answered (a stuck server).
    """

    load_s: float = 0.2
    load_jitter_s: float = 0.0
    rpc_latency_s: float = 0.0
    slow_versions: dict[str, float] = field(default_factory=dict)
    fail_load: list[int] = field(default_factory=list)
    die_on_load: int | None = None
    die_after_s: float = 0.05
    hang_on_load: int | None = None
    hung: bool = False

    def update(self, changes: Mapping[str, Any]) -> None:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown fault fields {unknown}; known: {sorted(known)}")
        for key, value in changes.items():
            setattr(self, key, value)

    def build_s(self, versions: Sequence[int]) -> float:
        slow = [float(self.slow_versions[str(v)]) for v in versions
                if str(v) in self.slow_versions]
        base = max(slow) if slow else self.load_s
        return base + (random.uniform(0, self.load_jitter_s) if self.load_jitter_s else 0.0)


@dataclass
class _ModelState:
    versions: tuple[int, ...] = ()
    config: Any = None  # ModelConfig of what serves
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    inferences: dict[int, int] = field(default_factory=dict)


class _Abort(Exception):
    """A gRPC status to answer with (code name) and the HTTP status of the same error."""

    def __init__(self, code: str, message: str, http_status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.http_status = http_status


# ----------------------------------------------------------------------------------------
# one replica


class Replica:
    """One fake Triton server: its model states, faults and listening sockets."""

    def __init__(self, fleet: _Fleet, index: int) -> None:
        self.fleet = fleet
        self.name = f"fake-{index}"
        self.faults = Faults(**asdict(fleet.default_faults))
        self.models: dict[str, _ModelState] = {}
        self.alive = False
        self.http_port = 0
        self.grpc_port = 0
        self._grpc_server: Any = None
        self._http_site: Any = None

    # -- lifecycle

    async def start(self) -> None:
        # lazy: aiohttp (~0.3 s) only in the serving process; importers use the pure helpers
        from aiohttp import web

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, self.http_port))
        sock.listen(128)
        self.http_port = sock.getsockname()[1]
        self._http_site = web.SockSite(self.fleet.http_runner, sock)
        await self._http_site.start()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(self), server)
        self.grpc_port = server.add_insecure_port(f"{LOOPBACK}:{self.grpc_port}")
        await server.start()
        self._grpc_server = server
        self.alive = True
        self.fleet.http_ports[self.http_port] = self

    async def kill(self, why: str) -> None:
        """Die: close both ports; gRPC calls in flight fail, HTTP connections reset."""
        if not self.alive:
            return
        self.alive = False
        self.fleet.record(self, "died", detail=why)
        if self._http_site is not None:
            await self._http_site.stop()
        if self._grpc_server is not None:
            await self._grpc_server.stop(None)

    def endpoint(self) -> dict[str, str]:
        """The replica as a ``TritonEndpoint`` document."""
        return {"name": self.name, "http": f"http://{LOOPBACK}:{self.http_port}",
                "grpc": f"{LOOPBACK}:{self.grpc_port}",
                "metrics": f"http://{LOOPBACK}:{self.http_port}/metrics"}

    def state(self) -> dict[str, Any]:
        return {"name": self.name, "alive": self.alive, "faults": asdict(self.faults),
                "models": {m: {"versions": list(s.versions),
                               "dynamic_batching": s.config is not None
                               and s.config.HasField("dynamic_batching"),
                               "inferences": {str(k): v for k, v in s.inferences.items()}}
                           for m, s in self.models.items()}}

    # -- behaviour shared by both protocols

    async def enter(self) -> None:
        """Every call starts here: a hung replica never answers; latency is added."""
        if self.faults.hung:
            await asyncio.sleep(HANG_S)
        if self.faults.rpc_latency_s > 0:
            await asyncio.sleep(self.faults.rpc_latency_s)

    def model(self, name: str) -> _ModelState:
        return self.models.setdefault(name, _ModelState())

    def serving(self, name: str, version: str = "") -> int:
        """The version that answers an (un)versioned request, or raise as Triton does."""
        state = self.models.get(name)
        if state is None or not state.versions:
            raise _Abort("UNAVAILABLE" if name in self.fleet.repository else "NOT_FOUND",
                         f"Request for unknown model: '{name}' has no available versions")
        if not version:
            return max(state.versions)
        if int(version) not in state.versions:
            raise _Abort("UNAVAILABLE", f"Request for unknown model: '{name}' version "
                         f"{version} is not at ready state")
        return int(version)

    def infer(self, name: str, version: str, inputs: Mapping[str, np.ndarray]
              ) -> tuple[int, dict[str, np.ndarray]]:
        served = self.serving(name, version)
        state = self.models[name]
        state.inferences[served] = state.inferences.get(served, 0) + 1
        return served, fake_outputs(name, served, inputs)

    async def load(self, name: str, config_json: str | None) -> None:
        available = self.fleet.repository.get(name)
        if available is None:
            raise _Abort("INVALID_ARGUMENT", f"failed to load '{name}', failed to poll from "
                         f"model repository: no model '{name}' in the repository")
        if config_json:
            try:
                cfg = json_format.Parse(config_json, mc.ModelConfig())
            except json_format.ParseError as exc:
                raise _Abort("INVALID_ARGUMENT", f"failed to load '{name}': the config "
                             f"override does not parse: {exc}") from exc
            cfg.name = cfg.name or name
        else:
            cfg = fake_model_config(name, features=self.fleet.features)
        versions = versions_of(cfg.version_policy if cfg.HasField("version_policy") else None,
                               available)
        self.fleet.record(self, "load", model=name, versions=list(versions),
                          dynamic_batching=cfg.HasField("dynamic_batching"))
        state = self.model(name)
        async with state.lock:
            missing = [v for v in versions if v not in available]
            if missing or not versions:
                self.fleet.record(self, "load_failed", model=name, versions=list(versions))
                raise _Abort("INVALID_ARGUMENT", f"failed to load '{name}', version "
                             f"{missing[0] if missing else '?'} is at UNAVAILABLE state: "
                             "Not found: no such version in the model repository")
            if self.faults.hang_on_load in versions:
                self.faults.hung = True
                self.fleet.record(self, "hung", model=name, versions=list(versions))
                await asyncio.sleep(HANG_S)
            if self.faults.die_on_load in versions:
                asyncio.get_running_loop().call_later(
                    self.faults.die_after_s,
                    lambda: asyncio.ensure_future(self.kill(f"died loading v{versions}")))
            await asyncio.sleep(self.faults.build_s(versions))
            if not self.alive:  # died while building: the call is cut off with the server
                await asyncio.sleep(HANG_S)
            failing = [v for v in versions if v in self.faults.fail_load]
            if failing:
                self.fleet.record(self, "load_failed", model=name, versions=list(versions))
                raise _Abort("INVALID_ARGUMENT", f"load failed for model '{name}': version "
                             f"{failing[0]} is at UNAVAILABLE state: Internal: fake fault "
                             "fail_load (the old versions keep serving)")
            before = state.versions
            state.versions, state.config = versions, cfg
            self.fleet.record(self, "switched", model=name, versions=list(versions),
                              previous=list(before),
                              dynamic_batching=cfg.HasField("dynamic_batching"))

    async def unload(self, name: str) -> None:
        self.fleet.record(self, "unload", model=name)
        state = self.model(name)

        async def later() -> None:
            await asyncio.sleep(self.fleet.unload_s)
            async with state.lock:
                before = state.versions
                state.versions, state.config = (), None
                self.fleet.record(self, "switched", model=name, versions=[],
                                  previous=list(before))

        asyncio.ensure_future(later())


# ----------------------------------------------------------------------------------------
# gRPC


def _triton_dtype(dtype: np.dtype[Any]) -> str:
    return str(np_to_triton_dtype(dtype))


def _tensor_metadata(pb: Any, tensors: Sequence[Any]) -> list[Any]:
    return [pb.ModelMetadataResponse.TensorMetadata(
        name=t.name, datatype=mc.DataType.Name(t.data_type).removeprefix("TYPE_")
        .replace("STRING", "BYTES"), shape=[-1, *t.dims]) for t in tensors]


class _Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """``GRPCInferenceService`` for one replica (the methods modelship calls; the others
    answer UNIMPLEMENTED, from the generated base class)."""

    def __init__(self, replica: Replica) -> None:
        self.r = replica

    async def _call(self, context: Any, work: Any) -> Any:
        try:
            await self.r.enter()
            return await work()
        except _Abort as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), exc.message)

    async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        async def work() -> Any:
            return pb.ServerLiveResponse(live=True)
        return await self._call(context, work)

    async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def work() -> Any:
            return pb.ServerReadyResponse(ready=True)
        return await self._call(context, work)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def work() -> Any:
            return pb.ServerMetadataResponse(name="triton (fake)", version="2.51.0-fake",
                                             extensions=["model_repository"])
        return await self._call(context, work)

    async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def work() -> Any:
            state = self.r.models.get(request.name)
            versions = state.versions if state else ()
            ready = bool(versions) if not request.version else int(request.version) in versions
            return pb.ModelReadyResponse(ready=ready)
        return await self._call(context, work)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def work() -> Any:
            self.r.serving(request.name, request.version)
            state = self.r.models[request.name]
            return pb.ModelMetadataResponse(
                name=request.name, versions=[str(v) for v in state.versions],
                platform="onnxruntime_onnx",
                inputs=_tensor_metadata(pb, state.config.input),
                outputs=_tensor_metadata(pb, state.config.output))
        return await self._call(context, work)

    async def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def work() -> Any:
            self.r.serving(request.name, request.version)
            return pb.ModelConfigResponse(config=self.r.models[request.name].config)
        return await self._call(context, work)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def work() -> Any:
            stats = [pb.ModelStatistics(name=name, version=str(v), inference_count=n,
                                        execution_count=n)
                     for name, state in sorted(self.r.models.items())
                     if not request.name or name == request.name
                     for v, n in sorted(state.inferences.items())]
            return pb.ModelStatisticsResponse(model_stats=stats)
        return await self._call(context, work)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def work() -> Any:
            rows = []
            for name, available in sorted(self.r.fleet.repository.items()):
                state = self.r.models.get(name)
                for v in sorted(available):
                    ready = state is not None and v in state.versions
                    if request.ready and not ready:
                        continue
                    rows.append(pb.RepositoryIndexResponse.ModelIndex(
                        name=name, version=str(v), state="READY" if ready else "UNAVAILABLE",
                        reason="" if ready else "unloaded"))
            return pb.RepositoryIndexResponse(models=rows)
        return await self._call(context, work)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def work() -> Any:
            override = request.parameters.get("config")
            await self.r.load(request.model_name,
                              override.string_param if override is not None else None)
            return pb.RepositoryModelLoadResponse()
        return await self._call(context, work)

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def work() -> Any:
            await self.r.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()
        return await self._call(context, work)

    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def work() -> Any:
            inputs = {}
            for i, tensor in enumerate(request.inputs):
                raw = request.raw_input_contents[i]
                inputs[tensor.name] = np.frombuffer(
                    raw, dtype=triton_to_np_dtype(tensor.datatype)).reshape(list(tensor.shape))
            served, outputs = self.r.infer(request.model_name, request.model_version, inputs)
            wanted = [o.name for o in request.outputs] or sorted(outputs)
            response = pb.ModelInferResponse(model_name=request.model_name,
                                             model_version=str(served), id=request.id)
            for name in wanted:
                array = np.ascontiguousarray(outputs[name])
                response.outputs.add(name=name, datatype=_triton_dtype(array.dtype),
                                     shape=list(array.shape))
                response.raw_output_contents.append(array.tobytes())
            return response
        return await self._call(context, work)


# ----------------------------------------------------------------------------------------
# HTTP (KServe v2 with the binary tensor extension)


def _decode_http_inputs(body: bytes, header_length: int | None
                        ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The JSON header and the input arrays of a v2 infer request (pure)."""
    head = json.loads(body[:header_length] if header_length else body)
    offset = header_length or 0
    arrays: dict[str, np.ndarray] = {}
    for tensor in head.get("inputs", []):
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        datatype, shape = tensor["datatype"], tensor["shape"]
        if size is not None:
            raw = body[offset:offset + int(size)]
            offset += int(size)
            array = deserialize_bytes_tensor(raw) if datatype == "BYTES" else \
                np.frombuffer(raw, dtype=triton_to_np_dtype(datatype))
        else:
            array = np.array(tensor["data"], dtype=triton_to_np_dtype(datatype))
        arrays[tensor["name"]] = array.reshape(shape)
    return head, arrays


def _encode_http_outputs(model: str, version: int, outputs: Mapping[str, np.ndarray],
                         requested: Sequence[Mapping[str, Any]], binary_default: bool
                         ) -> tuple[bytes, int | None]:
    """A v2 infer response: JSON, then binary outputs where asked (pure)."""
    wanted = requested or [{"name": n} for n in sorted(outputs)]
    doc: dict[str, Any] = {"model_name": model, "model_version": str(version), "outputs": []}
    blobs: list[bytes] = []
    for spec in wanted:
        array = np.ascontiguousarray(outputs[spec["name"]])
        entry: dict[str, Any] = {"name": spec["name"], "datatype": _triton_dtype(array.dtype),
                                 "shape": list(array.shape)}
        binary = (spec.get("parameters") or {}).get("binary_data", binary_default)
        if binary:
            blob = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = array.ravel().tolist()
        doc["outputs"].append(entry)
    header = json.dumps(doc).encode()
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)


def _http_app(fleet: _Fleet) -> Any:
    # lazy: aiohttp (~0.3 s) only in the serving process; importers use the pure helpers
    from aiohttp import web

    def replica_of(request: web.Request) -> Replica:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        replica = fleet.http_ports.get(sockname[1]) if sockname else None
        if replica is None or not replica.alive:
            if request.transport is not None:
                request.transport.abort()  # a dead replica resets what is still open
            raise web.HTTPServiceUnavailable(text="replica is down")
        return replica

    async def health(request: web.Request) -> web.Response:
        await replica_of(request).enter()
        return web.Response(status=200)

    async def metrics(request: web.Request) -> web.Response:
        replica = replica_of(request)
        await replica.enter()
        lines = ["# HELP nv_inference_request_success Number of successful inference requests",
                 "# TYPE nv_inference_request_success counter"]
        for name, state in sorted(replica.models.items()):
            for v, n in sorted(state.inferences.items()):
                lines.append(f'nv_inference_request_success{{model="{name}",version="{v}"}} {n}')
        return web.Response(text="\n".join(lines) + "\n")

    async def infer(request: web.Request) -> web.Response:
        replica = replica_of(request)
        await replica.enter()
        body = await request.read()
        length = request.headers.get("Inference-Header-Content-Length")
        head, arrays = _decode_http_inputs(body, int(length) if length else None)
        try:
            served, outputs = replica.infer(request.match_info["model"],
                                            request.match_info.get("version", ""), arrays)
        except _Abort as exc:
            return web.json_response({"error": exc.message}, status=exc.http_status)
        binary_default = bool((head.get("parameters") or {}).get("binary_data_output", False))
        payload, header_length = _encode_http_outputs(
            request.match_info["model"], served, outputs, head.get("outputs") or [],
            binary_default)
        headers = {"Content-Type": "application/octet-stream" if header_length else
                   "application/json"}
        if header_length is not None:
            headers["Inference-Header-Content-Length"] = str(header_length)
        return web.Response(body=payload, headers=headers)

    app = web.Application()
    app.router.add_get("/v2/health/live", health)
    app.router.add_get("/v2/health/ready", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_post("/v2/models/{model}/versions/{version}/infer", infer)
    return app


# ----------------------------------------------------------------------------------------
# the fleet process and its admin API


class _Fleet:
    """Every replica, the repository they share, and the call log."""

    def __init__(self, *, replicas: int, repository: dict[str, list[int]], features: int,
                 default_faults: Faults, unload_s: float) -> None:
        self.size = replicas
        self.repository = repository
        self.features = features
        self.default_faults = default_faults
        self.unload_s = unload_s
        self.replicas: list[Replica] = []
        self.http_ports: dict[int, Replica] = {}
        self.http_runner: Any = None
        self.calls: list[dict[str, Any]] = []

    def record(self, replica: Replica, call: str, **detail: Any) -> None:
        self.calls.append({"seq": len(self.calls), "t": time.monotonic(),
                           "replica": replica.name, "call": call, **detail})

    def by_name(self, name: str) -> Replica:
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise KeyError(name)

    async def reset(self, model: str | None, version: int | None, faults: Mapping[str, Any]
                    ) -> None:
        """Every replica up again (a dead one restarts on its ports) and serving ``model``
        v``version`` with its production config, or nothing; faults back to the defaults
        updated with ``faults``; the call log cleared."""
        Faults().update(faults)  # refuse unknown fields before changing anything
        for replica in self.replicas:
            if not replica.alive:
                await replica.start()
            replica.faults = Faults(**asdict(self.default_faults))
            replica.faults.update(faults)
            replica.models = {}
            if model is not None and version is not None:
                state = replica.model(model)
                state.versions = (version,)
                state.config = fake_model_config(model, features=self.features,
                                                 versions=[version])
        self.calls = []

    async def start(self) -> None:
        # lazy: aiohttp (~0.3 s) only in the serving process; importers use the pure helpers
        from aiohttp import web

        self.http_runner = web.AppRunner(_http_app(self), handler_cancellation=True,
                                         access_log=None)
        await self.http_runner.setup()
        self.replicas = [Replica(self, i) for i in range(self.size)]
        for replica in self.replicas:
            await replica.start()

    async def stop(self) -> None:
        for replica in self.replicas:
            await replica.kill("fleet stopped")
        if self.http_runner is not None:
            await self.http_runner.cleanup()


def _admin_app(fleet: _Fleet, done: asyncio.Event) -> Any:
    # lazy: aiohttp (~0.3 s) only in the serving process; importers use the pure helpers
    from aiohttp import web

    async def endpoints(_: web.Request) -> web.Response:
        return web.json_response({"replicas": [r.endpoint() for r in fleet.replicas]})

    async def state(_: web.Request) -> web.Response:
        return web.json_response({"replicas": [r.state() for r in fleet.replicas]})

    async def calls(request: web.Request) -> web.Response:
        since = int(request.query.get("since", "0"))
        return web.json_response({"calls": fleet.calls[since:]})

    async def faults(request: web.Request) -> web.Response:
        body = await request.json()
        names = body.pop("replicas", None) or [r.name for r in fleet.replicas]
        try:
            for name in names:
                fleet.by_name(name).faults.update(body)
        except (KeyError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"ok": True, "replicas": names})

    async def kill(request: web.Request) -> web.Response:
        body = await request.json()
        for name in body["replicas"]:
            await fleet.by_name(name).kill("killed by the admin API")
        return web.json_response({"ok": True})

    async def reset(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            await fleet.reset(body.get("model"), body.get("version"), body.get("faults") or {})
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"ok": True})

    async def shutdown(_: web.Request) -> web.Response:
        done.set()
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/fake/endpoints", endpoints)
    app.router.add_get("/fake/state", state)
    app.router.add_get("/fake/calls", calls)
    app.router.add_post("/fake/faults", faults)
    app.router.add_post("/fake/kill", kill)
    app.router.add_post("/fake/reset", reset)
    app.router.add_post("/fake/shutdown", shutdown)
    return app


async def _serve(args: argparse.Namespace) -> None:
    # lazy: aiohttp (~0.3 s) only in the serving process; importers use the pure helpers
    from aiohttp import web

    repository = {m: [int(v) for v in args.versions.split(",")] for m in args.model}
    fleet = _Fleet(replicas=args.replicas, repository=repository, features=args.features,
                   default_faults=Faults(load_s=args.load_s), unload_s=args.unload_s)
    started = time.monotonic()
    await fleet.start()
    done = asyncio.Event()
    runner = web.AppRunner(_admin_app(fleet, done), access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(64)
    site = web.SockSite(runner, sock)
    await site.start()
    print(json.dumps({"admin": f"http://{LOOPBACK}:{sock.getsockname()[1]}",
                      "pid": os.getpid(), "replicas": args.replicas,
                      "startup_s": round(time.monotonic() - started, 3)}), flush=True)
    stdin_closed = asyncio.Event()
    loop = asyncio.get_running_loop()
    # The parent's end of stdin closes when it exits, however it exits: then stop too.
    loop.add_reader(sys.stdin.fileno(), lambda: stdin_closed.set()
                    if not os.read(sys.stdin.fileno(), 1024) else None)
    waiters = [asyncio.ensure_future(done.wait()), asyncio.ensure_future(stdin_closed.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    loop.remove_reader(sys.stdin.fileno())
    await runner.cleanup()
    await fleet.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=10)
    parser.add_argument("--model", action="append", required=True,
                        help="a model in the fake repository (repeat for more)")
    parser.add_argument("--versions", default="1,2",
                        help="versions every model has in the repository, comma-separated")
    parser.add_argument("--features", type=int, default=4)
    parser.add_argument("--load-s", type=float, default=0.2,
                        help="default build time of a load, in s")
    parser.add_argument("--unload-s", type=float, default=0.05)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args))


# ----------------------------------------------------------------------------------------
# the controller, used by benchmarks and tests


class FakeFleet:
    """Start ``python -m bench.fake_triton`` and steer it; a context manager.

    The process is stopped by its PID on exit (the admin ``shutdown``, then SIGKILL), and it
    also stops by itself when this process dies (it watches its stdin).

    Args:
        replicas: How many replicas.
        models: The models of the fake repository.
        versions: The versions each model has there.
        features: Inputs per row of the fake model.
        load_s: Default build time of one load, in s.
        timeout_s: Bound of one admin request and of the fleet's startup, in s.
    """

    def __init__(self, replicas: int, *, models: Sequence[str], versions: Sequence[int] = (1, 2),
                 features: int = 4, load_s: float = 0.2, timeout_s: float = 60.0) -> None:
        self.size = replicas
        self.models = list(models)
        self.features = features
        self.timeout_s = timeout_s
        self._command = [sys.executable, "-m", "bench.fake_triton", "--replicas", str(replicas),
                         "--versions", ",".join(str(v) for v in versions),
                         "--features", str(features), "--load-s", str(load_s),
                         *[a for m in models for a in ("--model", m)]]
        self._proc: subprocess.Popen[bytes] | None = None
        self.admin = ""
        self.startup_s = 0.0
        self.endpoints: list[dict[str, str]] = []

    def __enter__(self) -> FakeFleet:
        self._proc = subprocess.Popen(self._command, cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, start_new_session=True)
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
        line = self._proc.stdout.readline() if ready else b""
        if not line:
            code = self._proc.poll()
            self.__exit__(None, None, None)
            why = f"exited with code {code}" if code is not None else \
                f"did not start within {self.timeout_s:g} s"
            raise RuntimeError(f"the fake Triton fleet {why} (command: "
                               f"{' '.join(self._command)}; its stderr says why)")
        hello = json.loads(line)
        self.admin, self.startup_s = hello["admin"], float(hello["startup_s"])
        self.endpoints = self._get("/fake/endpoints")["replicas"]
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._post("/fake/shutdown", {})
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.admin + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310
            return json.loads(response.read())

    def _get(self, path: str) -> Any:
        return self._request("GET", path)

    def _post(self, path: str, body: Any) -> Any:
        return self._request("POST", path, body)

    @property
    def names(self) -> list[str]:
        return [e["name"] for e in self.endpoints]

    def reset(self, model: str | None = None, version: int | None = None, **faults: Any) -> None:
        """Every replica serves ``model`` v``version`` with its production config (or
        nothing), faults at their defaults plus ``faults``; the call log is cleared."""
        self._post("/fake/reset", {"model": model, "version": version, "faults": faults})

    def set_faults(self, replicas: Sequence[str] | None = None, **faults: Any) -> None:
        """Change :class:`Faults` fields on ``replicas`` (every replica when None)."""
        self._post("/fake/faults", {"replicas": list(replicas or []), **faults})

    def kill(self, replicas: Sequence[str]) -> None:
        """Kill replicas now: ports closed, connections reset."""
        self._post("/fake/kill", {"replicas": list(replicas)})

    def state(self) -> dict[str, dict[str, Any]]:
        """Per replica: alive, faults, and per model the served versions and batching."""
        return {r["name"]: r for r in self._get("/fake/state")["replicas"]}

    def calls(self, since: int = 0) -> list[dict[str, Any]]:
        """The recorded calls: ``load``, ``load_failed``, ``switched``, ``unload``, ``died``."""
        return list(self._get(f"/fake/calls?since={since}")["calls"])

    def served(self, model: str) -> dict[str, list[int]]:
        """Per replica, the versions of ``model`` it serves ([] when dead or unloaded)."""
        return {name: (r["models"].get(model, {}).get("versions", []) if r["alive"] else [])
                for name, r in self.state().items()}


def iter_switches(calls: Sequence[Mapping[str, Any]], model: str, version: int
                  ) -> Iterator[tuple[str, float]]:
    """(replica, monotonic time) of every switch of ``model`` to exactly [``version``] from
    other versions (a reload of the same version, say to resume batching, is no switch)."""
    for call in calls:
        if call["call"] == "switched" and call.get("model") == model \
                and call.get("versions") == [version] and call.get("previous") != [version]:
            yield call["replica"], float(call["t"])


if __name__ == "__main__":
    main()
