"""The repository's words: what the tracked files say stays about the system, not about how it was made.

Every tracked text file (`git ls-files`; binary files and generated protobuf code skipped) is searched for
references to work items by number, to documents outside the repository, to package index addresses and for
dated measurement-log phrases; a hit fails naming file:line. The README stays short, and every relative link in
the README, `docs/*.md` and `bench/README.md` points at a file (and heading) that exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pdspark.testing.time_scale import scaled

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250

# name -> pattern (case-insensitive). Spelled so that this file does not match itself.
FORBIDDEN = {
    "a work item by number": r"\bissue\s+#?\d+",
    "a design document outside the code": r"\bDESIGN(\.md\b|\s*§)",
    "a path outside the repository": r"\.\./shared\b",
    "a work phase": r"\b(first|second|third|next)\s+wave\b",
    "a package index address": r"download\.pytorch\.org|pypi\.org/simple|--(extra-)?index-url\b",
    "a time of day": r"\b\d{1,2}:\d{2}(-\d{1,2}:\d{2})?\s+UTC\b",
    "a work session": r"\bthis\s+session\b|\bthe\s+session's\s+start\b",
    "a day's log": r"\b(earlier|later)\s+in\s+the\s+day\b|\bruns?\s+of\s+the\s+day\b",
    "a notebook": r"\blab\s+notebook\b",
    "the project's beginnings": r"\bfounding\b",
}
# (file name, rule) pairs allowed: a worker image installs the CPU build of torch from the PyTorch index, which is an
# install command, not prose (the documentation names the build, never the address).
ALLOWED = {("Dockerfile", "a package index address")}
_COMPILED = {name: re.compile(pattern, re.IGNORECASE) for name, pattern in FORBIDDEN.items()}

LINKED_DOCS = ["README.md", "bench/README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                      for p in (ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def tracked_text_files() -> list[tuple[str, str]]:
    """(path, text) of every tracked file that is text: decodes as UTF-8 and holds no NUL byte."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                         timeout=scaled(60)).stdout
    files = []
    for rel in out.decode().split("\0"):
        if not rel or re.search(r"_pb2(_grpc)?\.pyi?$", rel):
            continue
        path = ROOT / rel
        if not path.is_file():  # deleted in the work tree
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            files.append((rel, data.decode()))
        except UnicodeDecodeError:
            continue
    return files


def findings(files: list[tuple[str, str]]) -> list[str]:
    hits = []
    for rel, text in files:
        name = Path(rel).name
        for lineno, line in enumerate(text.splitlines(), 1):
            for rule, pattern in _COMPILED.items():
                if (name, rule) in ALLOWED:
                    continue
                m = pattern.search(line)
                if m:
                    hits.append(f"{rel}:{lineno}: {rule}: {m.group(0)!r}")
    return hits


def test_no_tracked_file_speaks_of_how_it_was_made():
    files = tracked_text_files()
    assert any(rel == "README.md" for rel, _ in files)
    hits = findings(files)
    assert not hits, "reword these:\n" + "\n".join(hits)


# The examples are assembled from pieces, so that this file's own text stays clean.
_INSTALL = "RUN pip install torch==2.13.0 --index" + "-url https://download" + ".pytorch.org/whl/cpu"


@pytest.mark.parametrize("line, rule", [
    ("as issue" + " 16 asked", "a work item by number"),
    ("see DESIGN" + ".md section 5", "a design document outside the code"),
    ("read ../" + "shared/notes", "a path outside the repository"),
    ("the first" + " wave's cluster", "a work phase"),
    (_INSTALL, "a package index address"),
    ("measured at 23:22-23:26" + " UTC", "a time of day"),
    ("hash-identical to this" + " session's start", "a work session"),
    ("earlier in" + " the day", "a day's log"),
])
def test_each_rule_catches_what_it_names(line, rule):
    hits = findings([("x.md", line)])
    assert len(hits) == 1 and hits[0].startswith(f"x.md:1: {rule}: "), hits


def test_http_sessions_and_plain_numbers_pass():
    fine = ["async with aiohttp.ClientSession() as session:", '@pytest.fixture(scope="session")',
            "the transfer engine session id (host:port)", "In two waves: a request counts as waiting",
            "the certificate authority issues 3 certificates", '"issue": 2766']
    assert findings([("x.py", "\n".join(fine))]) == []


def test_a_dockerfile_may_name_the_index_it_installs_from():
    assert findings([("services/x/Dockerfile", _INSTALL)]) == []
    assert findings([("docs/x.md", _INSTALL)]) != []


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link and image outside code blocks and inline code."""
    out, fenced = [], False
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(lineno, m.group(1)) for m in _LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return out


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_every_relative_link_points_at_something_that_exists(doc):
    path = ROOT / doc
    text = path.read_text()
    broken = []
    for lineno, target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{doc}:{lineno}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{doc}:{lineno}: {target} (no such heading)")
        elif ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{doc}:{lineno}: {target} (outside the repository)")
    assert not broken, "\n".join(broken)


def test_the_docs_are_linked_from_the_readme():
    targets = {t.partition("#")[0] for _, t in links((ROOT / "README.md").read_text())}
    assert {d for d in LINKED_DOCS if d != "README.md"} <= targets
