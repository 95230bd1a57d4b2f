"""`load_extra_ops`: operator libraries (`.so` files registering `torch.ops.<namespace>.<op>`) loaded at start-up.

The libraries come from `--extra-ops-so` / `PDSPARK_EXTRA_OPS_SO` (one or more paths, comma- or os.pathsep-
separated), e.g. an Ascend custom-op build. Each is checked before and after loading, so that a bad deployment fails
at start with a message naming the file, the variable and the missing piece, not mid-request:
1. the file exists;
2. a Python ABI tag in its name (`foo.cpython-311-x86_64-linux-gnu.so`) matches the running interpreter (untagged
   names pass);
3. it is not a second copy of a library already loaded, and it does not register a `TORCH_LIBRARY` namespace that is
   already registered: either would make the dispatcher terminate the process from C++, which Python cannot catch;
4. `torch.ops.load_library` succeeds (its error is wrapped, naming the file);
5. every operator each feature needs on the backend (`HardwareBackend.required_ops`) is registered afterwards.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pdspark.errors import ConfigError

logger = logging.getLogger(__name__)

EXTRA_OPS_ENV = "PDSPARK_EXTRA_OPS_SO"
_ABI_TAG = re.compile(r"\.cpython-(\d)(\d+)")
# `TORCH_LIBRARY(ns, m)` defines a static `TORCH_LIBRARY_init_<ns>`; in the symbol table its name is mangled with
# its length in front (`_ZL27TORCH_LIBRARY_init_my_ops...`), which tells where the namespace ends.
_LIBRARY_INIT = re.compile(rb"(\d+)(TORCH_LIBRARY_init_[A-Za-z0-9_]+)")
_INIT_PREFIX = len(b"TORCH_LIBRARY_init_")


class ExtraOpsError(ConfigError):
    """An extra operator library that is missing, built for another Python, unsafe to load, or without an operator
    a feature needs."""


@dataclass(frozen=True)
class LoadedLibrary:
    path: Path  # resolved
    digest: str  # sha256 of the file: a copy under another name has the same one
    namespaces: frozenset[str]  # the torch.ops namespaces it registered


# Every library this process loaded, by resolved path (loading is process-wide and cannot be undone).
_LOADED: dict[Path, LoadedLibrary] = {}


def split_paths(entries: Iterable[str]) -> tuple[Path, ...]:
    """The library paths of `--extra-ops-so` entries, each of which may hold several, comma- or os.pathsep-
    separated (as the variable is usually written)."""
    out = []
    for entry in entries:
        for part in re.split(f"[,{re.escape(os.pathsep)}]", entry):
            if part.strip():
                out.append(Path(part.strip()).expanduser())
    return tuple(out)


def abi_mismatch(path: Path) -> str | None:
    """Why `path`'s Python ABI tag does not fit this interpreter, or None (also for untagged names)."""
    m = _ABI_TAG.search(path.name)
    if m is None:
        return None
    major, minor = int(m.group(1)), int(m.group(2))
    if (major, minor) == sys.version_info[:2]:
        return None
    return f"it is built for CPython {major}.{minor} (`{m.group(0)[1:]}` in its name), this is " \
           f"{sys.version_info.major}.{sys.version_info.minor}"


def registered_namespaces() -> set[str]:
    """Namespaces of every operator the dispatcher knows (`aten`, `prim`, ... and loaded libraries')."""
    return {schema.name.split("::", 1)[0] for schema in torch._C._jit_get_all_schemas()}


def library_namespaces(data: bytes) -> set[str]:
    """The `TORCH_LIBRARY` namespaces a library's bytes define (from its symbol names; empty when stripped)."""
    out = set()
    for m in _LIBRARY_INIT.finditer(data):
        length, name = int(m.group(1)), m.group(2)
        if _INIT_PREFIX < length <= len(name):
            out.add(name[_INIT_PREFIX:length].decode())
    return out


def has_op(qualified: str) -> bool:
    """Whether `namespace::op` is registered."""
    namespace, _, name = qualified.partition("::")
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def load_library(path: Path) -> LoadedLibrary | None:
    """Check and load one library; None when it is already loaded (the same file, or a copy of it)."""
    if not path.is_file():
        raise ExtraOpsError(f"{EXTRA_OPS_ENV}: extra operator library {str(path)!r} does not exist")
    why = abi_mismatch(path)
    if why:
        raise ExtraOpsError(f"{EXTRA_OPS_ENV}: extra operator library {str(path)!r} does not fit this Python: {why}")
    real = path.resolve()
    if real in _LOADED:
        return None
    data = real.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    for lib in _LOADED.values():
        if lib.digest == digest:
            logger.warning("%s is a copy of the already loaded %s; not loading it again", path, lib.path)
            return None
    before = registered_namespaces()
    clash = library_namespaces(data) & before
    if clash:
        owners = [str(lib.path) for lib in _LOADED.values() if lib.namespaces & clash]
        raise ExtraOpsError(
            f"{EXTRA_OPS_ENV}: {str(path)!r} registers the operator namespace(s) {sorted(clash)}, already registered"
            f" by {', '.join(owners) if owners else 'another library of this process'}; loading it would abort the "
            "process (list each library once)")
    try:
        torch.ops.load_library(str(real))
    except (OSError, RuntimeError) as e:
        raise ExtraOpsError(f"{EXTRA_OPS_ENV}: failed to load {str(path)!r}: {e} (the libraries it depends on must "
                            "be on LD_LIBRARY_PATH)") from e
    lib = LoadedLibrary(real, digest, frozenset(registered_namespaces() - before))
    _LOADED[real] = lib
    logger.info("loaded extra operator library %s (namespaces %s)", real, sorted(lib.namespaces))
    return lib


def load_extra_ops(entries: Sequence[str], required: Mapping[str, Sequence[str]], backend: str) -> list[LoadedLibrary]:
    """Load every library of `entries` (paths, see `split_paths`), then check that each feature's operators
    (`required`: feature -> `namespace::op` names) are registered. Returns the libraries loaded by this call.
    Operators that another package registered count too, and a library loaded before is not loaded again."""
    paths = split_paths(entries)
    loaded = [lib for lib in (load_library(p) for p in paths) if lib is not None]
    for feature, ops in required.items():
        missing = [op for op in ops if not has_op(op)]
        if missing:
            searched = ", ".join(str(p) for p in paths) or f"none: set {EXTRA_OPS_ENV} (or --extra-ops-so)"
            raise ExtraOpsError(f"`{feature}` on device {backend!r} needs the operator(s) {', '.join(missing)}, "
                                f"which are not registered; libraries searched: {searched}")
    return loaded
