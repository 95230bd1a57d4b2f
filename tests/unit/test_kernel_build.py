"""The kernel library's build on awkward machines: a compiler command with arguments, no compiler, a read-only
cache, a library that will not map, a sanitized build. A tiny C source keeps each build well under a second."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from fnmatch import fnmatch
from pathlib import Path

import pytest

from pdspark.hardware.cpu import kernel_build
from pdspark.hardware.cpu.kernel_build import build_library, cache_key, compile_flags, source_bytes
from pdspark.testing.time_scale import scaled

TINY = """
#include <stdlib.h>
int add_one(int x) { return x + 1; }
int heap_write(int i) { int *a = malloc(4 * sizeof(int)); a[i] = 1; int r = a[0]; free(a); return r; }
"""
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.c"
    path.write_text(TINY)
    return path


@pytest.fixture(autouse=True)
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Path:
    """The cache and the temp directory inside tmp_path; the compiler and the sanitizer switch from the test."""
    monkeypatch.setenv("PDSPARK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("PDSPARK_SANITIZE", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    caplog.set_level(logging.INFO, logger=kernel_build.__name__)
    return tmp_path


def warnings_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_a_compiler_command_with_arguments_is_split_like_a_shell(source, sandbox, monkeypatch):
    # `env gcc` stands in for `ccache gcc`: a program that runs its argument. As one executable name it fails.
    monkeypatch.setenv("CC", "ccache gcc" if shutil.which("ccache") else "env gcc")
    built = build_library(source, name="libtiny")
    assert built is not None
    assert built.lib.add_one(41) == 42
    assert built.path.parent == sandbox / "cache" / "kernels"
    assert built.path.name.startswith("libtiny_") and built.path.suffix == ".so"


def test_a_second_build_reuses_the_cached_library(source, monkeypatch):
    first = build_library(source, name="libtiny")
    assert first is not None
    monkeypatch.setattr(kernel_build, "_compile", lambda *a: pytest.fail("compiled again"))
    second = build_library(source, name="libtiny")
    assert second is not None and second.path == first.path


@pytest.mark.parametrize("cc", ["missing-file", "unset"])
def test_no_compiler_gives_none_and_says_why(source, sandbox, monkeypatch, caplog, cc):
    empty = sandbox / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    if cc == "missing-file":
        monkeypatch.setenv("CC", str(sandbox / "no-such-cc"))
    assert build_library(source) is None
    text = warnings_text(caplog)
    assert ("no-such-cc" if cc == "missing-file" else "no C compiler") in text
    assert "PyTorch path" in text


def test_a_read_only_cache_builds_in_a_private_temp_dir(source, sandbox, monkeypatch, caplog):
    # A cache path under a regular file: mkdir fails with NotADirectoryError whoever runs the test (root writes
    # through a chmod 0o555 directory, so a permission-based variant would prove nothing here).
    (sandbox / "a-file").write_text("")
    monkeypatch.setenv("PDSPARK_CACHE_DIR", str(sandbox / "a-file" / "cache"))
    built = build_library(source, name="libtiny")
    assert built is not None
    assert built.lib.add_one(1) == 2
    assert built.path.parent.parent == sandbox / "tmp"
    assert built.path.parent.name.startswith("pdspark-kernels-")
    assert "not writable" in warnings_text(caplog)


def test_no_writable_directory_at_all_gives_none(source, sandbox, monkeypatch, caplog):
    (sandbox / "a-file").write_text("")
    monkeypatch.setenv("PDSPARK_CACHE_DIR", str(sandbox / "a-file" / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(sandbox / "a-file" / "tmp"))
    assert build_library(source) is None
    assert "PyTorch path" in warnings_text(caplog)


def _failing_cdll(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[str]:
    """ctypes.CDLL failing its first `failures` calls as a `noexec` mount does; returns the paths it was given."""
    real, calls = ctypes.CDLL, []

    def cdll(path: str, *args, **kwargs):
        calls.append(path)
        if len(calls) <= failures:
            raise OSError(f"{path}: failed to map segment from shared object")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(kernel_build.ctypes, "CDLL", cdll)
    return calls


def test_a_library_that_cannot_be_mapped_is_loaded_from_a_temp_copy(source, sandbox, monkeypatch, caplog):
    calls = _failing_cdll(monkeypatch, failures=1)
    built = build_library(source, name="libtiny")
    assert built is not None
    assert built.lib.add_one(2) == 3
    assert len(calls) == 2 and Path(calls[0]).parent == sandbox / "cache" / "kernels"
    assert built.path == Path(calls[1]) and built.path.parent.parent == sandbox / "tmp"
    assert "failed to map segment" in warnings_text(caplog)


def test_a_library_that_never_loads_gives_none(source, monkeypatch, caplog):
    calls = _failing_cdll(monkeypatch, failures=2)
    assert build_library(source) is None
    assert len(calls) == 2
    assert "PyTorch path" in warnings_text(caplog)


def test_a_compile_error_gives_none_with_the_compiler_message(tmp_path, caplog):
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return undeclared_name; }\n")
    assert build_library(broken) is None
    text = warnings_text(caplog)
    assert "undeclared_name" in text and "PyTorch path" in text


def test_the_cache_key_follows_the_command_and_the_compiler_version():
    src, cpu = b"int f(void) { return 1; }", b"flags : avx2"
    command = ["gcc", *compile_flags(), "-lm"]
    key = cache_key(src, command, "gcc (Debian 12.2.0-14) 12.2.0", cpu)
    assert key == cache_key(src, list(command), "gcc (Debian 12.2.0-14) 12.2.0", cpu)  # stable
    assert key != cache_key(src, command, "gcc (Debian 13.1.0-1) 13.1.0", cpu)
    assert key != cache_key(src, ["ccache", *command], "gcc (Debian 12.2.0-14) 12.2.0", cpu)
    assert key != cache_key(src, ["gcc", *compile_flags(("-DX=1",)), "-lm"], "gcc (Debian 12.2.0-14) 12.2.0", cpu)
    assert key != cache_key(src, command, "", cpu)
    assert key != cache_key(src + b" ", command, "gcc (Debian 12.2.0-14) 12.2.0", cpu)
    assert key != cache_key(src, command, "gcc (Debian 12.2.0-14) 12.2.0", b"flags : avx512f")


def _unity_source(directory: Path, header: str = "#define ONE 1\n", part: str = "int one(void) { return ONE; }\n"
                  ) -> Path:
    """A unity build as kernels.c is one: a main file that includes a header and a part from beside it."""
    directory.mkdir()
    (directory / "part.h").write_text(header)
    (directory / "part.c").write_text(part)
    main = directory / "main.c"
    main.write_text('#include "part.h"\n#include "part.c"\n')
    return main


def test_the_cache_key_covers_every_c_source_and_header_beside_the_source(tmp_path):
    def key(main: Path) -> str:
        return cache_key(source_bytes(main), ["gcc", *compile_flags(), "-lm"], "gcc 12.2.0", b"flags : avx2")

    base = key(_unity_source(tmp_path / "base"))
    copy = _unity_source(tmp_path / "copy")
    assert key(copy) == base  # where the sources sit is not part of the key
    assert key(_unity_source(tmp_path / "header", header="#define ONE 2\n")) != base
    assert key(_unity_source(tmp_path / "part", part="int one(void) { return ONE + 0; }\n")) != base
    (copy.parent / "notes.txt").write_text("not a C file")
    assert key(copy) == base
    (copy.parent / "extra.h").write_text("")  # a new header beside it (an include of it may be added next)
    assert key(copy) != base
    (copy.parent / "extra.h").unlink()
    (copy.parent / "part.c").rename(copy.parent / "renamed.c")  # the same bytes under another name
    assert key(copy) != base


def test_editing_an_included_header_rebuilds_the_library(tmp_path):
    main = _unity_source(tmp_path / "src")
    first = build_library(main, name="libunity")
    assert first is not None and first.lib.one() == 1
    (main.parent / "part.h").write_text("#define ONE 2\n")
    second = build_library(main, name="libunity")
    assert second is not None and second.path != first.path
    assert second.lib.one() == 2


def test_the_package_ships_every_c_source_and_header_of_the_kernels():
    """An installed wheel compiles the kernels from its own copy: every .c and .h file the build reads must be
    package data."""
    import tomllib  # (Python 3.11+)

    root = Path(SRC).parent
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pdspark"]
    package = Path(SRC) / "pdspark"
    files = [p.relative_to(package).as_posix() for p in (package / "hardware" / "cpu").iterdir()
             if p.suffix in (".c", ".h")]
    assert {"hardware/cpu/kernels.c", "hardware/cpu/kernels.h", "hardware/cpu/gemm.c"} <= set(files)
    assert [f for f in files if not any(fnmatch(f, g) for g in globs)] == []


def test_a_compiler_that_will_not_say_its_version_still_builds(source, sandbox, monkeypatch):
    assert kernel_build._compiler_version(["false"]) == ""
    assert kernel_build._compiler_version([str(sandbox / "no-such-cc")]) == ""
    assert kernel_build._compiler_version(["gcc"]).startswith("gcc")
    monkeypatch.setattr(kernel_build, "_compiler_version", lambda cc: "")
    built = build_library(source, name="libtiny")
    assert built is not None and built.lib.add_one(0) == 1


def test_sanitize_without_the_asan_runtime_preloaded_refuses(source, monkeypatch, caplog):
    monkeypatch.setenv("PDSPARK_SANITIZE", "1")
    assert "-fsanitize=address,undefined" in compile_flags()
    monkeypatch.setattr(kernel_build, "_asan_loaded", lambda: False)
    monkeypatch.setattr(kernel_build, "_compile", lambda *a: pytest.fail("built a library it cannot load"))
    assert build_library(source) is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    preload = 'LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"'
    assert len(errors) == 1 and preload in errors[0]


def _asan_runtime() -> str | None:
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    path = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isfile(path) else None  # (an unknown name comes back as itself)


@pytest.mark.skipif(_asan_runtime() is None, reason="no ASan runtime next to gcc")
def test_a_sanitized_build_catches_a_heap_overflow_under_the_preloaded_runtime(source, sandbox):
    child = (
        "import sys; from pathlib import Path; from pdspark.hardware.cpu.kernel_build import build_library\n"
        f"built = build_library(Path({str(source)!r}), name='libtiny')\n"
        "print(built.lib.add_one(1), flush=True)\n"
        "built.lib.heap_write(4)\n"  # one past the end of a 4-int block
    )
    env = {**os.environ, "PDSPARK_SANITIZE": "1", "LD_PRELOAD": str(_asan_runtime()),
           "ASAN_OPTIONS": "detect_leaks=0", "PYTHONPATH": SRC, "TMPDIR": str(sandbox / "tmp")}
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=scaled(120))
    assert result.stdout.strip() == "2", result.stderr[-2000:]
    # UBSan's object-size check sees the store first; ASan would report it as a heap-buffer-overflow. Either aborts.
    assert result.returncode != 0
    assert "insufficient space for an object" in result.stderr or "heap-buffer-overflow" in result.stderr
