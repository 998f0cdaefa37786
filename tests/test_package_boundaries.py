"""The package seams hold: the drivers (and so the exporter image) need only the contract, the
contract needs no runtime, and no module imports itself back through others."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from fixtures.source import parse_python

ROOT = Path(__file__).parents[1]
PACKAGES = {
    "vmsidecar_contract": ROOT / "contract" / "src" / "vmsidecar_contract",
    "vmsidecar_runtime": ROOT / "runtime" / "src" / "vmsidecar_runtime",
    "jumpstarter_driver_vmsidecar": ROOT / "drivers" / "src" / "jumpstarter_driver_vmsidecar",
    "vmsidecar_images": ROOT / "images" / "src" / "vmsidecar_images",
}
#: the runtime's own dependencies: none may be loaded by importing the drivers
RUNTIME_ONLY = ("vmsidecar_runtime", "qemu.qmp", "oras", "zstandard", "aiofiles", "libvirt")


def _modules(package: str) -> dict[str, Path]:
    base = PACKAGES[package]
    found = {}
    for path in base.rglob("*.py"):
        parts = [package, *path.relative_to(base).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def test_importing_every_driver_module_loads_nothing_of_the_runtime() -> None:
    modules = sorted(_modules("jumpstarter_driver_vmsidecar")) + sorted(_modules("vmsidecar_contract"))
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(n for n in sys.modules if n.startswith({RUNTIME_ONLY!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"the drivers pulled in runtime modules: {out}"


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = parse_python(path)
    is_pkg = path.name == "__init__.py"
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}  # annotations, not imports at run time
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def import_graph() -> dict[str, list[str]]:
    """Module -> the modules of this project it imports at run time."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        modules |= _modules(package)
    return {name: sorted(_imports(name, path, set(modules))) for name, path in modules.items()}


def test_no_import_cycles() -> None:
    graph = {name: set(deps) for name, deps in import_graph().items()}
    # a package's __init__ re-exporting its children is not a cycle of logic
    graph = {n: {d for d in deps if not d.startswith(n + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in graph[node]:
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(dep):], dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_contract_imports_no_runtime() -> None:
    for name, path in _modules("vmsidecar_contract").items():
        assert "vmsidecar_runtime" not in path.read_text(), f"{name} refers to the runtime"


#: the runtime's floors, top first (docs/architecture.md draws them): a module imports only from its
#: own floor and the floors below; a module belongs to the floor of its longest prefix listed here
RUNTIME_FLOORS = [
    ["__init__", "cli", "serve", "oci.cli"],
    ["api"],
    ["controller"],
    ["backend", "devices", "console", "stream_pipes", "firmware", "snapshots", "snapshot_identity",
     "capture_ram", "readiness_rules", "disk", "oci.snapshot_push", "oci.snapshot_fetch"],
    ["oci", "image", "plan", "accel", "procs", "perms", "hostpaths", "ports", "metrics", "events", "audit",
     "threads", "confinement", "libvirt_emulator"],
]


def _floor(module: str) -> int:
    """How high ``module`` (of the runtime, without the package name) sits: 0 is the bottom."""
    best = None
    for height, floor in enumerate(reversed(RUNTIME_FLOORS)):
        for prefix in floor:
            mine = module == prefix or module.startswith(prefix + ".")
            if mine and (best is None or len(prefix) > len(best[0])):
                best = (prefix, height)
    assert best is not None, f"vmsidecar_runtime.{module} is on no floor: add it to RUNTIME_FLOORS"
    return best[1]


def test_the_runtimes_floors_import_only_downwards() -> None:
    prefix = "vmsidecar_runtime."
    upwards = []
    for name, deps in import_graph().items():
        if not name.startswith(prefix):
            continue
        for dep in deps:
            if dep.startswith(prefix) and _floor(dep[len(prefix):]) > _floor(name[len(prefix):]):
                upwards.append(f"{name} -> {dep}")
    assert not upwards, "imports from a higher floor:\n" + "\n".join(sorted(upwards))
