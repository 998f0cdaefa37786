"""The OpenAPI document of the API, built from the contract's endpoint table, models and error registry.

``python -m vmsidecar_runtime.api.openapi > docs/api/openapi.json`` regenerates the committed
copy; a test fails when the two differ or when a live response does not match its schema.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pydantic import BaseModel

from vmsidecar_contract.endpoints import (
    ENDPOINTS,
    GENERATION_HEADER,
    MAX_JSON_BODY,
    MEDIA_TYPES,
    Endpoint,
    Media,
    model,
)
from vmsidecar_contract.errors import describe, registry
from vmsidecar_contract.events import EVENTS

#: what each error status means, whatever the operation (the codes it sends follow)
_STATUS = {400: "Malformed request (body, query parameter), invalid spec or reference", 404: "Not found",
           409: "The phase, the generation or the disk transfer under way does not allow it",
           413: f"JSON body larger than {MAX_JSON_BODY} bytes",
           415: "Body without the Content-Type this operation takes",
           422: "Image cannot be used", 500: "Host or guest failure", 502: "Registry failure",
           503: "Not ready",
           504: "A pull or upload flash past the runtime's deadline, serve --pull-timeout"}
_BINARY = {"type": "string", "format": "binary"}
#: answers of any path, not tied to one operation
_RESPONSES = {
    "MethodNotAllowed": {
        "description": "405 (code method_not_allowed) for a method a path does not have; the Allow header lists "
                       "the methods it has.",
        "headers": {"Allow": {"schema": {"type": "string"}, "description": "comma-separated methods, e.g. GET, PUT"}},
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}},
    "NotFound": {"description": "404 (code not_found) for a path the API does not have.",
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}},
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _content(media: Media, name: str | None) -> dict[str, Any]:
    return {MEDIA_TYPES[media]: {"schema": _ref(name) if name else _BINARY}}


def _request_body(row: Endpoint) -> dict[str, Any]:
    body = row.body
    assert body is not None
    if body.media == "binary":
        return {"required": body.required, "description": "Content-Type application/octet-stream, or none",
                "content": _content("binary", None)}
    schema = {"allOf": [_ref(str(body.model))], **body.schema_extra} if body.schema_extra else _ref(str(body.model))
    return {"required": body.required, "description": f"application/json (UTF-8), at most {MAX_JSON_BODY} bytes",
            "content": {"application/json": {"schema": schema}}}


def _parameters(row: Endpoint) -> list[dict[str, Any]]:
    names = ", ".join(t for t in EVENTS if t != "hello")  # hello comes first whatever the filter
    params: list[dict[str, Any]] = []
    if row.lease_bound:
        params.append({"name": GENERATION_HEADER, "in": "header", "required": False,
                       "schema": {"type": "string", "pattern": "^[0-9]{1,19}$"},
                       "description": "the generation the caller's lease claimed: 409 generation_changed "
                                      "when the VM is at another (the lease ended); without it the call is "
                                      "not bound"})
    for q in row.query:
        param: dict[str, Any] = {"name": q.name, "in": "query", "schema": dict(q.schema)}
        if q.description:
            param["description"] = q.description.format(types=names)
        params.append(param)
    return params


def _operation(row: Endpoint) -> dict[str, Any]:
    """One operation. Every one may answer 400 for a query parameter it does not have (or one given twice)."""
    responses: dict[str, Any] = {str(a.status): {"description": a.description, "content": _content(a.media, a.model)}
                                 for a in row.answers}
    for status, codes in row.error_statuses().items():
        responses[str(status)] = {"description": f"{_STATUS[status]} ({', '.join(dict.fromkeys(codes))})",
                                  "content": _content("json", "ErrorBody")}
    op: dict[str, Any] = {"summary": row.summary}
    if params := _parameters(row):
        op["parameters"] = params
    if row.body:
        op["requestBody"] = _request_body(row)
    op["responses"] = responses
    return op


def paths() -> dict[str, dict[str, dict[str, Any]]]:
    """path -> method -> operation, from the endpoint table."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for row in ENDPOINTS:
        found.setdefault(row.path, {})[row.method.lower()] = _operation(row)
    return found


def _models() -> list[type[BaseModel]]:
    """Every model a row names, the error body, and the data of every event type."""
    names = [row.request for row in ENDPOINTS] + [a.model for row in ENDPOINTS for a in row.answers]
    found: list[type[BaseModel]] = [model(n) for n in dict.fromkeys(["ErrorBody", *names]) if n]
    return found + [m for m in dict.fromkeys(EVENTS.values()) if m not in found]


def _schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for m in _models():
        schema = m.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=False)
        schemas.update(schema.pop("$defs", {}))
        schemas[m.__name__] = schema
    codes = registry()
    schemas["ErrorBody"]["properties"]["error"] = {
        "title": "Error", "type": "string", "enum": sorted(codes),
        "description": "Stable error code; the message says the cause and the fix. "
                       + "; ".join(f"`{c}`: {describe(c)}" for c in sorted(codes)),
    }
    # each line is one of the typed events: its type names the schema of its data
    schemas["Event"]["oneOf"] = [{"title": name, "properties": {"type": {"const": name}, "data": _ref(data.__name__)}}
                                 for name, data in EVENTS.items()]
    return schemas


def build_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "vmsidecar runtime API",
            "version": "1",
            "description": "REST/JSON over the Unix socket api.sock in the shared directory. Errors are "
                           '{"error": code, "message": sentence naming the cause and the fix}. Requests are '
                           "held to this document: a JSON body needs Content-Type: application/json (else 415) "
                           f"and at most {MAX_JSON_BODY} bytes (else 413); booleans are JSON true/false (query: "
                           "true/false); a query parameter an operation does not list, or one given twice, is a "
                           "400; a method a path does not have is a 405 with an Allow header "
                           "(components/responses/MethodNotAllowed), a path the API does not have a 404.",
        },
        "servers": [{"url": "http://localhost", "description": "over the Unix socket (curl --unix-socket)"}],
        "paths": paths(),
        "components": {"schemas": _schemas(), "responses": _RESPONSES},
    }


def main() -> None:
    """Print the document as JSON."""
    json.dump(build_document(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
