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

_MODELS: list[type[BaseModel]] = [
    VmSpec, VmState, PowerRequest, RecycleRequest, PullRequest, ErrorBody, Health, Accepted, ProgressLine, Event,
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*codes: int) -> dict[str, Any]:
    names = {400: "Malformed request or invalid spec", 404: "Not found", 409: "Wrong phase for this operation",
             422: "Image cannot be used", 500: "Host or guest failure", 502: "Registry failure",
             503: "Not ready"}
    return {str(c): {"description": names[c], "content": _json(ErrorBody)} for c in codes}


_STATE_OK = {"200": {"description": "The VM state after the operation", "content": _json(VmState)}}
_BOOL_QUERY = {"type": "boolean", "default": False}

#: path -> method -> operation (summary names the phases each operation accepts)
PATHS: dict[str, dict[str, dict[str, Any]]] = {
    "/v1/vm": {"get": {"summary": "State: phase, image digest, accel, generation, timings, last error. Any phase.",
                       "responses": _STATE_OK}},
    "/v1/vm/spec": {
        "get": {"summary": "The current spec. Any phase.",
                "responses": {"200": {"description": "spec", "content": _json(VmSpec)}, **_errors(404)}},
        "put": {"summary": "Replace the spec (idempotent). Stopped|Crashed|Error, or any phase when unchanged.",
                "requestBody": {"required": True, "content": _json(VmSpec)},
                "responses": {**_STATE_OK, **_errors(400, 409)}},
    },
    "/v1/vm/power": {"post": {
        "summary": "on (Stopped|Crashed|Error; idempotent when on), off (any), reset (Starting|Running|Ready), cycle (any).",
        "requestBody": {"required": True, "content": _json(PowerRequest)},
        "responses": {**_STATE_OK, **_errors(400, 409, 422, 500, 502)}}},
    "/v1/vm/recycle": {"post": {
        "summary": "Back to pristine (overlay, flashed disk, scrollback discarded; generation bumped), then boot. Any phase.",
        "requestBody": {"required": False, "content": _json(RecycleRequest)},
        "responses": {**_STATE_OK, **_errors(400, 409, 500)}}},
    "/v1/vm/lease": {"post": {
        "summary": "Claim the VM for a new lease: when an earlier lease used this generation it is recycled first "
                   "(the answer then comes after the fresh boot has started). Any phase.",
        "responses": {**_STATE_OK, **_errors(500)}}},
    "/v1/vm/disk": {
        "put": {"summary": "Flash: the body is the image (qcow2/raw, optionally zstd/gzip/xz). Stopped|Crashed|Error, "
                           "or any phase with power_off=true.",
                "parameters": [
                    {"name": "power_off", "in": "query", "schema": _BOOL_QUERY},
                    {"name": "digest", "in": "query", "schema": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"}},
                ],
                "requestBody": {"required": True,
                                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                "responses": {**_STATE_OK, **_errors(400, 409, 422, 500)}},
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
                   "Stopped|Crashed|Error, or any phase with power_off.",
        "requestBody": {"required": True, "content": _json(PullRequest)},
        "responses": {"200": {"description": "progress stream",
                              "content": {"application/x-ndjson": {"schema": _ref(ProgressLine)}}},
                      **_errors(400, 409)}}},
    "/v1/events": {"get": {
        "summary": "Event stream (NDJSON of Event) until the client disconnects. Any phase.",
        "parameters": [{"name": "types", "in": "query", "schema": {"type": "string"},
                        "description": "comma-separated event types, exact names (phase, spec, pulled, flashed, recycled, "
                                       "guest.powered_off, guest.reset, guest.paused, guest.resumed, guest.panicked, "
                                       "guest.powerdown_requested, backend.exited)"}],
        "responses": {"200": {"description": "events", "content": {"application/x-ndjson": {"schema": _ref(Event)}}}}}},
    "/v1/shutdown": {"post": {"summary": "Stop the guest and exit the runtime with 0 (ExitAndReplace). Any phase.",
                              "responses": {"202": {"description": "accepted", "content": _json(Accepted)}}}},
    "/healthz": {"get": {"summary": "Liveness: the runtime answers. Any phase.",
                         "responses": {"200": {"description": "alive", "content": _json(Health)}}}},
    "/readyz": {"get": {"summary": "Readiness: 200 when Ready, else 503. Any phase.",
                        "responses": {"200": {"description": "ready", "content": _json(Health)},
                                      "503": {"description": "not ready", "content": _json(Health)}}}},
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
                           '{"error": code, "message": sentence naming the cause and the fix}.',
        },
        "servers": [{"url": "http://localhost", "description": "over the Unix socket (curl --unix-socket)"}],
        "paths": PATHS,
        "components": {"schemas": schemas},
    }


def main() -> None:
    """Print the document as JSON."""
    json.dump(build_document(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
