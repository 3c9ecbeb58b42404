"""The constraint fields other servers take on their OpenAI routes, honoured here (issue 65):
ignoring them would change what the answer means (docs/api.md, "Structured output").

vLLM's `guided_json` (a JSON Schema), `guided_regex`, `guided_choice` (one of the strings) and
`guided_grammar`, and llama.cpp's `json_schema` and `grammar` (GBNF; a Lark grammar is taken as
well, as llguidance reads both). One constraint a request: `response_format` or one of these.
"""

from __future__ import annotations

import json
import re
from typing import Any

from backends.chat.plan import GrammarSpec

# The request schema's properties, for the OpenAI routes' schemas.
FIELDS: dict[str, Any] = {
    "guided_json": {"type": ["object", "boolean", "string"], "description": "vLLM's: a JSON Schema the output follows"},
    "guided_regex": {"type": "string", "description": "vLLM's: a regex the output matches"},
    "guided_choice": {
        "type": "array",
        "items": {"type": "string"},
        "minItems": 1,
        "description": "vLLM's: the output is one of these strings",
    },
    "guided_grammar": {"type": "string", "description": "vLLM's: a grammar (GBNF or Lark) the output follows"},
    "json_schema": {"type": ["object", "boolean"], "description": "llama.cpp's: a JSON Schema the output follows"},
    "grammar": {"type": "string", "description": "llama.cpp's: a GBNF (or Lark) grammar the output follows"},
}


class Refused(ValueError):
    """A constraint field that cannot be used; `field` names it."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def constraint(params: dict, taken: str | None) -> tuple[GrammarSpec | None, str | None]:
    """The grammar these fields ask for, and the field; (None, None) where none is given.
    `taken`: the field of a constraint the request has already (response_format), if any."""
    given = [name for name in FIELDS if params.get(name) is not None]
    if not given:
        return None, None
    if taken or len(given) > 1:
        first = taken or given[0]
        raise Refused(f"give one constraint: {first} or {given[-1]}, not both", given[-1])
    name = given[0]
    value = params[name]
    if name in ("guided_json", "json_schema"):
        if isinstance(value, str):  # vLLM takes the schema as a JSON string too
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise Refused(f"{name} is not valid JSON: {exc}", name) from None
        return GrammarSpec("json_schema", json.dumps(value)), name
    if name == "guided_regex":
        return GrammarSpec("regex", value), name
    if name == "guided_choice":
        return GrammarSpec("regex", "|".join(f"(?:{re.escape(choice)})" for choice in value)), name
    return GrammarSpec("lark", value), name  # GBNF or Lark: read where it compiles, off the event loop
