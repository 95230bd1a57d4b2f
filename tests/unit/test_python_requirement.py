"""The Python the project says it needs is the one it needs: 3.11 (the router runs on `asyncio.Runner`, and
`except TimeoutError` around `asyncio.wait_for` catches 3.11's timeout, the builtin, not 3.10's
`asyncio.TimeoutError`). pyproject's `requires-python` says so and admits the interpreter running the tests; the
lint and type-check targets, the README and the service images agree with it."""

from __future__ import annotations

import platform
import re
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
MAJOR, MINOR = 3, 11  # the minimum


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_requires_python_says_3_11_and_admits_this_interpreter():
    spec = SpecifierSet(pyproject()["project"]["requires-python"])
    assert spec.contains(platform.python_version()), f"{spec} refuses the Python running the tests"
    assert spec.contains(f"{MAJOR}.{MINOR}.0"), f"{spec} refuses {MAJOR}.{MINOR}"
    older = f"{MAJOR}.{MINOR - 1}"
    assert not spec.contains(f"{older}.99"), f"{spec} admits {older}, which the router cannot run on"


def test_the_tools_the_readme_and_the_images_name_the_same_minimum():
    config = pyproject()
    assert config["tool"]["ruff"]["target-version"] == f"py{MAJOR}{MINOR}"
    assert config["tool"]["mypy"]["python_version"] == f"{MAJOR}.{MINOR}"
    assert f"Python {MAJOR}.{MINOR}+" in (ROOT / "README.md").read_text()
    dockerfiles = sorted((ROOT / "services").glob("*/Dockerfile"))
    assert dockerfiles
    spec = SpecifierSet(config["project"]["requires-python"])
    for dockerfile in dockerfiles:
        # (`FROM python:X.Y...`, or the default of the `ARG BASE` a worker image's FROM takes)
        bases = re.findall(r"^(?:FROM |ARG BASE=)python:(\d+\.\d+)", dockerfile.read_text(), re.MULTILINE)
        assert bases, f"{dockerfile.relative_to(ROOT)} names no python base image"
        for version in bases:
            assert spec.contains(f"{version}.0"), f"{dockerfile.relative_to(ROOT)}: python {version}"
