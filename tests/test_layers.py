"""The import graph of ``adaptive``: layers from the ground up, no import upwards, no cycle.

Every import counts, wherever it stands: at module level, inside a function
(imported on first use) or under ``TYPE_CHECKING``.  The layers, lowest
first, are those the README's layout and ``docs/api.md`` describe; a
package face (``__init__.py``) may hand on names of its own modules and of
lower layers.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "adaptive"

#: Each subpackage of ``adaptive`` and its floor; a module may import only from its own floor or lower ones.
LAYERS = {
    "_utils": 0,
    "runtime": 1,
    "observe": 2,
    "checkpoint": 3,
    "goodput": 4,
    "elastic": 5,
    "batchsize": 6,
    "parallel": 7,
    "data": 8,
    "integrations": 9,
}
TOP = 10  # adaptive/__init__.py and adaptive/__main__.py


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _floor(module: str) -> int:
    parts = module.split(".")
    return TOP if len(parts) < 2 else LAYERS.get(parts[1], TOP)


def _is_face(module: str) -> bool:
    return (ROOT / module.replace(".", "/") / "__init__.py").exists()


def _imports() -> dict[str, set[str]]:
    """Module -> the adaptive modules it imports (a package face counts as the modules it names)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("adaptive"):
                targets = [node.module]
                if _is_face(node.module):  # ``from adaptive.x import y``: y is a module or a name of the face
                    targets = [f"{node.module}.{alias.name}" for alias in node.names
                               if (ROOT / f"{node.module}.{alias.name}".replace(".", "/")).with_suffix(".py").exists()
                               or _is_face(f"{node.module}.{alias.name}")] or [node.module]
                graph[module].update(targets)
            elif isinstance(node, ast.Import):
                graph[module].update(alias.name for alias in node.names if alias.name.startswith("adaptive"))
    return graph


def test_the_layers_cover_every_subpackage() -> None:
    subpackages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(LAYERS), "give each subpackage of adaptive its floor in LAYERS (and in the docs)"


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for module, targets in _imports().items():
        for target in targets:
            face_of_own_package = module.count(".") == 1 and _is_face(module) and target.startswith(module + ".")
            if _floor(target) > _floor(module) and not face_of_own_package and target != "adaptive":
                upward.append(f"{module} -> {target}")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


def test_no_two_modules_import_each_other() -> None:
    graph = {module: {t for t in targets if t != module and not _is_face(t)}
             for module, targets in _imports().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in list(graph):
        if module not in index:
            visit(module)
    assert not cycles, f"modules that import each other: {cycles}"


@pytest.mark.parametrize("module", ["adaptive.runtime.job", "adaptive.runtime.step", "adaptive.runtime.env"])
def test_the_ground_floor_imports_nothing_above_it(module: str) -> None:
    targets = _imports()[module]
    assert all(_floor(target) <= LAYERS["runtime"] for target in targets), targets
