"""The Triton backend folder carries the byte-code of the files every Python-backend stub
imports (modelship/stack/triton_runtime.py ``prepare_backend_dir``).

The stub appends ``<backend_dir>/onnxruntime`` and ``<backend_dir>/python`` to ``sys.path``
and imports ``model`` and ``triton_python_backend_utils`` (Triton's pb_stub.cc
``ModelContext::StubSetup``). The check here is the same import in a fresh interpreter
with ``-B`` (``PYTHONDONTWRITEBYTECODE``, as the tests' stubs run) and ``-v``, which
names the ``.pyc`` a module's code object came from.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from modelship.stack import triton_runtime
from modelship.stack.triton_runtime import TritonRuntime, prepare_backend_dir

THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def _runtime(tmp_path: Path, python_version: str) -> TritonRuntime:
    """A runtime whose wheel holds a tiny utils module, the library and a stub file."""
    wheel = tmp_path / "wheel" / "backends" / "python"
    wheel.mkdir(parents=True)
    (wheel / "libtriton_python.so").write_bytes(b"\x7fELF not really")
    (wheel / "triton_python_backend_utils.py").write_text("UTILS = 'from the wheel'\n")
    stub = tmp_path / "wheel" / "stub"
    stub.write_bytes(b"#!stub")
    return TritonRuntime(venv=tmp_path / "venv", python_version=python_version,
                         tritonserver=tmp_path / "tritonserver",
                         site_packages=tmp_path / "site", libs_dir=tmp_path / "libs",
                         python_backend_dir=wheel, python_stub=stub)


def _import_like_a_stub(backend: Path, model: str = "backend") -> str:
    """``import model, triton_python_backend_utils`` from the backend folder, as the stub
    does; the interpreter's verbose import log."""
    code = ("import sys; sys.path += [sys.argv[1] + '/onnxruntime', sys.argv[1] + '/python']; "
            "import model, triton_python_backend_utils as u; "
            "assert model.MODEL == sys.argv[2], model.MODEL; "
            "assert u.UTILS == 'from the wheel'")
    done = subprocess.run([sys.executable, "-B", "-v", "-c", code, str(backend), model],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stderr


@pytest.fixture
def backend_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    source = tmp_path / "backend_model.py"
    source.write_text("MODEL = 'backend'\n")
    monkeypatch.setattr(triton_runtime, "ONNXRUNTIME_BACKEND_MODEL", source)
    return source


def test_the_stubs_import_both_files_from_their_byte_code(tmp_path: Path,
                                                          backend_model: Path) -> None:
    backend = prepare_backend_dir(_runtime(tmp_path, THIS_PYTHON), tmp_path / "backend")
    tag = sys.implementation.cache_tag
    log = _import_like_a_stub(backend)
    for pyc in (backend / "onnxruntime" / "__pycache__" / f"model.{tag}.pyc",
                backend / "python" / "__pycache__" / f"triton_python_backend_utils.{tag}.pyc"):
        assert pyc.is_file()
        assert f"code object from '{pyc}'" in log, log[-2000:]


def test_an_updated_backend_file_is_not_served_from_stale_byte_code(
        tmp_path: Path, backend_model: Path) -> None:
    runtime = _runtime(tmp_path, THIS_PYTHON)
    backend = prepare_backend_dir(runtime, tmp_path / "backend")
    backend_model.write_text("MODEL = 'backend, version 2'\n")
    prepare_backend_dir(runtime, tmp_path / "backend")
    assert (backend / "onnxruntime" / "model.py").read_text() == backend_model.read_text()
    pyc = backend / "onnxruntime" / "__pycache__" / f"model.{sys.implementation.cache_tag}.pyc"
    assert f"code object from '{pyc}'" in _import_like_a_stub(backend, "backend, version 2")


def test_another_python_gets_no_byte_code_and_the_folder_is_still_made(
        tmp_path: Path, backend_model: Path) -> None:
    other = "2.7" if THIS_PYTHON != "2.7" else "3.99"
    backend = prepare_backend_dir(_runtime(tmp_path, other), tmp_path / "backend")
    assert (backend / "onnxruntime" / "model.py").is_file()
    assert not list(backend.rglob("*.pyc"))
