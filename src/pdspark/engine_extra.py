"""`require_engine`: the check that the `engine` extra is installed, before anything imports it.

The core package (router, SDK, CLI) installs without torch; the workers, `pdspark up`, `pdspark generate` and `LLM`
load the model and need the extra's packages. Without them they stop with an error naming the extra and its pip
line, not with a `ModuleNotFoundError` from deep in the model code. Only whether each module can be found is
checked (no import): `pdspark up` checks before it starts anything, at no cost.
"""

from __future__ import annotations

import importlib.util

from pdspark.errors import MissingExtraError

# The top-level modules of the `engine` extra (pyproject.toml) that the model code imports. The Mooncake transfer
# engine is in the extra too, but imported only by its backend, which names its own wheel when it is missing.
ENGINE_MODULES = ("torch", "numpy", "safetensors")
INSTALL = "pip install 'pdspark[engine]'"


def missing_engine_modules() -> list[str]:
    missing = []
    for name in ENGINE_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent that fails to import; a module whose spec is unset
            found = False
        if not found:
            missing.append(name)
    return missing


def require_engine(what: str) -> None:
    """Raises MissingExtraError naming `what` (e.g. "`pdspark serve prefill`") if an engine module is missing."""
    missing = missing_engine_modules()
    if missing:
        raise MissingExtraError(
            f"{what} loads the model and needs the `engine` extra ({', '.join(missing)} not installed): {INSTALL} "
            "(install a CPU or CUDA build of torch first; the core package serves only the router and the SDK)")
