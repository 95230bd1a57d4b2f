"""Every time bound in the tests is scaled by the suite's one factor (`PDSPARK_TEST_TIME_SCALE`, applied by
`pdspark.testing.time_scale.scaled`), so that a slow or busy machine sets one number instead of each test growing its
own slack.

Read with `ast` (nothing is imported): a number written straight into a place where it bounds how long the test
waits is a finding, naming file:line:
  - `timeout=<number>` in any call (a subprocess, an HTTP or gRPC call, a client's default, `communicate`, ...);
  - `<future>.result(<number>)`, `<thread>.join(<number>)`, `asyncio.wait_for(<aw>, <number>)`,
    `<process or event>.wait(<number>)` (not under `not`: `assert not event.wait(0.5)` is a window in which
    something must not happen, not a bound) and `wait_ready(<service>, <number>)` (`pdspark.launch`'s);
  - `time.monotonic() + <number>` (a deadline) and `time.monotonic() - t0 < <number>` (an elapsed-time bound),
    with `time.perf_counter()` or `time.time()` as well.
Written as `scaled(...)` (or through a name), a bound is not a finding. The helpers of `pdspark.testing` scale the
bounds they are given themselves (`wait_until(..., within_s)`, `ready(..., timeout=...)`, `load_of`, ...), so a call
of a name imported from there is not one either. A timeout that is the behaviour under test (a request's own deadline
that must pass) is given a name, which says so (`expires_s = 0.3  # the call's own timeout, not a bound`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


_CLOCKS = {"monotonic", "perf_counter", "time"}


def _number(node: ast.expr) -> bool:
    """A number written out: a literal, or arithmetic on literals only (`deadline_s + 30` is not one)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _number(node.operand)
    if isinstance(node, ast.BinOp):
        return _number(node.left) and _number(node.right)
    return False


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def _clock(node: ast.expr) -> bool:
    """`time.monotonic()`, `time.perf_counter()` or `time.time()`."""
    return (isinstance(node, ast.Call) and not node.args and isinstance(node.func, ast.Attribute)
            and node.func.attr in _CLOCKS and isinstance(node.func.value, ast.Name) and node.func.value.id == "time")


def _self_scaling(tree: ast.Module) -> set[str]:
    """The names this file imports from `pdspark.testing`, whose helpers scale the bounds they are given."""
    return {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("pdspark.testing") for alias in node.names}


def findings(source: str, rel: str = "x.py") -> list[str]:
    tree = ast.parse(source)
    exempt = _self_scaling(tree)
    negated = {id(node.operand) for node in ast.walk(tree) if isinstance(node, ast.UnaryOp)
               and isinstance(node.op, ast.Not)}
    hits = []

    def hit(node: ast.AST, what: str) -> None:
        hits.append(f"{rel}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _name(node.func)
            if isinstance(node.func, ast.Name) and name in exempt:
                continue
            for kw in node.keywords:
                if kw.arg == "timeout" and _number(kw.value):
                    hit(node, f"{name}(timeout={ast.unparse(kw.value)})")
            args = node.args
            positional = {"result": 0, "join": 0, "wait": 0, "wait_for": 1, "wait_ready": 1}.get(name)
            if positional is None or len(args) != positional + 1 or not _number(args[positional]):
                continue
            if name == "wait" and id(node) in negated:
                continue  # a window in which something must not happen
            if name == "wait_ready" and not isinstance(node.func, ast.Name):
                continue  # a method of some object, not `pdspark.launch`'s function
            hit(node, f"{name}(..., {ast.unparse(args[positional])})")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _clock(node.left) \
                and _number(node.right):
            hit(node, f"deadline {ast.unparse(node)}")
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Lt, ast.LtE)) \
                and isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.Sub) \
                and _clock(node.left.left) and _number(node.comparators[0]):
            hit(node, f"elapsed-time bound {ast.unparse(node)}")
    return hits


def _test_files() -> dict[str, str]:
    return {path.relative_to(TESTS).as_posix(): path.read_text() for path in sorted(TESTS.rglob("*.py"))}


def test_every_time_bound_in_the_tests_is_scaled():
    hits = [h for rel, text in _test_files().items() for h in findings(text, rel)]
    assert not hits, "scale these bounds with pdspark.testing.time_scale.scaled (or name a timeout that is the " \
                     "behaviour under test):\n" + "\n".join(hits)


@pytest.mark.parametrize("line", [
    "subprocess.run(cmd, timeout=60)",
    "urllib.request.urlopen(req, timeout=10)",
    "stub.GetLoad(request, timeout=5.0)",
    "AsyncClient(address, timeout=30)",
    "future.result(30)",
    "thread.join(10)",
    "asyncio.run(asyncio.wait_for(coro, 60))",
    "assert done.wait(30)",
    "proc.wait(10)",
    "wait_ready(service, 60)",
    "deadline = time.monotonic() + 20",
    "assert time.perf_counter() - t0 < 0.5",
    "assert time.monotonic() - t0 < 2 * 1.5",
])
def test_a_bound_written_as_a_number_is_found(line):
    assert len(findings(line)) == 1, findings(line)


@pytest.mark.parametrize("line", [
    "subprocess.run(cmd, timeout=scaled(60))",
    "future.result(scaled(30))",
    "deadline = time.monotonic() + scaled(20)",
    "assert time.monotonic() - t0 < scaled(3.0)",
    "client.call(request, timeout=expires_s)",  # a named timeout: the behaviour under test
    "stub.Generate(request, timeout=deadline_s + scaled(30))",
    "assert not spinning.wait(0.5)",  # a window in which something must not happen
    "', '.join(names)",
    "prometheus.wait_ready(15)",  # a method, not pdspark.launch's function
    "TransferPlan(timeout_s=5.0)",  # a field of a message, not a wait
    "await asyncio.sleep(0.1)",
    "assert 0.04 < waited",
])
def test_what_is_scaled_named_or_no_bound_is_not_found(line):
    assert findings(line) == []


def test_the_helpers_of_pdspark_testing_scale_what_they_are_given():
    source = ("from pdspark.testing.services import ready, start_worker\n"
              "from pdspark.launch.service_process import start_service\n"
              "ready(a, b, timeout=120)\nstart_worker('decode', m, timeout=60)\nstart_service('x', [], timeout=60)\n")
    assert findings(source) == ["x.py:5: start_service(timeout=60)"]
