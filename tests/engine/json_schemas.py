"""Fifty JSON schemas of the kinds structured-output requests carry (objects of strings, integers, enums, booleans,
nulls, nested objects, arrays, unions, patterns, consts), and a valid instance of each.

Every value is bounded (strings by ``maxLength`` or a pattern, integers by a range, arrays by ``maxItems``, objects
closed by ``additionalProperties: false``): a random-weight model under the grammar then always reaches the end
of the value — an unbounded string or number is valid JSON for as long as the model goes on writing it.
"""

from __future__ import annotations

FIELDS = [
    ("name", {"type": "string", "maxLength": 12}),
    ("age", {"type": "integer", "minimum": 0, "maximum": 120}),
    ("active", {"type": "boolean"}),
    ("colour", {"enum": ["red", "green", "blue"]}),
    ("note", {"type": ["string", "null"], "maxLength": 8}),
    ("tags", {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}),
    ("point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                "y": {"type": "integer", "minimum": -9, "maximum": 9}},
               "required": ["x", "y"], "additionalProperties": False}),
    ("code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    ("kind", {"const": "event"}),
    ("score", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"enum": ["n/a"]}]}),
    ("level", {"type": "integer", "enum": [1, 2, 3]}),
    ("ids", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1,
             "maxItems": 4}),
    ("owner", {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                "role": {"enum": ["admin", "user"]}},
               "required": ["id"], "additionalProperties": False}),
    ("flag", {"type": "null"}),
    ("city", {"type": "string", "minLength": 1, "maxLength": 10}),
]


def schema(i: int) -> dict:
    """The i-th schema (0..49): 1-5 fields picked from ``FIELDS``, some optional, closed."""
    n = 1 + i % 5
    picks = [FIELDS[(i * 7 + k * 3) % len(FIELDS)] for k in range(n)]
    props = dict(picks)
    required = [name for k, (name, _) in enumerate(picks) if (i + k) % 4 != 3] or [picks[0][0]]
    out = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if i % 10 == 9:  # an array of such objects at the top
        return {"type": "array", "items": out, "minItems": 1, "maxItems": 2}
    return out


SCHEMAS = [schema(i) for i in range(50)]


def instance(s: dict):
    """A valid value of ``s`` (the first choice of each union and enum, the shortest string the pattern takes)."""
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return s["enum"][0]
    if "anyOf" in s:
        return instance(s["anyOf"][0])
    t = s.get("type")
    t = t[0] if isinstance(t, list) else t
    if t == "object":
        return {k: instance(v) for k, v in s["properties"].items()}
    if t == "array":
        return [instance(s["items"]) for _ in range(max(1, s.get("minItems", 1)))]
    if t == "string":
        return "ABC-12" if "pattern" in s else "abc"[:s.get("maxLength", 3)]
    if t == "integer":
        return s.get("minimum", 0)
    if t == "boolean":
        return True
    return None
