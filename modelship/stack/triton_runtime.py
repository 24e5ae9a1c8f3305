"""Locate the CPU Triton runtime and build what a ``tritonserver`` process needs.

The embedded stack runs a real ``tritonserver`` (2.51) from the ``nvidia-pytriton`` wheel,
installed in its own virtual environment (numpy < 2: the Python backend stub of this
Triton breaks with numpy 2). ONNX models are served by a Python-based backend named
``onnxruntime`` (:mod:`modelship.triton.onnxruntime_backend`), so the same
``config.pbtxt`` works here and on a GPU server with the C++ backend.

These helpers are pure apart from :func:`prepare_backend_dir`, which writes a small
folder of symlinks, one copied file and their byte-code. Starting and supervising the
process is the job of the stack's process supervisor.
"""

from __future__ import annotations

import os
import py_compile
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from modelship.errors import StackError

_INSTALL_HINT = "Run `make install` to build the Triton runtime venv (.venv-triton)"

#: The backend file shipped with modelship and copied to ``<backend_dir>/onnxruntime/``.
ONNXRUNTIME_BACKEND_MODEL = (
    Path(__file__).resolve().parent.parent / "triton" / "onnxruntime_backend" / "model.py"
)

_STUB_NAME = "triton_python_backend_stub"
_PYTHON_BACKEND_LIB = "libtriton_python.so"
_PYTHON_BACKEND_UTILS = "triton_python_backend_utils.py"
_PYTHON_BACKEND_FILES = (_PYTHON_BACKEND_LIB, _PYTHON_BACKEND_UTILS)


@dataclass(frozen=True)
class TritonRuntime:
    """The pieces of an installed CPU Triton runtime venv.

    Attributes:
        venv: The runtime virtual environment (the one with ``nvidia-pytriton``).
        python_version: ``"3.11"``-style version of that venv's Python.
        tritonserver: The ``tritonserver`` executable.
        site_packages: The venv's ``site-packages`` (the server's ``PYTHONPATH``).
        libs_dir: ``nvidia_pytriton.libs``, the bundled shared libraries.
        python_backend_dir: The wheel's Python backend (``libtriton_python.so`` and
            ``triton_python_backend_utils.py``).
        python_stub: The Python backend stub built for :attr:`python_version`.
    """

    venv: Path
    python_version: str
    tritonserver: Path
    site_packages: Path
    libs_dir: Path
    python_backend_dir: Path
    python_stub: Path

    @property
    def bin_dir(self) -> Path:
        """The venv's ``bin`` directory (first on the server's ``PATH``)."""
        return self.venv / "bin"


def find_triton_runtime(venv: Path) -> TritonRuntime:
    """Find the Triton runtime installed in ``venv`` and check that it is complete.

    Args:
        venv: The runtime virtual environment, e.g. ``.venv-triton``.

    Returns:
        The runtime's paths.

    Raises:
        StackError: The venv, the wheel or one of its parts is missing, or the venv has
            numpy 2 (which breaks the Python backend stub of Triton 2.51).
    """
    venv = Path(venv).absolute()
    if not venv.is_dir():
        raise StackError(
            f"Triton runtime venv {venv} does not exist", hint=_INSTALL_HINT, venv=str(venv)
        )
    candidates = sorted(venv.glob("lib/python3.*/site-packages"))
    if len(candidates) != 1:
        raise StackError(
            f"expected exactly one lib/python3.*/site-packages in {venv}, found "
            f"{[str(c) for c in candidates]}",
            hint=_INSTALL_HINT,
            venv=str(venv),
        )
    site_packages = candidates[0]
    python_version = site_packages.parent.name.removeprefix("python")
    server_root = site_packages / "pytriton" / "tritonserver"
    runtime = TritonRuntime(
        venv=venv,
        python_version=python_version,
        tritonserver=server_root / "bin" / "tritonserver",
        site_packages=site_packages,
        libs_dir=site_packages / "nvidia_pytriton.libs",
        python_backend_dir=server_root / "backends" / "python",
        python_stub=server_root / "python_backend_stubs" / python_version / _STUB_NAME,
    )

    required = [
        (runtime.tritonserver, "the tritonserver binary"),
        (runtime.libs_dir, "the bundled libraries (nvidia_pytriton.libs)"),
        (runtime.python_stub, f"the Python backend stub for Python {python_version}"),
        *(
            (runtime.python_backend_dir / f, f"the Python backend's {f}")
            for f in _PYTHON_BACKEND_FILES
        ),
        (ONNXRUNTIME_BACKEND_MODEL, "modelship's onnxruntime backend model.py"),
    ]
    for path, what in required:
        if not path.exists():
            raise StackError(
                f"{what} is missing: {path} does not exist (is nvidia-pytriton installed in "
                f"{venv}?)",
                hint=_INSTALL_HINT,
                path=str(path),
            )
    if not os.access(runtime.tritonserver, os.X_OK):
        raise StackError(
            f"{runtime.tritonserver} is not executable",
            hint=_INSTALL_HINT,
            path=str(runtime.tritonserver),
        )
    for package in ("onnxruntime", "numpy"):
        if not (site_packages / package).is_dir():
            raise StackError(
                f"{package} is not installed in the Triton runtime venv {venv}",
                hint=_INSTALL_HINT,
                package=package,
            )
    for dist_info in site_packages.glob("numpy-*.dist-info"):
        major = dist_info.name.removeprefix("numpy-").split(".", 1)[0]
        if major.isdigit() and int(major) >= 2:
            raise StackError(
                f"the Triton runtime venv {venv} has {dist_info.name.removesuffix('.dist-info')}; "
                "Triton 2.51's Python backend needs numpy < 2",
                hint=f"{_INSTALL_HINT} after removing {venv}",
                venv=str(venv),
            )
    return runtime


