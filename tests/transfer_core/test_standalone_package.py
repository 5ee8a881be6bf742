"""The transfer core is a library of its own (S5, S4c): `pip install ./transfer_core` into a fresh
virtual environment, with no torch and no disagg, installs numpy and cffi only, every module
imports, and the two-process example moves its pages over tcp and shm there.

One environment for the file (built once, about a minute: pip builds the cffi modules from
their C sources), from the checkout's `transfer_core/` exactly as the reference page says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A fresh virtual environment, a pip install that compiles C, real processes over libfabric.
pytestmark = [pytest.mark.slow, pytest.mark.fabric]

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "transfer_core"
EXAMPLE = PACKAGE / "examples" / "two_process.py"
# What may be installed besides the package: its two dependencies, cffi's own, and the venv's.
ALLOWED = {"transfer-core", "numpy", "cffi", "pycparser", "pip", "setuptools"}


def _run(python: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python args` from `cwd`, with no PYTHONPATH pointing back at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh venv holding `pip install -c constraints.txt ./transfer_core`."""
    where = tmp_path_factory.mktemp("standalone")
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    start = time.monotonic()
    done = _run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                "-c", str(ROOT / "constraints.txt"), str(PACKAGE), cwd=where, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"pip install ./transfer_core: {time.monotonic() - start:.0f} s")
    # The build left nothing in the package directory (its build tree is a temporary one).
    assert not [p.name for p in PACKAGE.iterdir() if p.name == "build" or p.suffix == ".egg-info"]
    return python


def test_installs_numpy_and_cffi_only(venv_python: Path, tmp_path: Path) -> None:
    """The venv holds the package, numpy, cffi (and pycparser): no torch, no disagg."""
    done = _run(venv_python, "-m", "pip", "list", "--format=json", cwd=tmp_path)
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(done.stdout)}
    assert {"transfer-core", "numpy", "cffi"} <= installed
    assert installed <= ALLOWED, f"unexpected: {sorted(installed - ALLOWED)}"
    probe = ("import importlib.util as u, transfer_core; "
             "print(transfer_core.__file__, u.find_spec('torch'), u.find_spec('disagg'))")
    done = _run(venv_python, "-c", probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    location, torch, disagg = done.stdout.split()
    assert Path(location).is_relative_to(venv_python.parents[1]), location
    assert (torch, disagg) == ("None", "None")


def test_every_module_imports_without_torch(venv_python: Path, tmp_path: Path) -> None:
    """Every module, staging and cuda included, imports; torch-needing calls name the extra."""
    probe = """
import importlib, pkgutil, transfer_core
from pathlib import Path
names = [m.name for m in pkgutil.walk_packages(transfer_core.__path__, "transfer_core.")]
for name in names:
    importlib.import_module(name)
assert all(hasattr(transfer_core, n) for n in transfer_core.__all__)
assert (Path(transfer_core.__file__).parent / "py.typed").exists()
from transfer_core.optional import require_torch
try:
    require_torch("transfer_core.staging")
except ImportError as error:
    print(error)
print(len(names), "modules")
"""
    done = _run(venv_python, "-c", probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "transfer_core.staging needs torch" in done.stdout
    assert "transfer_core[torch]" in done.stdout
    assert int(done.stdout.split()[-2]) > 20


def test_import_disagg_fails(venv_python: Path, tmp_path: Path) -> None:
    """disagg is not reachable from the standalone environment."""
    done = _run(venv_python, "-c", "import disagg", cwd=tmp_path)
    assert done.returncode != 0
    assert "No module named 'disagg'" in done.stderr


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_the_example_runs(venv_python: Path, tmp_path: Path, provider: str) -> None:
    """transfer_core/examples/two_process.py: the counter fires, every byte matches."""
    done = _run(venv_python, str(EXAMPLE), "--provider", provider, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{provider}: 8 pages of 4096 bytes" in done.stdout
    assert "every byte matched" in done.stdout
