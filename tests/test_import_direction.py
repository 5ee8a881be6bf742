"""The tree's import rules (docs/architecture.md, "Module map"), read from the source with `ast`.

Every `import` counts, also those inside functions and under `TYPE_CHECKING`: a late import
hides a dependency from the reader, it does not remove it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Left to right: a layer may import itself and any layer to its left, never one to its right.
LAYERS = ("leaves", "model", "parallel", "engine", "speculative", "control", "kv_transfer", "node",
          "server", "apps")
LEAVES = ("disagg.config", "disagg.model_config", "disagg.model_catalog", "disagg.errors",
          "disagg.utils")
# The simulator stands aside: it reads the engine's and the model's shapes and nothing else.
SIM_MAY_IMPORT = {"leaves", "model", "engine", "sim"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The `disagg` and `transfer_core` modules a file imports, as absolute names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] in ("disagg", "transfer_core")}


def source_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def layer_of(module: str) -> str:
    """The layer of a module under `disagg`; "" for the package root itself."""
    if module == "disagg":
        return ""
    if module.startswith(LEAVES):
        return "leaves"
    return module.split(".")[1]


def known_modules() -> set[str]:
    return {module_name(p) for pkg in ("disagg", "transfer_core") for p in source_files(pkg)}


def resolve(imported: str, known: set[str]) -> str:
    """`disagg.engine.request.Request` -> `disagg.engine.request` (the longest module)."""
    while imported not in known and "." in imported:
        imported = imported.rpartition(".")[0]
    return imported


def test_layers_import_only_to_their_left() -> None:
    known = known_modules()
    wrong = []
    for path in source_files("disagg"):
        here = layer_of(module_name(path))
        if here == "":
            continue  # disagg/__init__.py gathers the public API from below
        for imported in {resolve(m, known) for m in imports_of(path)}:
            if imported.startswith("transfer_core"):
                continue
            there = layer_of(imported)
            if here == "sim":
                ok = there in SIM_MAY_IMPORT
            elif there == "sim":
                ok = here == "apps"
            else:
                ok = there in LAYERS and LAYERS.index(there) <= LAYERS.index(here)
            if not ok:
                wrong.append(f"{module_name(path)} ({here}) imports {imported} ({there})")
    assert not wrong, "\n".join(wrong)


def test_transfer_core_never_imports_disagg() -> None:
    wrong = [f"{module_name(p)} imports {m}" for p in source_files("transfer_core")
             for m in imports_of(p) if m.startswith("disagg")]
    assert not wrong, "\n".join(wrong)


def test_transfer_core_uses_its_test_doubles_only_in_them() -> None:
    """`transfer_core.testing` builds on the engine; the engine never builds on it."""
    wrong = [f"{module_name(p)} imports {m}" for p in source_files("transfer_core")
             if "testing" not in p.parts for m in imports_of(p)
             if m.startswith("transfer_core.testing")]
    assert not wrong, "\n".join(wrong)


def test_production_never_imports_the_test_doubles() -> None:
    """`disagg` and `transfer_core` outside `transfer_core/testing/` never import it, late
    imports included: a node runs with no test double in reach (fault injection, which a
    node may run with, is `transfer_core.faults`)."""
    testing = ROOT / "transfer_core" / "testing"
    wrong = [f"{module_name(p)} imports {m}" for pkg in ("disagg", "transfer_core")
             for p in source_files(pkg) if testing not in p.parents
             for m in imports_of(p) if m.startswith("transfer_core.testing")]
    assert not wrong, "\n".join(wrong)


def import_closure(start: list[Path]) -> dict[str, str]:
    """Every module reachable from the files `start` through their imports (late ones too),
    each with the module that first pulled it in."""
    known = known_modules()
    seen = {module_name(p): "" for p in start}
    todo = list(seen)
    while todo:
        name = todo.pop()
        path = ROOT / Path(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for imported in {resolve(m, known) for m in imports_of(path)} & known:
            if imported not in seen:
                seen[imported] = name
                todo.append(imported)
    return seen


def test_the_server_never_reaches_kv_transfer() -> None:
    """The front door speaks the control plane (`disagg.control`) and starts nodes as
    processes; nothing it imports, however indirectly, is the KV-transfer package."""
    reached = import_closure(source_files("disagg/server"))
    wrong = [f"{m} (through {via})" for m, via in reached.items()
             if m.startswith("disagg.kv_transfer")]
    assert not wrong, "\n".join(wrong)


def test_control_never_imports_kv_transfer() -> None:
    wrong = [f"{module_name(p)} imports {m}" for p in source_files("disagg/control")
             for m in imports_of(p) if m.startswith("disagg.kv_transfer")]
    assert not wrong, "\n".join(wrong)


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph`, or [] when there is none (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    for start in graph:
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            step = next(stack[-1], None)
            if step is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(step) == 1:
                return [*path[path.index(step):], step]
            elif not state.get(step):
                state[step] = 1
                path.append(step)
                stack.append(iter(sorted(graph.get(step, ()))))
    return []


@pytest.mark.parametrize("package", ["disagg", "transfer_core"])
def test_no_import_circle(package: str) -> None:
    """Between modules (a package's `__init__` re-exporting its modules does not count)."""
    known = known_modules()
    graph: dict[str, set[str]] = {}
    for path in source_files(package):
        if path.name == "__init__.py":
            continue
        name = module_name(path)
        targets = {resolve(m, known) for m in imports_of(path)}
        graph[name] = {t for t in targets if t != name and t in known
                       and not (ROOT / Path(*t.split("."), "__init__.py")).exists()}
    assert find_cycle(graph) == []


def test_find_cycle_finds_one() -> None:
    """The checker itself: a circle of three is found, a diamond is not a circle."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []
