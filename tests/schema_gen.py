"""Random JSON schemas for structured-output tests: objects (nested), arrays, enums, bounded
numbers, strings with maxLength, nullable types, anyOf. Every string and array is bounded, so a
random walk through the grammar ends in a few dozen tokens."""

from __future__ import annotations

import random
from typing import Any

NAMES = ["id", "name", "kind", "items", "score", "ok", "tags", "child", "note", "x"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "nullable", "any_of"]
    if depth < 3:
        kinds += ["array", "object", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(0, 8)}
        if rng.random() < 0.3:
            schema["minLength"] = rng.randint(0, schema["maxLength"])
        if rng.random() < 0.15:
            schema = {"type": "string", "pattern": "^[a-z]{1,4}[0-9]?$"}
        return schema
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        low = round(rng.uniform(-100, 100), 2)
        schema = {"type": "number", "minimum": low, "maximum": low + rng.uniform(0.5, 500)}
        if rng.random() < 0.3:
            schema["exclusiveMinimum"] = schema.pop("minimum")
        return schema
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        pool: list[Any] = ["red", "green", "blue", "a b", 'q"uote', 7, -3, True, None]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "nullable":
        return {"type": ["string", "null"], "maxLength": rng.randint(1, 6)}
    if kind == "any_of":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    if kind == "array":
        schema = {"type": "array", "items": random_schema(rng, depth + 1)}
        schema["maxItems"] = rng.randint(0, 3)
        if rng.random() < 0.3:
            schema["minItems"] = rng.randint(0, schema["maxItems"])
        return schema
    return random_object(rng, depth)


def random_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(NAMES, rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {name: random_schema(rng, depth + 1) for name in names},
        "required": [n for n in names if rng.random() < 0.7],
        "additionalProperties": False,
    }


def random_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` schemas, most of them objects (what structured outputs ask for)."""
    rng = random.Random(seed)
    return [random_object(rng) if i % 4 else random_schema(rng) for i in range(count)]
