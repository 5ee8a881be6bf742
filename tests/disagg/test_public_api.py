"""`import disagg` is the engine's public API: what it names exists and works as documented."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import disagg
from disagg.engine.request import RequestState


def test_every_exported_name_exists() -> None:
    missing = [name for name in disagg.__all__ if not hasattr(disagg, name)]
    assert missing == []


def test_the_package_example_runs_to_a_terminal_state() -> None:
    """The example in `disagg.__doc__`, run as written."""
    code = textwrap.dedent((disagg.__doc__ or "").split("::", 1)[1])  # the block after "::"
    namespace: dict[str, object] = {}
    exec(compile(code, "disagg.__doc__", "exec"), namespace)
    request = namespace["request"]
    assert request.state is RequestState.FINISHED_LENGTH  # type: ignore[attr-defined]
    assert len(request.output_token_ids) == 8  # type: ignore[attr-defined]


@pytest.mark.slow  # a fresh interpreter importing torch: about 1.5 s
def test_importing_disagg_loads_neither_fabric_nor_cli() -> None:
    """A library user pays for the engine only: no libfabric binding, typer or node code."""
    probe = ("import sys, disagg; print(sorted(m for m in sys.modules if m.startswith("
             "('transfer_core', 'typer', 'disagg.node', 'disagg.apps', 'disagg.kv_transfer'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
