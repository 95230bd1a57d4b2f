"""Every benchmark script imports pdspark before anything loads torch, so that a bare `python bench/<script>.py`
times the C path with sleeping OpenMP workers (`pdspark.omp_wait_policy`: libgomp reads `OMP_WAIT_POLICY` once, when
torch loads it; a script that loaded torch first left its workers spinning beside the kernels' own threads, and its
figures were not the ones `make bench` gives). `bench/ruff.toml` sorts pdspark's imports first; this checks what the
sorting cannot see: a script whose only pdspark imports sit inside functions, or a bench module it imports that loads
torch itself."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
TORCH_LOADERS = ("torch", "transformers")  # (transformers imports torch)


def _top_level_imports(tree: ast.Module) -> list[str]:
    """The modules a module's top level imports, in order (function and class bodies left out: they run later)."""
    out: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.append(node.module)
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])

    visit(tree.body)
    return out


def _imports() -> dict[str, list[str]]:
    return {p.stem: _top_level_imports(ast.parse(p.read_text(), str(p))) for p in sorted(BENCH.glob("*.py"))}


def _loads_torch(name: str, imports: dict[str, list[str]], seen: frozenset[str] = frozenset()) -> bool:
    """Whether importing `name` (a module, or a bench module by its stem) loads torch before it returns."""
    root = name.split(".")[0]
    if root in TORCH_LOADERS:
        return True
    if root not in imports or root in seen:
        return False
    return any(_loads_torch(m, imports, seen | {root}) for m in imports[root])


def test_every_benchmark_imports_pdspark_before_torch_loads():
    imports = _imports()
    late = []
    for script, modules in imports.items():
        for module in modules:
            if module.split(".")[0] == "pdspark":
                break
            if _loads_torch(module, imports):
                late.append(f"bench/{script}.py imports `{module}`, which loads torch, before pdspark")
                break
    assert not late, "\n".join(late)


def test_the_check_sees_a_script_that_loads_torch_first_and_one_that_does_so_through_a_bench_module():
    imports = {"a": ["argparse", "torch", "pdspark"], "b": ["helper", "pdspark"], "helper": ["json", "transformers"],
               "c": ["pdspark", "torch"], "d": ["json"]}
    assert _loads_torch("a", imports) and _loads_torch("b", imports) and _loads_torch("helper", imports)
    assert not _loads_torch("d", imports) and not _loads_torch("pdspark.engine", imports)
    tree = ast.parse("import os\nif True:\n    import torch\ndef f():\n    import pdspark\n")
    assert _top_level_imports(tree) == ["os", "torch"]


def _top_level_names(tree: ast.Module) -> set[str]:
    """The names a module's top level binds: its functions, classes, assignments and imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_every_name_a_benchmark_takes_from_another_bench_module_is_there():
    # (bench_kernel_threads and bench_cpu_contention took `run` from bench_dspark after 61e3a05 replaced it with
    # `DecodeMeter`: both failed on start)
    trees = {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(BENCH.glob("*.py"))}
    defined = {stem: _top_level_names(tree) for stem, tree in trees.items()}
    missing = [f"bench/{stem}.py: `from {node.module} import {alias.name}` (line {node.lineno})"
               for stem, tree in trees.items() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in defined
               for alias in node.names if alias.name not in defined[node.module]]
    assert not missing, "\n".join(missing)
