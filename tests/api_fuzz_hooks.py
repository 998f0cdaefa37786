"""Schemathesis hooks for tests/test_api_fuzz.py (loaded by the ``schemathesis`` CLI through its
config file, in its own process).

Two kinds: calls that are valid and legitimately long are made short (never removed), and the
NDJSON streams the document declares are checked line by line (schemathesis validates JSON
bodies only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import schemathesis

DOC = json.loads((Path(__file__).parents[1] / "docs" / "api" / "openapi.json").read_text())
#: longest wait a fuzzed call may ask for: a graceful power-off or an event stream ends by then
SHORT_S = 2.0


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _shorten(value: Any, maximum: float) -> bool:
    """Whether ``value`` is a valid wait longer than SHORT_S (invalid ones stay: they must be refused)."""
    seconds = _number(value)
    return seconds is not None and SHORT_S < seconds <= maximum


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    """Valid but long waits become short ones: an event stream without ``timeout`` would stream until
    the client leaves, and a graceful power-off may wait up to an hour for a guest that ignores ACPI."""
    path, method = case.operation.path, case.method.upper()
    if path == "/v1/events" and method == "GET":
        query = case.query if isinstance(case.query, dict) else None
        if query is not None and ("timeout" not in query or _shorten(query["timeout"], 3600)):
            query["timeout"] = SHORT_S / 4
    elif (path == "/v1/vm/power" and method == "POST" and isinstance(case.body, dict)
          and _shorten(case.body.get("timeout"), 3600)):
        case.body["timeout"] = SHORT_S


def _line_schema(path: str, method: str, status: int) -> dict[str, Any] | None:
    op = DOC["paths"].get(path, {}).get(method.lower(), {})
    content = op.get("responses", {}).get(str(status), {}).get("content", {})
    schema = content.get("application/x-ndjson", {}).get("schema")
    return None if schema is None else {"components": DOC["components"], **schema}


@schemathesis.check
def ndjson_lines_conform(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                         case: schemathesis.Case) -> bool | None:
    """Every line of an application/x-ndjson answer is JSON and matches the documented schema."""
    if not response.headers.get("content-type", [""])[0].startswith("application/x-ndjson"):
        return None
    schema = _line_schema(case.operation.path, case.method, response.status_code)
    if schema is None:
        raise AssertionError(f"{case.method} {case.operation.path} answered NDJSON with {response.status_code}, "
                             "which the document does not declare as NDJSON")
    lines = [line for line in response.content.split(b"\n") if line.strip()]
    if not lines:
        raise AssertionError("the NDJSON stream has no line")
    for number, line in enumerate(lines, 1):
        try:
            jsonschema.validate(json.loads(line), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"NDJSON line {number} does not match the document: {e}") from None
    return None
