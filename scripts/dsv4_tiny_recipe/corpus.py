"""The corpus: the running interpreter's standard library, split into train and held-out by a hash of each file's
relative path, and its description for the run record."""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path

HELDOUT_MODULUS = 20  # a file is held out iff sha256(relpath) % 20 == 0, about 5%


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative posix path, path) of every stdlib `*.py` file outside site-/dist-packages, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if path.is_file() and not {"site-packages", "dist-packages"} & set(rel.parts):
            files.append((rel.as_posix(), path))
    return sorted(files)


def is_heldout(relpath: str) -> bool:
    return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def load_split(split: str) -> list[str]:
    """Whole files of one split ("train" or "heldout"), in relative-path order."""
    want_heldout = split == "heldout"
    return [
        path.read_text(encoding="utf-8", errors="replace")
        for rel, path in stdlib_files()
        if is_heldout(rel) == want_heldout
    ]


def corpus_record() -> dict:
    files = stdlib_files()
    heldout = sum(is_heldout(rel) for rel, _ in files)
    return {
        "source": f"Python {sys.version.split()[0]} standard library: {sysconfig.get_paths()['stdlib']}",
        "files": len(files),
        "train_files": len(files) - heldout,
        "heldout_files": heldout,
        "rule": "all *.py recursively, excluding site-packages/dist-packages; sorted by relative path; "
        f"held out iff int(sha256(relpath).hexdigest(), 16) % {HELDOUT_MODULUS} == 0; "
        'whole files read as UTF-8 with errors="replace"',
        "packing": "documents joined with <|eos|> (each file followed by <|eos|>), cut into fixed-length windows",
    }
