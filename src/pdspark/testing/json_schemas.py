"""`varied_schemas`: JSON schemas of the shapes clients constrain outputs with (nested objects, arrays, enums,
bounded numbers, required and optional fields), made from a seed: what the structured-output tests and the bench run.

Every value is bounded (strings by `maxLength`, arrays by `maxItems`, integers and numbers by a range), so a small
model under the grammar finishes the object within a few hundred tokens."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south", "open", "closed", "small"]


def varied_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_object(rng, depth=0, index=i) for i in range(count)]


def _object(rng: random.Random, depth: int, index: int = 0) -> dict[str, Any]:
    n = rng.randint(1, 4 if depth == 0 else 2)
    names = rng.sample(["id", "name", "kind", "count", "score", "tags", "flag", "meta", "items", "level"], n)
    props = {name: _value(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False,
            **({"title": f"Schema{index}"} if depth == 0 else {})}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "enum", "integer", "number", "boolean", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = rng.choice([{"enum": rng.sample(WORDS, 3)}, {"type": "integer", "minimum": 0, "maximum": 9},
                           {"type": "boolean"}])
        return {"type": "array", "items": item, "maxItems": rng.randint(1, 4)}
    return _object(rng, depth + 1)
