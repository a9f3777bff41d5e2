"""Fixtures the kernel tests share: a fresh fallback log, kernel-only runs, no Triton."""

import importlib
import importlib.util
import logging
import sys
from pathlib import Path

import pytest

from qwen_turbo.kernels import _triton
from tests.kernels.common import LOGGER

KERNELS = Path(_triton.__file__).parent


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """Forget which fallbacks were logged, and capture the log."""
    monkeypatch.setattr(_triton, "_logged", set())
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


@pytest.fixture
def no_interpreter(monkeypatch):
    """Outside Triton's interpreter: CPU tensors are then not the kernels'."""
    monkeypatch.setattr(_triton, "INTERPRET", False)


@pytest.fixture
def triton_missing(monkeypatch):
    """As if `import triton` had failed at import."""
    monkeypatch.setattr(_triton, "HAS_TRITON", False)
    monkeypatch.setattr(_triton, "UNAVAILABLE", "Triton is not installed (test)")


def _fell_back(*args, **kwargs):
    raise AssertionError("fell back to the reference")


@pytest.fixture
def kernel_only(request, monkeypatch):
    """Make any fallback to an eager reference fail the test. The test module names what to
    replace: REFERENCES = (module, "reference_name", ...)."""
    module, *names = request.module.REFERENCES
    for name in names:
        monkeypatch.setattr(module, name, _fell_back)


@pytest.fixture
def without_triton(monkeypatch, caplog):
    """A second copy of kernels/, imported with `import triton` failing; returns a function
    giving that copy's module of an op. Its fallback log is captured in caplog."""
    pkg = "_qt_kernels_without_triton"
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    caplog.set_level(logging.INFO, logger=f"{pkg}._triton")
    spec = importlib.util.spec_from_file_location(
        pkg, KERNELS / "__init__.py", submodule_search_locations=[str(KERNELS)]
    )
    try:
        sys.modules[pkg] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[pkg])
        yield lambda op: importlib.import_module(f"{pkg}.{op}")
    finally:
        for name in [n for n in sys.modules if n.startswith(pkg)]:
            del sys.modules[name]
