"""Request bodies checked against their JSON Schemas: `check` interprets the subset of JSON
Schema the request schemas use, rather than jsonschema (which the tests use to hold the published
schemas to it, tests/test_wire.py and test_openapi.py): its errors name the field as the APIs'
error bodies do, it makes integral floats integers where an integer is asked for, and a list of
500,000 token ids is checked at once (`_plain_ints`), not item by item. `closed` schemas refuse
a field they do not name; `tolerant` ones (the OpenAI and Anthropic routes) ignore it, and the
request log names it (`ignored_paths`)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from backends.wire.errors import ApiError


def closed(schema: dict) -> dict:
    """`schema` as `check` enforces it, said in the schema itself: an object with properties
    takes no field beyond them, at every depth (so /openapi.json publishes the same contract).
    Marks `schema` in place and returns it."""
    if "properties" in schema:
        schema.setdefault("additionalProperties", False)
        for value in schema["properties"].values():
            closed(value)
    if isinstance(schema.get("items"), dict):
        closed(schema["items"])
    for option in schema.get("anyOf", ()):
        closed(option)
    return schema


def tolerant(schema: dict) -> dict:
    """`schema` for a route whose clients add fields every month (OpenAI's and Anthropic's): a
    field beyond an object's properties is ignored (and logged, `parse`), not refused, as vLLM,
    llama.cpp and Ollama do. Nothing is marked: JSON Schema takes extra fields by default."""
    return schema


class Invalid(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "integer":  # 16.0 is an integer, as JSON Schema counts (clients that write floats send it)
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}[kind])


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)  # True is not 1 here


def check(value: Any, schema: dict, field: str, ignored: list[str] | None = None) -> Any:
    """Validate against the small JSON Schema subset the request schemas use; returns the value
    with integral floats made integers where an integer is asked for. A field beyond an object's
    properties is refused where the object says `additionalProperties: false` (`closed`), else
    left out of the value and its path added to `ignored`."""
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            mine: list[str] = []  # an option that fails ignores nothing
            try:
                value = check(value, option, field, mine)
            except Invalid as exc:
                errors.append(exc)
            else:
                if ignored is not None:
                    ignored += mine
                return value
        fitting = [
            e
            for e, option in zip(errors, schema["anyOf"], strict=False)
            if "type" in option and _type_ok(value, option["type"])
        ]
        if len(fitting) == 1 and "x-error" not in schema:  # the value is of that option's kind: its error says most
            raise fitting[0]
        messages = [str(e) for e in errors]
        raise Invalid(field, schema.get("x-error", " or ".join(messages) if len(messages) < 3 else messages[0]))
    if "enum" in schema and not any(_same(value, allowed) for allowed in schema["enum"]):
        if schema.get("x-unsupported"):
            supported = [json.dumps(v) for v in schema["enum"] if v is not None]
            only = f" (only {', '.join(supported)})" if supported else ""
            raise Invalid(field, f"{field} is not supported by this server{only}")
        raise Invalid(field, f"{field} must be one of {', '.join(json.dumps(v) for v in schema['enum'])}")
    kinds = schema.get("type", [])
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if kinds and not any(_type_ok(value, kind) for kind in kinds):
        finite = " (finite)" if "number" in kinds else ""
        raise Invalid(field, f"{field} must be {' or '.join(kinds)}{finite}")
    if value is None:
        return value
    if isinstance(value, float) and "integer" in kinds and "number" not in kinds:
        value = int(value)
    if "minimum" in schema and value < schema["minimum"]:
        raise Invalid(field, f"{field} must be >= {schema['minimum']}")
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        raise Invalid(field, f"{field} must be > {schema['exclusiveMinimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        raise Invalid(field, f"{field} must be <= {schema['maximum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            raise Invalid(field, f"{field} must not be empty")
        if len(value) > schema.get("maxLength", math.inf):
            raise Invalid(field, f"{field} must be at most {schema['maxLength']} characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise Invalid(field, f"{field} is not valid Unicode (a lone surrogate)") from None
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise Invalid(field, f"{field} must hold at least {schema['minItems']} item(s)")
        if len(value) > schema.get("maxItems", math.inf):
            raise Invalid(field, f"{field} may hold at most {schema['maxItems']} items")
        if "items" not in schema:  # an enum's list, checked whole above
            return value
        if _plain_ints(value, schema["items"]):  # token ids: 500,000 of them are checked at once
            return value
        return [check(item, schema["items"], f"{field}[{i}]", ignored) for i, item in enumerate(value)]
    if isinstance(value, dict) and "properties" in schema:

        def path(name: str) -> str:
            return name if field == "body" else f"{field}.{name}"

        first = schema.get("x-check-first")  # the field that says what the object is (a content part's type)
        if first in value:
            check(value[first], schema["properties"][first], path(first), ignored)
        for name in schema.get("required", []):
            if name not in value:
                raise Invalid(path(name), f"{path(name)} is required")
        properties = schema["properties"]
        unknown = [name for name in value if name not in properties]
        if unknown and schema.get("additionalProperties") is False:
            raise Invalid(path(unknown[0]), f"unknown field {path(unknown[0])!r}")
        if unknown and ignored is not None:
            ignored += (path(name) for name in unknown)
        known = (name for name in value if name in properties)
        return {name: check(value[name], properties[name], path(name), ignored) for name in known}
    if isinstance(value, dict) and "additionalProperties" in schema:  # a map, such as logit_bias
        pattern = re.compile(schema["propertyNames"]["pattern"])
        if len(value) > schema.get("maxProperties", math.inf):
            raise Invalid(field, f"{field} may hold at most {schema['maxProperties']} entries")
        for name in value:
            if not pattern.fullmatch(name):
                raise Invalid(field, f"{field} keys must be token ids, not {name!r}")
        item = schema["additionalProperties"]
        return {name: check(value[name], item, f"{field}.{name}", ignored) for name in value}
    return value


def _plain_ints(value: list, items: dict) -> bool:
    """Whether every item is an int (not a bool) that `items` (an integer schema with bounds at
    most) accepts as it is: then nothing needs checking one by one."""
    if set(items) - {"type", "minimum", "maximum", "description"} or items.get("type") != "integer" or not value:
        return False
    if not all(type(item) is int for item in value):
        return False
    return min(value) >= items.get("minimum", -math.inf) and max(value) <= items.get("maximum", math.inf)


def with_defaults(body: dict, schema: dict) -> dict:
    return {name: body.get(name, prop.get("default")) for name, prop in schema["properties"].items()}


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


MAX_JSON_DEPTH = 256  # nesting levels of a request body (a JSON Schema 200 levels deep still fits)


def json_of(raw: bytes) -> Any:
    deep = ApiError(400, f"request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of objects and arrays")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than the parser goes: past MAX_JSON_DEPTH anyway
        raise deep from None
    if too_deep(body):
        raise deep
    return body


def too_deep(value: Any) -> bool:
    """Whether objects and arrays nest past MAX_JSON_DEPTH (iteratively: the check must not
    recurse itself)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (dict, list)):
                if depth >= MAX_JSON_DEPTH:
                    return True
                stack.append((child, depth + 1))
    return False


def without_nulls(value: Any) -> Any:
    """Objects without their null members, at any depth: OpenAI's clients send null for an
    optional field they leave unset (and in messages OpenAI itself returned)."""
    if isinstance(value, dict):
        return {name: without_nulls(item) for name, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def parse(body: Any, schema: dict, ignored: list[str] | None = None) -> dict:
    """The validated parameters with defaults filled in, or a 422 naming the field. The paths of
    the fields a `tolerant` schema ignored are added to `ignored`."""
    try:
        body = check(body, schema, "body", ignored)
    except Invalid as exc:
        raise ApiError(422, str(exc), field=exc.field) from None
    return with_defaults(body, schema)


MAX_IGNORED = 32  # field paths in a request's log line; a path's client-given names are cut short too


def ignored_paths(paths: list[str]) -> list[str]:
    """The fields a request's body carried that were ignored, once each (`messages[3].x` and
    `messages[4].x` are `messages[].x`), as the request log line records them."""
    names = dict.fromkeys(re.sub(r"\[\d+\]", "[]", path)[:128] for path in paths)
    return list(names)[:MAX_IGNORED]
