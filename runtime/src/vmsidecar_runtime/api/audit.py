"""The audit middleware: one ``vmsidecar.audit`` line per state-changing call (and per dump).

Keyed on the rows of the contract's endpoint table: every row but the reads, plus the dump (disk
data leaving the VM). A line says which generation the call came in, the row, what it was about
(the reference with its digest when known, credentials stripped: ``audit.redact``), how it ended
(``ok`` or the error code: the error body's, or a progress stream's ``error`` line's) and how long
it took. It also counts the lease's power operations in the controller's ledger.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from vmsidecar_contract import endpoints as api
from vmsidecar_contract.endpoints import Endpoint

from .. import audit
from ..controller import VmController
from .health import CONTROLLER

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: the parsed JSON body of a request (``parsing.json_body`` keeps it for this middleware)
BODY_KEY = web.RequestKey("vmsidecar.body", object)
#: the error code a progress stream ended with after its 200 (``ndjson.progress_stream``)
STREAM_ERROR_KEY = web.RequestKey("vmsidecar.stream_error", str)
AUDITED: dict[tuple[str, str], Endpoint] = {
    (row.method, row.path): row
    for row in (api.PUT_SPEC, api.POST_POWER, api.POST_RECYCLE, api.POST_LEASE, api.PUT_DISK, api.POST_PULL,
                api.GET_DISK, api.POST_SHUTDOWN)
}


def _row(request: web.Request) -> Endpoint | None:
    route = request.match_info.route
    resource = route.resource
    if resource is None:
        return None
    return AUDITED.get((request.method, resource.canonical))


def _disk(vm: VmController) -> str | None:
    """The current disk as ``REFERENCE@DIGEST``."""
    disk = vm.disks.current
    return None if disk is None else f"{audit.redact(disk.source)}@{disk.digest}"


def _target(row: Endpoint, request: web.Request, vm: VmController, ok: bool) -> dict[str, Any]:
    body = request.get(BODY_KEY)
    body = body if isinstance(body, dict) else {}
    if row is api.PUT_SPEC:
        image = body.get("image")
        return {"target": audit.redact(image) if isinstance(image, str) else None}
    if row is api.POST_PULL:
        reference = body.get("reference")
        target = audit.redact(reference) if isinstance(reference, str) else None
        if ok and target is not None and vm.disks.flashed is not None:
            target = f"{target}@{vm.disks.flashed.digest}"
        return {"target": target}
    if row is api.PUT_DISK:
        digest = vm.disks.flashed.digest if ok and vm.disks.flashed is not None else request.query.get("digest")
        return {"target": "upload" + (f"@{audit.redact(digest)}" if digest else "")}
    fields: dict[str, Any] = {"target": _disk(vm)}
    if row is api.POST_POWER and isinstance(body.get("action"), str):
        fields["action"] = audit.redact(body["action"])
    if row is api.GET_DISK:
        fields["format"] = audit.redact(request.query.get("format", "qcow2"))
    return fields


def _outcome(request: web.Request, response: web.StreamResponse) -> str:
    if stream_error := request.get(STREAM_ERROR_KEY):
        return str(stream_error)
    if response.status < 400:
        return "ok"
    body = response.body if isinstance(response, web.Response) else None
    try:
        code = json.loads(body)["error"] if isinstance(body, bytes) else None
    except (ValueError, KeyError, TypeError):
        code = None
    return str(code or f"http_{response.status}")


@web.middleware
async def audit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: sees the rendered answer of every call (errors included)."""
    row = _row(request)
    if row is None:
        return await handler(request)
    vm = request.app[CONTROLLER]
    generation = vm.generation
    started = time.monotonic()
    outcome = "aborted"  # the client left, or the server stopped, mid-call
    response: web.StreamResponse | None = None
    try:
        response = await handler(request)
        outcome = _outcome(request, response)
        return response
    finally:
        ok = outcome == "ok"
        if ok and row is api.POST_POWER:
            vm.ledger.power_operation()
        fields = {"audit": "call", "generation": generation, "method": str(row), **_target(row, request, vm, ok),
                  "outcome": outcome, "status": response.status if response is not None else None,
                  "duration_s": round(time.monotonic() - started, 3)}
        if vm.generation != generation:
            fields["new_generation"] = vm.generation
        audit.write(**fields)
