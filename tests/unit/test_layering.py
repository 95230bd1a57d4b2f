"""The import structure of `src/pdspark`: layers point down only, and no module imports itself back in a circle.

Read with `ast` (nothing is imported), so a violation is reported even in code no test runs. Imports inside
functions count too: a lazy import that crosses a layer upwards is still a wall in the wrong place.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Rank of each top-level part of the package: a part may import only parts of a lower rank (and itself).
# Parts of equal rank are independent of each other (engine and transfer; serving, client and router).
LAYERS: dict[str, int] = {
    "errors": 0,
    "omp_wait_policy": 0,  # OpenMP threads that sleep, set before torch loads (the package's first import)
    "v1": 0,  # generated protobuf code
    "types": 1,
    "deadline": 1,
    "engine_extra": 1,  # the check that the `engine` extra is installed (cli, the package's LLM)
    "hardware": 1,
    "quant": 1,  # quantized checkpoints (ModelSlim) and their reference kernels, under model
    "assets": 1,
    "options": 1,  # the flag/env/keyword generator under config
    "parallel": 1,  # worker groups over torch.distributed: expert shards, the slot exchange, the rank group
    "model": 2,
    "config": 3,
    "cache": 4,
    "engine": 5,
    "transfer": 5,
    "rpc": 6,
    "serving": 7,
    "client": 7,
    "router": 7,
    "llm": 7,
    "launch": 8,  # `pdspark up` (plan, supervisor, process and Ray backends) and `ServiceProcess`
    "cli": 9,
    "testing": 9,  # helpers for tests and benchmarks: stub workers, services started by PID, waits with deadlines
    "__init__": 9,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] or parts
    return ".".join(parts)


def part_of(module: str) -> str:
    """`pdspark.cache.kv_cache` -> `cache`; `pdspark` (the package itself) -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> set[str]:
    """Every `pdspark...` module `path` imports, at module level or inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("pdspark"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdspark"):
            for a in node.names:  # `from pdspark.cache import kv_cache` imports a module, not a name
                sub = f"{node.module}.{a.name}"
                out.add(sub if MODULES.get(sub) else node.module)
    return out


PATHS = {module_name(p): p for p in sorted((SRC / "pdspark").rglob("*.py"))}
MODULES = dict.fromkeys(PATHS, True)
GRAPH = {m: {i for i in imports_of(p) if i in PATHS and i != m} for m, p in PATHS.items()}


def test_every_part_has_a_layer():
    assert {part_of(m) for m in PATHS} <= set(LAYERS), sorted({part_of(m) for m in PATHS} - set(LAYERS))


def test_layers_point_down():
    upward = [
        f"{m} ({part_of(m)}, rank {LAYERS[part_of(m)]}) imports {i} ({part_of(i)}, rank {LAYERS[part_of(i)]})"
        for m, deps in GRAPH.items()
        for i in sorted(deps)
        if part_of(i) != part_of(m) and LAYERS[part_of(i)] >= LAYERS[part_of(m)]
    ]
    assert not upward, "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (as a path that returns to its start), or None. Package `__init__` modules are
    left out: Python runs a package's `__init__` before any of its modules, which is an order, not a dependency."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        colour[m] = GREY
        stack.append(m)
        for d in sorted(graph[m]):
            if colour.get(d) == GREY:
                return stack[stack.index(d):] + [d]
            if colour.get(d) == WHITE and (found := visit(d)):
                return found
        stack.pop()
        colour[m] = BLACK
        return None

    for m in sorted(graph):
        if colour[m] == WHITE and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    packages = {m for m, p in PATHS.items() if p.name == "__init__.py"}
    graph = {m: deps - packages for m, deps in GRAPH.items() if m not in packages}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize(
    "graph, cyclic",
    [({"a": {"b"}, "b": {"c"}, "c": set()}, False), ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True)],
)
def test_cycle_finder_finds_cycles(graph, cyclic):
    assert (find_cycle(graph) is not None) == cyclic
