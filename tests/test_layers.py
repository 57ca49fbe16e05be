"""The package's folders are its layers, and imports only go down.

Every import in every module of ``mptok`` (at module level or inside a
function) is read from the source and checked against the layer order; and
``docs/ARCHITECTURE.md`` names every module, so the map a reader starts
from matches the folders.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "mptok"

# Bottom to top. A module may import its own layer and the layers below it;
# layers of one rank (cache and transport, routing and api, supervise, vllm
# and sglang, serve and render) stand side by side and may not import each other.
# engines is the floor the cache tokenizes on; front joins routing and api
# for serve, vllm and sglang; supervise is the floor serve and render both stand on;
# cli (mptok/cli.py, the ``mptok`` command) starts either.
RANKS = {
    "core": 0, "engines": 1, "cache": 2, "transport": 2, "routing": 3, "api": 3, "front": 4, "supervise": 5, "vllm": 5, "sglang": 5,
    "serve": 6, "render": 6, "cli": 7,
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "mptok" else None


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(REPO).with_suffix("")
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        found.append((".".join(parts), path))
    return found


def _imports(module: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level] if path.name != "__init__.py" else module.split(".")[: len(module.split(".")) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.append(node.module)
    return [name for name in names if name == "mptok" or name.startswith("mptok.")]


def test_every_module_sits_in_a_known_layer():
    for module, path in _modules():
        if module == "mptok":
            continue
        assert _layer(module) in RANKS, f"{path.relative_to(REPO)} is in no layer of {sorted(RANKS)}"


@pytest.mark.parametrize("module,path", _modules(), ids=lambda value: value if isinstance(value, str) else "")
def test_imports_only_go_down(module, path):
    here = _layer(module)
    if here is None:  # mptok/__init__.py: the public names, loaded lazily from every layer
        return
    for imported in _imports(module, path):
        there = _layer(imported)
        assert there is not None, f"{module} imports the package root ({imported}); import the layer's module"
        if there == here:
            continue
        assert RANKS[there] < RANKS[here], f"{module} ({here}) imports {imported} ({there}): not a lower layer"


def test_the_architecture_doc_names_every_module():
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    for module, path in _modules():
        if path.name == "__init__.py":
            continue
        relative = path.relative_to(PACKAGE).as_posix()
        assert relative in doc, f"docs/ARCHITECTURE.md's module table does not name {relative}"


def test_no_module_imports_itself_through_others():
    # Within a layer imports may go either way, so the order above cannot
    # rule out a circle (a module that needs a second one that needs it,
    # tied by an import inside a function); a spawn target named by its
    # module path ("module:function") is not an import.
    modules = dict(_modules())
    graph = {module: set() for module in modules}
    for module, path in modules.items():
        for imported in _imports(module, path):
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            target = ".".join(parts)
            if target and target != module:
                graph[module].add(target)
    for start in graph:
        seen, stack = set(), [(start, (start,))]
        while stack:
            module, path = stack.pop()
            for imported in graph[module]:
                assert imported != start, f"import circle: {' -> '.join(path + (start,))}"
                if imported not in seen:
                    seen.add(imported)
                    stack.append((imported, path + (imported,)))