def _symlink(target: Path, link: Path) -> None:
    """Point ``link`` at ``target``, replacing a stale link atomically."""
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _place_copy(source: Path, dest: Path) -> None:
    """Put a real file (hard link, else copy) of ``source`` at ``dest``, unless it is there.

    Triton resolves symlinks and refuses a backend library whose real path lies outside
    the backend directory, so the library cannot be a symlink into the wheel.
    """
    if dest.exists() and not dest.is_symlink():
        if os.path.samefile(source, dest):
            return
        src_stat, dest_stat = source.stat(), dest.stat()
        if (src_stat.st_size, src_stat.st_mtime_ns) == (dest_stat.st_size, dest_stat.st_mtime_ns):
            return
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copy2(source, tmp)
    os.replace(tmp, dest)


def _byte_compile(runtime: TritonRuntime, sources: Sequence[Path]) -> None:
    """Write each source's ``__pycache__`` entry next to the path the stub imports it from.

    Every Python-backend stub (one per model instance load) imports ``model.py`` and
    ``triton_python_backend_utils.py`` from this folder; with ``PYTHONDONTWRITEBYTECODE``
    set (as in the tests) and nothing cached here (the utils file is a symlink, whose
    cache Python looks for beside the link), each stub compiled both again, ~12 ms of CPU
    per stub. Only when the runtime's Python is this one (same magic number and cache
    tag); otherwise the stubs compile as before. Checked like any cache: the ``.pyc``
    records the source's mtime and size, so an edited source is compiled again. An
    ``OSError`` (the folder is not writable) is the caller's :class:`StackError`.
    """
    if runtime.python_version != f"{sys.version_info.major}.{sys.version_info.minor}":
        return
    tag = sys.implementation.cache_tag
    for source in sources:
        cached = source.parent / "__pycache__" / f"{source.stem}.{tag}.pyc"
        try:
            py_compile.compile(str(source), cfile=str(cached), doraise=True)
        except py_compile.PyCompileError:
            continue  # the stub compiles it and reports the error at the model's load


def prepare_backend_dir(runtime: TritonRuntime, dest: Path) -> Path:
    """Create the ``--backend-directory`` for a server, without touching the installed wheel.

    The folder gets ``python/`` (``libtriton_python.so`` as a hard link or copy, since
    Triton refuses a backend library that resolves outside the backend directory; symlinks
    to ``triton_python_backend_utils.py`` and to the stub for the runtime's Python, named
    ``triton_python_backend_stub``) and ``onnxruntime/model.py``, a copy of modelship's
    Python-based onnxruntime backend, both byte-compiled (:func:`_byte_compile`). Calling
    it again is cheap and brings the folder up to date.

    Args:
        runtime: The runtime from :func:`find_triton_runtime`.
        dest: The folder to create or update.

    Returns:
        ``dest`` as an absolute path, to pass as ``backend_dir`` to :func:`server_command`.

    Raises:
        StackError: The folder could not be written.
    """
    dest = Path(dest).absolute()
    python_dir = dest / "python"
    onnx_dir = dest / "onnxruntime"
    try:
        python_dir.mkdir(parents=True, exist_ok=True)
        onnx_dir.mkdir(parents=True, exist_ok=True)
        _place_copy(
            runtime.python_backend_dir / _PYTHON_BACKEND_LIB, python_dir / _PYTHON_BACKEND_LIB
        )
        _symlink(
            runtime.python_backend_dir / _PYTHON_BACKEND_UTILS, python_dir / _PYTHON_BACKEND_UTILS
        )
        _symlink(runtime.python_stub, python_dir / _STUB_NAME)

        model_py = onnx_dir / "model.py"
        source = ONNXRUNTIME_BACKEND_MODEL.read_bytes()
        if not model_py.is_file() or model_py.is_symlink() or model_py.read_bytes() != source:
            tmp = onnx_dir / f".model.py.tmp-{os.getpid()}"
            tmp.write_bytes(source)
            os.replace(tmp, model_py)
        _byte_compile(runtime, [model_py, python_dir / _PYTHON_BACKEND_UTILS])
    except OSError as exc:
        raise StackError(
            f"could not prepare the Triton backend directory {dest}: {exc}",
            hint="Check that the folder is writable, or remove it and try again",
            path=str(dest),
        ) from exc
    return dest


