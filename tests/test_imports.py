"""The package's seams: every module imports on its own, and no jaxpar modules import each other in a cycle."""
import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jaxpar"


def modules() -> dict[str, Path]:
    found = {}
    for file in PACKAGE.rglob("*.py"):
        name = ".".join(file.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = file
    return found


def imports_of(name: str, file: Path, known: dict) -> set[str]:
    """jaxpar modules `name` imports anywhere in its body (function-level imports count too)."""
    out = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return {m for m in out if m in known and m != name and known[m].name != "__init__.py"}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    known = modules()
    graph = {name: imports_of(name, file, known) for name, file in known.items()}
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_imports_alone():
    """Each module imported first, in a fresh jaxpar namespace (one interpreter; jax itself stays loaded)."""
    names = sorted(modules())
    script = "\n".join([
        "import importlib, sys",
        f"for name in {names!r}:",
        "    for loaded in [m for m in sys.modules if m == 'jaxpar' or m.startswith('jaxpar.')]:",
        "        del sys.modules[loaded]",
        "    try:",
        "        importlib.import_module(name)",
        "    except Exception as err:",
        "        print(f'FAILED {name}: {type(err).__name__}: {err}')",
    ])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "FAILED" not in result.stdout, result.stdout


# ----------------------------------------------------------------------------- layers

LAYERS = [("config", "configs", "config_checks", "checks", "env", "units", "figures", "strategies"),
          ("model", "data", "mesh"), ("kernels",), ("parallel",), ("train",), ("measure", "bench"),
          ("cluster", "plan", "launch"), ("labs", "cli", "dryrun", "training")]
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}
# Imports that still run back up a layer, each with what has to move; the list may only shrink (the test fails
# on a new back-edge, and on one that is gone but still listed).
KNOWN_BACK_EDGES: set[tuple[str, str]] = set()


def layer_of(module: str) -> int:
    return LAYER[module.split(".")[1]]


def back_edges() -> set[tuple[str, str]]:
    """Every import (function-local ones included) from a module to one in a higher layer."""
    known = modules()
    return {(name, target) for name, file in known.items() if name != "jaxpar"
            for target in imports_of(name, file, known) if layer_of(target) > layer_of(name)}


def test_every_package_has_a_layer():
    assert {name.split(".")[1] for name in modules() if name != "jaxpar"} <= set(LAYER)


def test_no_import_runs_back_up_a_layer():
    found = back_edges()
    assert found - KNOWN_BACK_EDGES == set(), "new imports up a layer"
    assert KNOWN_BACK_EDGES - found == set(), "gone: take them off KNOWN_BACK_EDGES"
