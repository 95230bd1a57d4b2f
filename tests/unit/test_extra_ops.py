"""The extra operator library loader against a real `TORCH_LIBRARY` library, compiled here once per machine with
the system C++ compiler against torch's headers (cached by a hash of the source, the compiler and torch's
version). Loading is process-wide and a double registration terminates the process, so every load happens in a
fresh interpreter."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from pdspark.hardware.extra_ops import abi_mismatch, library_namespaces, split_paths
from pdspark.testing.time_scale import scaled

NAMESPACE = "pdspark_test_ops"
SOURCE = f"""
#include <torch/library.h>
#include <ATen/ATen.h>

static at::Tensor twice(const at::Tensor& x) {{ return x * 2; }}

TORCH_LIBRARY({NAMESPACE}, m) {{ m.def("twice(Tensor x) -> Tensor"); }}
TORCH_LIBRARY_IMPL({NAMESPACE}, CPU, m) {{ m.impl("twice", &twice); }}
"""
TAG = f"cpython-{sys.version_info.major}{sys.version_info.minor}-x86_64-linux-gnu"
OTHER_TAG = "cpython-39-x86_64-linux-gnu" if sys.version_info[:2] != (3, 9) else "cpython-312-x86_64-linux-gnu"
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _compile_command(source: Path, out: Path) -> list[str]:
    cxx = os.environ.get("CXX") or shutil.which("g++") or "c++"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    return [cxx, "-std=c++17", "-O0", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(source),
            "-o", str(out), *[f"-L{p}" for p in libs], "-lc10", "-ltorch_cpu"]
    # No rpath: the library is only ever loaded into a process that imported torch, whose libc10 and libtorch_cpu
    # then satisfy it by soname (as torch's own extensions are loaded), so one build serves every venv.


@pytest.fixture(scope="session")
def ops_library() -> Path:
    """The compiled library (untagged name), built once per source/compiler/torch and reused across sessions."""
    root = Path(os.environ.get("PDSPARK_CACHE_DIR") or Path.home() / ".cache" / "pdspark") / "test-ops"
    # Keyed by what the binary depends on, not by where this venv lives (a fresh clone's venv reuses the build).
    cxx = os.environ.get("CXX") or shutil.which("g++") or "c++"
    key = hashlib.sha256("\0".join([SOURCE, torch.__version__, cxx, str(torch._C._GLIBCXX_USE_CXX11_ABI)]).encode())
    out = root / key.hexdigest()[:16] / f"lib{NAMESPACE}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        source = out.with_name("ops.cpp")
        source.write_text(SOURCE)
        tmp = out.with_name(f".{os.getpid()}.so")
        subprocess.run(_compile_command(source, tmp), check=True, capture_output=True, timeout=scaled(600))
        os.replace(tmp, out)  # atomic: concurrent sessions race harmlessly
    return out


def _run(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter (with this checkout's pdspark): a load there cannot touch this process."""
    env = {**os.environ, "PYTHONPATH": SRC}
    code = "import torch\nfrom pdspark.hardware.extra_ops import *\n" + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=scaled(timeout))


def test_paths_split_on_commas_and_pathsep_and_abi_tags_are_checked():
    assert split_paths([f"a.so{os.pathsep}b.so, c.so", "", "d.so"]) == tuple(map(Path, ["a.so", "b.so", "c.so",
                                                                                         "d.so"]))
    assert abi_mismatch(Path(f"x.{TAG}.so")) is None and abi_mismatch(Path("x.so")) is None
    assert "built for CPython 3.9" in (abi_mismatch(Path("x.cpython-39-x86_64-linux-gnu.so")) or "3.9")


def test_the_library_namespace_is_read_from_its_symbols(ops_library):
    assert library_namespaces(ops_library.read_bytes()) == {NAMESPACE}


def test_found_missing_op_wrong_tag_missing_file_and_double_loads(ops_library, tmp_path):
    tagged = tmp_path / f"ops.{TAG}.so"
    shutil.copy(ops_library, tagged)
    wrong = tmp_path / f"ops.{OTHER_TAG}.so"
    shutil.copy(ops_library, wrong)
    copy = tmp_path / "copy.so"  # the same bytes under another path
    shutil.copy(ops_library, copy)
    other = tmp_path / "other.so"  # other bytes (a rebuilt library) that register the same namespace
    other.write_bytes(ops_library.read_bytes() + b"\0rebuilt")
    result = _run(f"""
        need = {{"twice": ["{NAMESPACE}::twice"]}}
        libs = load_extra_ops([r"{tagged}"], need, "cpu")
        print("namespaces", sorted(libs[0].namespaces))
        print("value", torch.ops.{NAMESPACE}.twice(torch.ones(2)).tolist())
        print("again", load_extra_ops([r"{tagged}"], need, "cpu"))
        print("copy", load_extra_ops([r"{copy}"], need, "cpu"))
        for entries, need in [
            ([r"{tagged}"], {{"sparse_attention": ["{NAMESPACE}::twice", "{NAMESPACE}::nope"]}}),
            ([r"{wrong}"], {{}}),
            ([r"{tmp_path / 'absent.so'}"], {{}}),
            ([], {{"sparse_attention": ["custom::npu_sparse_attn_sharedkv"]}}),
            ([r"{other}"], {{}}),
        ]:
            try:
                load_extra_ops(entries, need, "npu")
            except ExtraOpsError as e:
                print("error", e)
        print("alive", torch.ops.{NAMESPACE}.twice(torch.ones(1)).tolist())
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:4] == [f"namespaces ['{NAMESPACE}']", "value [2.0, 2.0]", "again []", "copy []"], result.stdout
    errors, alive = lines[4:-1], lines[-1]
    assert len(errors) == 5 and alive == "alive [2.0]", result.stdout
    assert f"`sparse_attention` on device 'npu' needs the operator(s) {NAMESPACE}::nope" in errors[0]
    assert f"libraries searched: {tagged}" in errors[0]
    assert f"{wrong}' does not fit this Python: it is built for CPython" in errors[1]
    assert "absent.so' does not exist" in errors[2] and "PDSPARK_EXTRA_OPS_SO" in errors[2]
    assert "custom::npu_sparse_attn_sharedkv" in errors[3] and "set PDSPARK_EXTRA_OPS_SO" in errors[3]
    assert f"registers the operator namespace(s) ['{NAMESPACE}'], already registered by {tagged}" in errors[4]


def test_without_the_guard_a_second_copy_aborts_the_process(ops_library, tmp_path):
    """What the guard prevents: torch itself loading a second copy terminates the interpreter."""
    copy = tmp_path / "copy.so"
    shutil.copy(ops_library, copy)
    raw = _run(f"""
        torch.ops.load_library(r"{ops_library}")
        torch.ops.load_library(r"{copy}")
        print("survived")
    """)
    assert raw.returncode != 0 and "survived" not in raw.stdout
