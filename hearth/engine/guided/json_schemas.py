"""JSON-schema helpers shared by the engine's grammar compiler and the HTTP server's tool-call
grammars. Pure (json + jsonschema): the HTTP process imports this without torch or xgrammar,
which would add ~1.7 s to a worker's cold start.
"""

from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

# A tiny model left free to pick JSON whitespace can emit it forever. Plain JSON output uses the
# canonical separators (", " and ": ", what models are trained on); user structural tags cap
# runs of whitespace instead, and tool-call arguments are compact (guided._fixed_separators).
MAX_JSON_WHITESPACE = 2


def parse_json_schema(text: str) -> dict | bool:
    """Parse and check a JSON schema (draft 2020-12 meta-schema); ValueError if it is not one."""
    try:
        schema = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise ValueError("json_schema must be a JSON object")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ValueError(f"invalid json_schema: {exc.message}") from exc
    return schema


def bounded_strings_as_patterns(node: Any) -> Any:
    """Rewrite length-bounded strings as an equivalent pattern (a copy; the input is untouched).

    xgrammar (0.2.x) compiles `{"type": "string", "maxLength": n}` to a character class that
    admits raw control characters, which no JSON parser accepts; its pattern path escapes them
    correctly. The rewrite only forbids control characters in such strings.
    """
    if isinstance(node, list):
        return [bounded_strings_as_patterns(value) for value in node]
    if not isinstance(node, dict):
        return node
    node = {key: bounded_strings_as_patterns(value) for key, value in node.items()}
    bounded = "minLength" in node or "maxLength" in node
    if node.get("type") == "string" and bounded and not node.keys() & {"pattern", "format", "enum", "const"}:
        low, high = int(node.pop("minLength", 0)), node.pop("maxLength", None)
        node["pattern"] = "^[^\\x00-\\x1f]{%d,%s}$" % (low, "" if high is None else int(high))
    return node
