"""The OpenAPI document of the API, built from the same models and route table the server uses.

``python -m vmsidecar_runtime.api.openapi > docs/api/openapi.json`` regenerates the committed
copy; a test fails when the two differ or when a live response does not match its schema.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pydantic import BaseModel

from vmsidecar_contract.errors import describe, registry
from vmsidecar_contract.models import (
    Accepted,
    ErrorBody,
    Health,
    PowerRequest,
    ProgressLine,
    PullRequest,
    RecycleRequest,
)
from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import VmState

from ..events import Event
from .server import MAX_EVENTS_TIMEOUT, MAX_JSON_BODY

_MODELS: list[type[BaseModel]] = [
    VmSpec, VmState, PowerRequest, RecycleRequest, PullRequest, ErrorBody, Health, Accepted, ProgressLine, Event,
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*codes: int) -> dict[str, Any]:
    names = {400: "Malformed request (body, query parameter) or invalid spec", 404: "Not found",
             409: "Wrong phase for this operation, or another disk transfer is under way (transfer_in_progress)",
             413: f"JSON body larger than {MAX_JSON_BODY} bytes",
             415: "Body without the Content-Type this operation takes (code http_error)",
             422: "Image cannot be used", 500: "Host or guest failure", 502: "Registry failure",
             503: "Not ready",
             504: "A pull or upload flash past the runtime's deadline (pull_timeout; serve --pull-timeout)"}
    return {str(c): {"description": names[c], "content": _json(ErrorBody)} for c in codes}


def _json_body(model: type[BaseModel], *, required: bool = True, **extra: Any) -> dict[str, Any]:
    """A JSON request body: Content-Type application/json (else 415), at most MAX_JSON_BODY bytes (else 413)."""
    schema = {"allOf": [_ref(model)], **extra} if extra else _ref(model)
    return {"required": required, "description": f"application/json (UTF-8), at most {MAX_JSON_BODY} bytes",
            "content": {"application/json": {"schema": schema}}}


_STATE_OK = {"200": {"description": "The VM state after the operation", "content": _json(VmState)}}
_BOOL_QUERY = {"type": "boolean", "default": False}
#: a JSON body: 400 when malformed, 413 when too large, 415 when not declared as JSON
_BODY_ERRORS = (400, 413, 415)

#: path -> method -> operation (summary names the phases each operation accepts). Every operation
#: may answer 400 for a query parameter it does not have (or one given twice).
PATHS: dict[str, dict[str, dict[str, Any]]] = {
    "/v1/vm": {"get": {"summary": "State: phase, image digest, accel, generation, timings, last error. Any phase.",
                       "responses": {**_STATE_OK, **_errors(400)}}},
    "/v1/vm/spec": {
        "get": {"summary": "The current spec. Any phase.",
                "responses": {"200": {"description": "spec", "content": _json(VmSpec)}, **_errors(400, 404)}},
        "put": {"summary": "Replace the spec (idempotent) with the whole spec, at least one field (an empty spec "
                           "is a 400). Stopped|Crashed|Error, or any phase when unchanged. Host paths (file:, "
                           "oci-layout:, kernel, initrd) only under the runtime's --allow-host-paths, extra_args "
                           "only with --allow-extra-args (else 400).",
                "requestBody": _json_body(VmSpec, minProperties=1),
                "responses": {**_STATE_OK, **_errors(*_BODY_ERRORS, 409)}},
    },
    "/v1/vm/power": {"post": {
        "summary": "on (Stopped|Crashed|Error; idempotent when on), off (any), reset (Starting|Running|Ready), cycle (any).",
        "requestBody": _json_body(PowerRequest),
        "responses": {**_STATE_OK, **_errors(*_BODY_ERRORS, 409, 422, 500, 502, 504)}}},
    "/v1/vm/recycle": {"post": {
        "summary": "Back to pristine (overlay, flashed disk, scrollback discarded; generation bumped), then boot. "
                   "Cancels the disk transfer under way (it belonged to the lease that ended). Any phase.",
        "requestBody": _json_body(RecycleRequest, required=False),
        "responses": {**_STATE_OK, **_errors(*_BODY_ERRORS, 409, 500)}}},
    "/v1/vm/lease": {"post": {
        "summary": "Claim the VM for a new lease (the exporter does when it hands the lease out): when an earlier "
                   "lease used this generation it is recycled first (the answer then comes after the fresh boot "
                   "has started); the disk transfer under way is cancelled; no memory snapshot is captured from "
                   "then on (one under way finishes first). Any phase.",
        "responses": {**_STATE_OK, **_errors(400, 500)}}},
    "/v1/vm/disk": {
        "put": {"summary": "Flash: the body is the image (qcow2/raw, optionally zstd/gzip/xz), streamed (no size limit "
                           "but the image limits). Stopped|Crashed|Error, or any phase with power_off=true.",
                "parameters": [
                    {"name": "power_off", "in": "query", "schema": _BOOL_QUERY},
                    {"name": "digest", "in": "query", "schema": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"}},
                ],
                "requestBody": {"required": True, "description": "Content-Type application/octet-stream, or none",
                                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                "responses": {**_STATE_OK, **_errors(400, 409, 415, 422, 500, 504)}},
        "get": {"summary": "Dump the disk (base + changes) as one image. Stopped|Crashed|Error.",
                "parameters": [{"name": "format", "in": "query",
                                "schema": {"type": "string", "enum": ["qcow2", "raw"], "default": "qcow2"}}],
                "responses": {"200": {"description": "image",
                                      "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                          "format": "binary"}}}},
                              **_errors(400, 409, 500)}},
    },
    "/v1/vm/disk/pull": {"post": {
        "summary": "Flash from a reference; answers an NDJSON stream of ProgressLine (progress…, then result or error). "
                   "Stopped|Crashed|Error, or any phase with power_off. One disk transfer at a time (409 "
                   "transfer_in_progress); cancelled (error line transfer_cancelled, nothing installed) by a "
                   "recycle, the next claim or the client going away; bounded by serve --pull-timeout "
                   "(error line pull_timeout).",
        "requestBody": _json_body(PullRequest),
        "responses": {"200": {"description": "progress stream",
                              "content": {"application/x-ndjson": {"schema": _ref(ProgressLine)}}},
                      **_errors(*_BODY_ERRORS, 409)}}},
    "/v1/events": {"get": {
        "summary": "Event stream (NDJSON of Event; a hello event first) until the client disconnects, or until "
                   "timeout seconds have passed. Any phase.",
        "parameters": [{"name": "types", "in": "query", "schema": {"type": "string"},
                        "description": "comma-separated event types, exact names (phase, spec, pulled, flashed, "
                                       "transfer_cancelled, claimed, recycled, boot, powerdown_timeout, "
                                       "guest.powered_off, guest.reset, guest.paused, guest.resumed, guest.panicked, "
                                       "guest.powerdown_requested, guest.io_error, backend.exited)"},
                       {"name": "timeout", "in": "query",
                        "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_EVENTS_TIMEOUT},
                        "description": "end the stream after this many seconds (default: stream until the client leaves)"}],
        "responses": {"200": {"description": "events", "content": {"application/x-ndjson": {"schema": _ref(Event)}}},
                      **_errors(400)}}},
    "/v1/shutdown": {"post": {"summary": "Stop the guest and exit the runtime with 0 (ExitAndReplace). Any phase.",
                              "responses": {"202": {"description": "accepted", "content": _json(Accepted)},
                                            **_errors(400)}}},
    "/healthz": {"get": {"summary": "Liveness: the runtime answers. Any phase.",
                         "responses": {"200": {"description": "alive", "content": _json(Health)}, **_errors(400)}}},
    "/readyz": {"get": {"summary": "Readiness: 200 when Ready, else 503. Any phase.",
                        "responses": {"200": {"description": "ready", "content": _json(Health)},
                                      "503": {"description": "not ready", "content": _json(Health)},
                                      **_errors(400)}}},
}

#: answers of any path, not tied to one operation
_RESPONSES = {
    "MethodNotAllowed": {
        "description": "405 (code method_not_allowed) for a method a path does not have; the Allow header lists "
                       "the methods it has.",
        "headers": {"Allow": {"schema": {"type": "string"}, "description": "comma-separated methods, e.g. GET, PUT"}},
        "content": _json(ErrorBody)},
    "NotFound": {"description": "404 (code not_found) for a path the API does not have.", "content": _json(ErrorBody)},
}


def build_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document."""
    schemas: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=False)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    codes = registry()
    schemas["ErrorBody"]["properties"]["error"] = {
        "title": "Error", "type": "string", "enum": sorted(codes),
        "description": "Stable error code; the message says the cause and the fix. "
                       + "; ".join(f"`{c}`: {describe(c)}" for c in sorted(codes)),
    }
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
        "paths": PATHS,
        "components": {"schemas": schemas, "responses": _RESPONSES},
    }


def main() -> None:
    """Print the document as JSON."""
    json.dump(build_document(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
