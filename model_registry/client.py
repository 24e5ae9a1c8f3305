"""The MLflow model registry client: the only module that talks to MLflow.

Aliases and tags only, never stages (deprecated since MLflow 2.9). MLflow exceptions are
translated here into :class:`ModelNotFound`, :class:`Unreachable` and
:class:`InfrastructureError`, with messages that list what does exist.

Every call is idempotent and retried here, once, on a transient failure (a refused or reset
connection, a timeout, 408/429/502/503/504: :func:`modelship.faults.is_transient`) with
backoff inside a time budget (:class:`modelship.faults.RetryPolicy`); MLflow's own retries
are off, so the two never multiply. :func:`mlflow_client` is the one place an
``MlflowClient`` is built.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from modelship.candidate import ResolvedVersion
from modelship.errors import (
    InfrastructureError,
    ModelNotFound,
    ModelshipError,
    Unreachable,
    UsageError,
)
from modelship.faults import (
    DEFAULT_RETRY,
    Breaker,
    RetryPolicy,
    call_with_retries,
    is_transient,
    reason,
)
from modelship.http import expect_ok

if TYPE_CHECKING:
    from mlflow import MlflowClient

#: Flavors modelship can export, in the order it prefers them.
SUPPORTED_FLAVORS = ("onnx", "pytorch", "sklearn")
PRODUCTION_ALIAS = "production"
PREVIOUS_ALIAS = "previous"

T = TypeVar("T")


def point_mlflow_at(tracking_uri: str) -> None:
    """Point MLflow's process-wide tracking AND registry URIs at one server.

    ``mlflow.set_tracking_uri`` alone leaves a registry URI set earlier in the process (for
    another server) in place, and ``log_model(registered_model_name=...)`` then registers the
    version on that other server.

    An experiment made active by ``mlflow.set_experiment`` (tasks/train.py, the demo) is
    an id on the server it was set against; it is forgotten when the URI changes, or the
    next run on the new server asks for that id there (``No Experiment with id=1``).
    """
    import mlflow  # lazy: mlflow costs ~4 s at import; only a call to MLflow needs it
    from mlflow.tracking import fluent

    if fluent._active_experiment_id is not None and mlflow.get_tracking_uri() != tracking_uri:
        # set_experiment exported it too, for subprocesses; one set outside stays
        fluent._active_experiment_id = None
        os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)


def mlflow_client(tracking_uri: str, *, timeout_s: float) -> MlflowClient:
    """The one way modelship builds an ``MlflowClient``: ``timeout_s`` (seconds) per request
    and no retries of MLflow's own (its default retries a dead server for minutes; callers
    retry through :func:`modelship.faults.call_with_retries`, or not at all)."""
    # lazy: mlflow costs ~4 s at import; only a call to MLflow needs it
    from mlflow import MlflowClient

    # Some MLflow helpers (logged-model URIs behind models:/name/N) consult the global
    # tracking URI whatever is passed to them; without this they create ./mlflow.db.
    point_mlflow_at(tracking_uri)
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(max(1, timeout_s)))
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


class RegistryClient:
    """One MLflow tracking server. The constructor does no I/O.

    Args:
        tracking_uri: MLflow server URL, e.g. ``http://127.0.0.1:5000``.
        timeout_s: Timeout of one request, in seconds.
        retry: How a call is retried on a transient failure.
    """

    def __init__(self, tracking_uri: str, *, timeout_s: float,
                 retry: RetryPolicy = DEFAULT_RETRY) -> None:
        self.tracking_uri = tracking_uri.rstrip("/")
        self.timeout_s = timeout_s
        self.retry = retry
        #: A hung MLflow is waited on once per cooldown, not once per call.
        self.breaker = Breaker("MLflow")

    def ping(self) -> None:
        """Raise Unreachable/InfrastructureError unless ``/health`` answers 200."""
        expect_ok(f"{self.tracking_uri}/health", timeout_s=self.timeout_s, what="MLflow")

    def warm(self) -> None:
        """Import MLflow and build its registry client, with no I/O: the import takes ~4 s
        (more on a loaded machine), which a caller timing MLflow's answer must not count
        as MLflow's silence (``modelship status``)."""
        mlflow_client(self.tracking_uri, timeout_s=self.timeout_s)._get_registry_client()

    def _call(self, action: str, body: Callable[[MlflowClient], T]) -> T:
        """``body(client)``, retried on a transient failure, MLflow's errors translated."""

        def attempt() -> T:
            with self._mlflow(action) as client:
                return body(client)

        self.breaker.check(action)
        try:
            result = call_with_retries(attempt, policy=self.retry)
        except ModelshipError as exc:
            self.breaker.failed(exc, exc)
            raise
        self.breaker.succeeded()
        return result

    @contextmanager
    def _mlflow(self, action: str = "answer") -> Iterator[MlflowClient]:
        """An MlflowClient (:func:`mlflow_client`); MLflow's failures leave as the tree's."""
        try:
            yield mlflow_client(self.tracking_uri, timeout_s=self.timeout_s)
        except (ModelNotFound, UsageError):
            raise
        except Exception as exc:
            translated = self._translate(exc, action)
            if translated is exc:
                raise
            raise translated from exc

    def _translate(self, exc: Exception, action: str) -> Exception:
        if isinstance(exc, InfrastructureError):
            return exc
        if is_transient(exc):
            return Unreachable(
                f"MLflow at {self.tracking_uri} did not answer while trying to {action} "
                f"({reason(exc)})",
                hint="check that MLflow is running (`modelship doctor`) and "
                "MLFLOW_TRACKING_URI is right, then run the command again",
                endpoint=self.tracking_uri, transient=True)
        from mlflow.exceptions import MlflowException  # lazy: mlflow (~4 s), as above

        if isinstance(exc, MlflowException):
            return InfrastructureError(
                f"MLflow at {self.tracking_uri} failed to {action}: {exc.message}",
                hint="see the MLflow server log",
                endpoint=self.tracking_uri,
            )
        return exc

    # -- reading -------------------------------------------------------------------------

    def aliases(self, name: str) -> dict[str, int]:
        """Alias -> version number for a registered model."""

        def body(client: MlflowClient) -> dict[str, int]:
            model = self._registered_model(client, name)
            return {alias: int(version) for alias, version in model.aliases.items()}

        return self._call(f"read the aliases of {name}", body)

    def _registered_model(self, client: MlflowClient, name: str) -> Any:
        from mlflow.exceptions import MlflowException  # lazy: mlflow (~4 s), as above

        try:
            return client.get_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            known = sorted(m.name for m in client.search_registered_models(max_results=50))
            raise ModelNotFound(
                f"no registered model named {name!r} in MLflow at {self.tracking_uri}",
                hint=f"registered models are: {', '.join(known) or 'none'}; register it first "
                "with mlflow.<flavor>.log_model(..., registered_model_name=...)",
                model=name,
            ) from exc

    def version_number(self, name: str, *, version: int | None, alias: str | None) -> int:
        """Turn ``--version`` or ``--alias`` into a version number that exists."""
        if (version is None) == (alias is None):
            raise UsageError("pass exactly one of --version and --alias",
                             hint="e.g. `--version 3` or `--alias candidate`")
        ref = f"v{version}" if alias is None else f"@{alias}"
        return self._call(f"find {name} {ref}",
                          lambda client: self._version_number(client, name, version, alias))

    def _version_number(self, client: MlflowClient, name: str, version: int | None,
                        alias: str | None) -> int:
        from mlflow.exceptions import MlflowException  # lazy: mlflow (~4 s), as above

        model = self._registered_model(client, name)
        if alias is not None:
            if alias not in model.aliases:
                existing = ", ".join(f"{a} -> v{v}" for a, v in sorted(model.aliases.items()))
                raise ModelNotFound(
                    f"model {name!r} has no alias {alias!r}",
                    hint=f"its aliases are: {existing or 'none'}; pass --version N "
                    "instead, or set the alias in MLflow",
                    model=name, alias=alias,
                )
            return int(model.aliases[alias])
        try:
            client.get_model_version(name, str(version))
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            versions = sorted(int(v.version) for v in
                              client.search_model_versions(f"name='{name}'"))
            raise ModelNotFound(
                f"model {name!r} has no version {version}",
                hint=f"its versions are: {', '.join(map(str, versions)) or 'none'}",
                model=name, version=version,
            ) from exc
        return int(str(version))

    def resolve(
        self, name: str, *, version: int | None = None, alias: str | None = None,
        download_dir: Path,
    ) -> ResolvedVersion:
        """Resolve a reference, download the model's artifacts and read its metadata."""
        # lazy: mlflow costs ~4 s at import; only a call to MLflow needs it
        import mlflow.artifacts
        from mlflow.models import Model

        number = self.version_number(name, version=version, alias=alias)

        def body(client: MlflowClient) -> tuple[Any, Path, Any, dict[str, float], Any]:
            mv = client.get_model_version(name, str(number))
            target = download_dir / f"{name}-v{number}"
            target.mkdir(parents=True, exist_ok=True)
            local = Path(mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{name}/{number}", dst_path=str(target),
                tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri))
            metrics = dict(client.get_run(mv.run_id).data.metrics) if mv.run_id else {}
            return mv, local, Model.load(str(local)), metrics, client.get_registered_model(name)

        mv, local, mlmodel, metrics, registered = self._call(
            f"download {name} v{number}", body)
        flavors = tuple(mlmodel.flavors)
        version_aliases = tuple(sorted(a for a, v in registered.aliases.items()
                                       if int(v) == number))
        signature = mlmodel.signature.to_dict() if mlmodel.signature else None
        return ResolvedVersion(
            name=name,
            version=number,
            flavor=pick_flavor(flavors),
            flavors=flavors,
            source=str(mv.source),
            run_id=mv.run_id,
            signature=signature,
            metrics=metrics,
            aliases=version_aliases,
            tags=dict(mv.tags or {}),
            local_dir=local,
        )

    def download_run_artifact(self, run_id: str, path: str, dst: Path) -> Path | None:
        """Download one artifact of a run, or None when it does not exist."""
        # lazy: mlflow costs ~4 s at import; only a call to MLflow needs it
        import mlflow.artifacts
        from mlflow.exceptions import MlflowException

        def body(client: MlflowClient) -> Path | None:
            parent = str(Path(path).parent) if Path(path).parent != Path(".") else None
            names = {f.path for f in client.list_artifacts(run_id, parent)}
            if path not in names:
                return None
            try:
                return Path(mlflow.artifacts.download_artifacts(
                    run_id=run_id, artifact_path=path, dst_path=str(dst),
                    tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri))
            except MlflowException as exc:
                if is_transient(exc):
                    raise
                return None

        return self._call(f"download {path} of run {run_id}", body)

    # -- writing -------------------------------------------------------------------------

    def set_alias(self, name: str, alias: str, version: int) -> None:
        self._call(f"point {name}@{alias} at v{version}",
                   lambda client: client.set_registered_model_alias(name, alias, str(version)))

    def delete_alias(self, name: str, alias: str) -> None:
        self._call(f"delete {name}@{alias}",
                   lambda client: client.delete_registered_model_alias(name, alias))

    def set_tags(self, name: str, version: int, tags: dict[str, str]) -> None:
        def body(client: MlflowClient) -> None:
            for key, value in tags.items():
                client.set_model_version_tag(name, str(version), key, value)

        self._call(f"tag {name} v{version}", body)

    def version_tags(self, name: str, version: int) -> dict[str, str]:
        """The tags of one model version (recovery reads ``modelship.release_id``)."""
        return self._call(f"read the tags of {name} v{version}", lambda client: dict(
            client.get_model_version(name, str(version)).tags or {}))

    def production_version(self, name: str) -> int | None:
        """The version the ``production`` alias points at, or None."""
        return self.aliases(name).get(PRODUCTION_ALIAS)


def pick_flavor(flavors: tuple[str, ...]) -> str:
    """The flavor to export from: the first supported one, else the first real flavor
    (so the export stage can name it in its refusal)."""
    for flavor in SUPPORTED_FLAVORS:
        if flavor in flavors:
            return flavor
    real = [f for f in flavors if f != "python_function"]
    return real[0] if real else "python_function"
