"""Cheap checks a guided spec must pass before it may be compiled, and its cache key.

Runs on the engine loop, so it only parses and walks the spec (linear in its size, which is
capped first); the expensive work (meta-schema check, rewrite, xgrammar compile) runs on the
grammar pool's threads. What is bounded, and why:

    size            JSON / regex / grammar text, in UTF-8 bytes (caps every walk below)
    depth           nesting of the JSON document (json.loads and the walks recurse)
    length bounds   minLength / maxLength and regex {m,n} counts: each unrolls into that many
                    automaton states, and compile time grows faster than linearly in them
    count bounds    min/maxItems, min/maxProperties, min/maxContains

Errors are ValueError("<param>: ...") so the HTTP edge answers 400 with `param` set.
"""

from __future__ import annotations

import json
import re
from typing import Any

from hearth.config import GuidedConfig
from hearth.engine.refusals import RequestRejected
from hearth.engine.sampling_params import GuidedSpec

LENGTH_KEYS = ("minLength", "maxLength")
COUNT_KEYS = ("minItems", "maxItems", "minProperties", "maxProperties", "minContains",
              "maxContains")
DATA_KEYS = {"enum", "const", "default", "examples"}  # values, not schemas: not walked
REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")  # {m} {m,} {m,n} in a regex or EBNF grammar
MAX_DIGITS = 12  # longer numbers are over any limit (and int() of thousands of digits raises)


def param_of(kind: str) -> str:
    """The request field a spec of `kind` came from (for error messages)."""
    return "tools" if kind == "structural_tag" else "response_format"


def spec_key(spec: GuidedSpec, config: GuidedConfig) -> tuple[str, str]:
    """Check `spec` against the limits; return its cache key (kind, canonical text).

    The canonical text of JSON specs drops whitespace but keeps key order (xgrammar emits
    properties in schema order, so reordered schemas are different grammars).
    """
    param = param_of(spec.kind)
    size = len(spec.value.encode("utf-8", "surrogatepass"))
    if size > config.max_spec_bytes:
        raise RequestRejected(param, f"{param}: the {spec.kind} is {size} bytes, over the limit of "
                              f"{config.max_spec_bytes}")
    if spec.kind in ("json_schema", "structural_tag"):
        document = _parse(spec.value, spec.kind, param)
        _check_document(document, config, param)
        return spec.kind, json.dumps(document, separators=(",", ":"), ensure_ascii=False)
    if spec.kind in ("regex", "grammar"):
        _check_repeats([spec.value], config, param, spec.kind)
    return spec.kind, spec.value


def _parse(text: str, kind: str, param: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise RequestRejected(param, f"{param}: the {kind} is nested too deeply") from None
    except (json.JSONDecodeError, TypeError) as exc:
        raise RequestRejected(param, f"{param}: invalid {kind}: not valid JSON: {exc}") from None


def _check_document(document: Any, config: GuidedConfig, param: str) -> None:
    """Depth, numeric bounds and regex repeats of every schema in the document (iterative)."""
    patterns: list[str] = []
    total = 0
    stack = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > config.max_schema_depth:
            raise RequestRejected(param, f"{param}: the schema is nested deeper than "
                                  f"{config.max_schema_depth} levels")
        if isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)
            continue
        if not isinstance(node, dict):
            continue
        for key in LENGTH_KEYS:
            total += _bound(node.get(key), key, config.max_length_bound, param)
        for key in COUNT_KEYS:
            _bound(node.get(key), key, config.max_count_bound, param)
        if isinstance(node.get("pattern"), str):
            patterns.append(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            patterns.extend(node["patternProperties"])
        stack.extend((value, depth + 1) for key, value in node.items() if key not in DATA_KEYS)
    total += _check_repeats(patterns, config, param, "pattern")
    _check_total(total, config, param)


def _bound(value: Any, key: str, limit: int, param: str) -> int:
    """A numeric keyword's value if within `limit` (0 if absent or not a number: the
    meta-schema check rejects non-numbers later)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    if not value <= limit:  # NaN too
        raise RequestRejected(param, f"{param}: {key} {value} is over the limit of {limit}")
    return max(0, int(value))


def _check_repeats(texts: list[str], config: GuidedConfig, param: str, what: str) -> int:
    total = 0
    for text in texts:
        for match in REPEAT.finditer(text):
            for digits in match.groups():
                if not digits:
                    continue
                if len(digits) > MAX_DIGITS or int(digits) > config.max_length_bound:
                    raise RequestRejected(param, f"{param}: {what} repetition "
                                          f"{match.group(0)[:40]} is over the limit of "
                                          f"{config.max_length_bound}")
            total += int(match.group(2) or match.group(1))
    _check_total(total, config, param)
    return total


def _check_total(total: int, config: GuidedConfig, param: str) -> None:
    if total > config.max_total_length_bound:
        raise RequestRejected(param, f"{param}: string lengths and repetition counts add up to "
                              f"{total}, over the limit of {config.max_total_length_bound}")
