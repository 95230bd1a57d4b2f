"""`Engine.step` reads as its pipeline (schedule -> propose -> run -> decide -> commit -> append) and stays short: what
a step does beyond that belongs in the named steps it calls (checked with `ast`, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "src" / "pdspark" / "engine" / "engine.py"
MAX_LINES = 12  # the statements after the docstring


def test_engine_step_is_at_most_twelve_lines():
    tree = ast.parse(ENGINE.read_text())
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    (step,) = [n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "step"]
    body = step.body[1:] if isinstance(step.body[0], ast.Expr) else step.body  # less the docstring
    lines = body[-1].end_lineno - body[0].lineno + 1
    assert lines <= MAX_LINES, f"Engine.step has {lines} lines after its docstring (at most {MAX_LINES})"