def server_command(
    runtime: TritonRuntime,
    *,
    backend_dir: Path,
    model_repository: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``tritonserver`` command line for one replica of the embedded stack.

    Explicit model control (nothing loads until asked), every endpoint bound to
    127.0.0.1, latency summaries in the metrics, readiness that means "every loaded model
    is ready", and a server that starts and keeps running even when the repository is empty
    or some models in it fail to load.

    Args:
        runtime: The runtime from :func:`find_triton_runtime`.
        backend_dir: The folder made by :func:`prepare_backend_dir`.
        model_repository: A local path or ``s3://HOST:PORT/bucket/prefix``.
        http_port: KServe v2 HTTP port.
        grpc_port: KServe v2 gRPC port (used for every control call).
        metrics_port: Prometheus metrics port.
        extra_args: More flags, appended last.

    Returns:
        The argument vector, ready for ``subprocess.Popen``.
    """
    return [
        str(runtime.tritonserver),
        f"--model-repository={model_repository}",
        f"--backend-directory={Path(backend_dir).absolute()}",
        "--model-control-mode=explicit",
        # Server readiness must not flip while one model loads or unloads (a trial load,
        # a swap): modelship checks each model's readiness itself.
        "--strict-readiness=false",
        "--exit-on-error=false",
        # Configs are written in full by modelship and linted; no auto-complete stub launch.
        "--disable-auto-complete-config",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--metrics-address=127.0.0.1",
        f"--metrics-port={metrics_port}",
        "--metrics-config=summary_latencies=true",
        "--log-verbose=0",
        "--log-info=true",
        "--log-warning=true",
        "--log-error=true",
        "--exit-timeout-secs=10",
        *extra_args,
    ]


def server_env(
    runtime: TritonRuntime,
    base_env: Mapping[str, str],
    *,
    s3_access_key: str | None = None,
    s3_secret_key: str | None = None,
    s3_region: str = "us-east-1",
) -> dict[str, str]:
    """The environment for a ``tritonserver`` process.

    The bundled libraries go on ``LD_LIBRARY_PATH``, the runtime venv's ``site-packages``
    becomes the whole ``PYTHONPATH`` (never the project venv, whose numpy 2 breaks the
    stub), and the runtime venv's ``bin`` comes first on ``PATH`` so the embedded Python of
    the stub finds that venv. Thread pools are held to one thread each, and the AWS SDK is
    kept from probing an instance-metadata service that does not exist here.

    Args:
        runtime: The runtime from :func:`find_triton_runtime`.
        base_env: The environment to start from, usually ``os.environ``.
        s3_access_key: Access key for an ``s3://`` model repository.
        s3_secret_key: Secret key for an ``s3://`` model repository.
        s3_region: Region for the S3 client.

    Returns:
        A new environment mapping; ``base_env`` is not changed.

    Raises:
        StackError: Only one of the two S3 keys was given.
    """
    env = dict(base_env)
    for key in ("PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "CONDA_PREFIX"):
        env.pop(key, None)

    ld_path = [str(runtime.libs_dir)]
    if env.get("LD_LIBRARY_PATH"):
        ld_path.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(ld_path)
    env["PYTHONPATH"] = str(runtime.site_packages)
    env["PYTHONNOUSERSITE"] = "1"
    env["VIRTUAL_ENV"] = str(runtime.venv)
    path = env.get("PATH") or os.defpath
    env["PATH"] = os.pathsep.join([str(runtime.bin_dir), path])

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"

    env["AWS_EC2_METADATA_DISABLED"] = "true"
    if (s3_access_key is None) != (s3_secret_key is None):
        raise StackError(
            "an S3 access key was given without its secret key, or the reverse",
            hint="Pass both s3_access_key and s3_secret_key, or neither",
        )
    if s3_access_key is not None and s3_secret_key is not None:
        env["AWS_ACCESS_KEY_ID"] = s3_access_key
        env["AWS_SECRET_ACCESS_KEY"] = s3_secret_key
        env.pop("AWS_SESSION_TOKEN", None)
        env.pop("AWS_PROFILE", None)
    env["AWS_DEFAULT_REGION"] = s3_region
    env["AWS_REGION"] = s3_region
    return env
