"""The CPU kernel library's build: a C source compiled once per machine into a cache, then opened with ctypes.

The cache key covers everything the machine code depends on: the source and every C source and header beside it
(kernels.c `#include`s its parts), the CPU's feature flags (`-march=native`), the compile command and the compiler's
version. Environment problems (no compiler, a read-only home, a `noexec` cache, a failed compile) are logged and
answered with None, never raised: callers then take the PyTorch path.
`PDSPARK_SANITIZE=1` builds with AddressSanitizer and UBSan (the process must preload the ASan runtime).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Wide vectors, but no fast-math and no FMA contraction: the loops keep their float32 roundings (the partial sums
# are spelled out in the source, so the vector width does not change results).
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread", "-fno-fast-math", "-ffp-contract=off")
# Sanitizer errors abort (no recovery), so a test run cannot scroll past one.
_SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g", "-fno-sanitize-recover=undefined")
# libstdc++ after the ASan runtime: without it ASan's `__cxa_throw` interceptor finds no real function, and the first
# C++ exception torch throws internally (e.g. a tensor compared with a non-tensor) aborts the process.
_PRELOAD_HINT = ('LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" '
                 "ASAN_OPTIONS=detect_leaks=0")


@dataclass(frozen=True)
class BuiltLibrary:
    """The opened library and the file it was opened from (the cache, or a temp copy when the cache failed)."""

    lib: ctypes.CDLL
    path: Path


def build_library(
    source: Path, name: str = "libpdspark_cpu", extra_flags: tuple[str, ...] = ()
) -> BuiltLibrary | None:
    """`source` compiled (or found in the cache) and opened; None, after a log line saying why, when it cannot be."""
    flags = compile_flags(extra_flags)
    if _SANITIZE_FLAGS[0] in flags and not _asan_loaded():
        # dlopen of a sanitized library into a process without the ASan runtime aborts it: refuse before building.
        logger.error("PDSPARK_SANITIZE=1 needs the ASan runtime preloaded: run with %s; using the PyTorch path",
                     _PRELOAD_HINT)
        return None
    cc = _compiler()
    if cc is None:
        return None
    command = [*cc, *flags]
    key = cache_key(source_bytes(source), [*command, "-lm"], _compiler_version(cc), _cpu_key())
    path = _cache_dir() / f"{name}_{key}.so"
    if not os.path.isfile(path):  # (isfile: False, not an error, when the cache's parent is not even a directory)
        directory = _writable_dir(path.parent)
        if directory is None:
            return None
        path = directory / path.name
        if not _compile(command, source, path):
            return None
    return _open(path)


def compile_flags(extra_flags: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The flags between the compiler and the source: the fixed ones, `extra_flags`, then the sanitizers when
    `PDSPARK_SANITIZE=1`."""
    sanitize = _SANITIZE_FLAGS if os.environ.get("PDSPARK_SANITIZE") == "1" else ()
    return (*_FLAGS, *extra_flags, *sanitize)


def source_files(source: Path) -> list[Path]:
    """What a build of `source` may read: `source`, then every other C source and header in its directory, by name
    (a unity build `#include`s its parts from beside it; files elsewhere are not looked for)."""
    parts = sorted((p for p in source.parent.iterdir() if p.suffix in (".c", ".h") and p.is_file() and p != source),
                   key=lambda p: p.name)
    return [source, *parts]


def source_bytes(source: Path) -> bytes:
    """The sources as the cache key sees them: each file's name and content (not its directory: a copy elsewhere
    keys the same), so that an edit to any of them, or a file added or removed, makes a new key."""
    return repr([(p.name, p.read_bytes()) for p in source_files(source)]).encode()


def cache_key(source: bytes, command: Sequence[str], compiler_version: str, cpu: bytes) -> str:
    """The library's name tag: whatever changes the machine code (the command without its paths) changes it."""
    return hashlib.sha256(repr((source, tuple(command), compiler_version, cpu)).encode()).hexdigest()[:16]


def _cpu_key() -> bytes:
    """What `-march=native` depends on: the CPU's feature flags (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.encode()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}".encode()


def _asan_loaded() -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            return "libasan" in f.read()
    except OSError:
        return False


def _compiler() -> list[str] | None:
    """The compiler's command: `CC` split as a shell would (`ccache gcc` is two words), else `cc` or `gcc` on PATH."""
    env = os.environ.get("CC", "").strip()
    if not env:
        found = shutil.which("cc") or shutil.which("gcc")
        if found is None:
            logger.warning("no C compiler (CC is unset and PATH has no cc or gcc); using the PyTorch path")
            return None
        return [found]
    try:
        cc = shlex.split(env)
    except ValueError as e:  # unbalanced quotes
        logger.warning("CC=%r cannot be parsed (%s); using the PyTorch path", env, e)
        return None
    if not cc or shutil.which(cc[0]) is None:
        # An explicit CC that is wrong is a mistake to report, not a reason to pick another compiler silently.
        logger.warning("CC=%r: no such program on PATH; using the PyTorch path", env)
        return None
    return cc


def _compiler_version(cc: list[str]) -> str:
    """`cc --version`'s first line (an upgraded compiler must rebuild); empty when the compiler will not say."""
    try:
        result = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.strip().partition("\n")[0]


def _cache_dir() -> Path:
    root = os.environ.get("PDSPARK_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdspark")
    return Path(root) / "kernels"


def _writable_dir(preferred: Path) -> Path | None:
    """`preferred`, created, when a file can be written in it; else a private temp directory (a read-only home
    still gets the fast path, rebuilt per process); None when neither works."""
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=preferred):  # a real write: os.access answers yes to root on a 0o555 dir
            pass
        return preferred
    except OSError as e:
        reason = e
    try:
        fallback = Path(tempfile.mkdtemp(prefix="pdspark-kernels-"))
    except OSError as e:
        logger.warning("kernel cache %s is not writable (%s), nor is the temp directory (%s); using the PyTorch path",
                       preferred, reason, e)
        return None
    logger.warning("kernel cache %s is not writable (%s); building in %s for this process", preferred, reason, fallback)
    return fallback


def _compile(command: list[str], source: Path, target: Path) -> bool:
    """Compile into a temp directory beside `target`, then rename: concurrent builders race harmlessly."""
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            result = subprocess.run([*command, str(source), "-o", str(out), "-lm"], capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building %s failed (%s); using the PyTorch path", target.name, result.stderr[-500:])
                return False
            os.replace(out, target)
    except OSError as e:  # the compiler cannot be run, or the directory vanished
        logger.warning("building %s failed (%s); using the PyTorch path", target.name, e)
        return False
    return True


def _open(path: Path) -> BuiltLibrary | None:
    """`path` opened; on failure (a `noexec` mount: "failed to map segment") a copy under the temp directory is."""
    try:
        return BuiltLibrary(ctypes.CDLL(str(path)), path)
    except OSError as e:
        logger.warning("cannot load %s (%s); retrying from a copy under %s", path, e, tempfile.gettempdir())
    try:
        copy = Path(tempfile.mkdtemp(prefix="pdspark-kernels-")) / path.name
        shutil.copyfile(path, copy)
        return BuiltLibrary(ctypes.CDLL(str(copy)), copy)
    except OSError as e:
        logger.warning("cannot load the copy either (%s); using the PyTorch path", e)
        return None
