"""Models shipped inside the package, and `resolve_model` which finds them by name."""

from __future__ import annotations

import importlib.resources

SHIPPED_MODELS = ("dsv4-tiny",)


def resolve_model(model: str) -> str:
    """A checkpoint directory for `model`: a path, or the name of a model shipped inside the package."""
    if model in SHIPPED_MODELS:
        return str(importlib.resources.files("pdspark") / "assets" / model)
    return model
