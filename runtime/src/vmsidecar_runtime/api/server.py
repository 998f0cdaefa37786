"""The aiohttp application: one handler per row of the contract's endpoint table.

A handler parses (``parsing``), calls the controller and renders; the routes, their query
parameters and the OpenAPI document all come from ``vmsidecar_contract.endpoints``. Errors are
rendered in one place (``error_middleware``): every failure is ``{"error": code, "message":
sentence}`` with 400/404/405/409/413/415/4xx/5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path

from aiohttp import web

from vmsidecar_contract import endpoints as api
from vmsidecar_contract.endpoints import MAX_EVENTS_TIMEOUT, MAX_JSON_BODY, Endpoint
from vmsidecar_contract.errors import RequestError, VmsidecarError
from vmsidecar_contract.models import Accepted, ClaimRequest, PowerRequest, PullRequest, RecycleRequest
from vmsidecar_contract.spec import load_spec

from .. import audit, metrics
from ..controller import VmController
from ..perms import share
from .audit import STREAM_ERROR_KEY, audit_middleware
from .health import CONTROLLER, healthz, readyz  # the same handlers serve the health-only listener
from .ndjson import client_gone, open_stream, progress_stream, write_line
from .parsing import (
    HttpRefusal,
    bool_query,
    check_query,
    json_body,
    parse,
    require_disk_image_type,
    row_of,
)

log = logging.getLogger(__name__)
#: how often an idle event stream checks that its client is still there
EVENTS_IDLE_CHECK_S = 1.0
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
#: the generation a lease-bound request named (:func:`generation_middleware`)
BOUND_GENERATION_KEY = web.RequestKey("vmsidecar.generation", int)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render every error as ``{"error", "message"}`` (counted by code); never let one stop the server."""
    response = await _rendered(request, handler)
    if response.status >= 400 and isinstance(response, web.Response) and isinstance(response.body, bytes):
        with contextlib.suppress(ValueError, AttributeError):
            if code := json.loads(response.body).get("error"):  # a 503 of /readyz is no error
                metrics.error(str(code))
    return response


async def _rendered(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except VmsidecarError as e:
        # the message may quote a caller's reference: the log gets it without credentials
        log.info("%s %s -> %d %s: %s", request.method, request.path, e.http_status, e.code, audit.scrub(e.message))
        return web.json_response(e.to_dict(), status=e.http_status)
    except HttpRefusal as e:
        log.info("%s %s -> %d: %s", request.method, request.path, e.status, audit.scrub(e.message))
        return _error_response(e.status, "http_error", e.message)
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        response = _error_response(405, "method_not_allowed",
                                   f"{request.method} is not allowed on {request.path}; use {allowed}")
        response.headers["Allow"] = allowed
        return response
    except web.HTTPNotFound:
        return _error_response(404, "not_found", f"no such endpoint {request.path}; see docs/api/openapi.json")
    except web.HTTPRequestEntityTooLarge:
        return _error_response(413, "http_error",
                               f"the request body is larger than {MAX_JSON_BODY} bytes, the limit of a JSON request; "
                               "send a smaller body (disk images go to PUT /v1/vm/disk, which streams)")
    except web.HTTPException as e:
        return _error_response(e.status, "http_error", e.reason)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # a bug: report it, keep serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(500, "internal_error", f"internal error ({type(e).__name__}: {e}); please report it")


@web.middleware
async def query_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Check the query string of every routed request before its handler runs."""
    if request.match_info.http_exception is None:
        check_query(request)
    return await handler(request)


@web.middleware
async def generation_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A call that names its lease's generation (:data:`api.GENERATION_HEADER`) acts only while that
    lease's generation is the VM's: a driver tree of a lease that ended must not act on the next.

    :raise GenerationChangedError: the VM is at another generation. :raise RequestError: not a number.
    """
    value = request.headers.get(api.GENERATION_HEADER)
    row = row_of(request)
    if value is not None and row is not None and row.lease_bound:
        if not re.fullmatch(r"[0-9]{1,19}", value.strip()):  # (str.isdigit takes '²', which int() refuses)
            raise RequestError(f"header {api.GENERATION_HEADER} is {value[:40]!r}; give the generation the "
                               "lease claimed, a whole number")
        vm = request.app[CONTROLLER]
        vm.require_lease_generation(int(value))
        request[BOUND_GENERATION_KEY] = int(value)
        with vm.lease_bound_call(int(value)):  # checked again once it holds the power lock
            return await handler(request)
    return await handler(request)


def _vm(request: web.Request) -> VmController:
    return request.app[CONTROLLER]


def _state(vm: VmController) -> web.Response:
    return web.json_response(vm.state().model_dump(mode="json"))


async def get_vm(request: web.Request) -> web.Response:
    """Current state."""
    return _state(_vm(request))


async def get_spec(request: web.Request) -> web.Response:
    """Current spec (404 before one is set)."""
    vm = _vm(request)
    if vm.spec is None:
        return _error_response(404, "not_found", "the runtime has no VM spec yet; PUT /v1/vm/spec first")
    return web.json_response(vm.spec.to_json())


async def put_spec(request: web.Request) -> web.Response:
    """Replace the spec (idempotent when unchanged)."""
    vm = _vm(request)
    data = await json_body(request)
    if not isinstance(data, dict):
        raise RequestError("the spec must be a JSON object of spec fields")
    if not data:  # PUT replaces: an empty body would silently reset every field, image included
        raise RequestError("the spec is empty; send the whole spec (at least image), as GET /v1/vm/spec returns it")
    await vm.set_spec(load_spec(data, wire=True))
    return _state(vm)


async def post_power(request: web.Request) -> web.Response:
    """Power on/off/reset/cycle."""
    vm = _vm(request)
    req = await parse(request, PowerRequest)
    if req.action == "on":
        await vm.power_on()
    elif req.action == "off":
        await vm.power_off(graceful=req.graceful is not False, timeout=req.timeout)
    elif req.action == "reset":
        await vm.reset()
    else:
        await vm.cycle(graceful=bool(req.graceful), timeout=req.timeout)
    return _state(vm)


async def post_recycle(request: web.Request) -> web.Response:
    """Back to pristine for the next lease."""
    vm = _vm(request)
    req = await parse(request, RecycleRequest)
    await vm.recycle(boot=req.boot, if_generation=req.if_generation)
    return _state(vm)


async def post_lease(request: web.Request) -> web.Response:
    """Claim the VM for a new lease (recycles first when an earlier lease used this generation)."""
    vm = _vm(request)
    req = await parse(request, ClaimRequest)
    # a caller that gave up (the exporter's claim is bounded: 120 s) while this waited for the lock
    # must not recycle the VM after all: it may be the next lease's by then (aiohttp runs a handler
    # on when its client has left; its transport is gone)
    await vm.claim(token=req.token, spec=None if req.spec is None else load_spec(req.spec, wire=True),
                   still_asked=lambda: request.transport is not None)
    return _state(vm)


async def put_disk(request: web.Request) -> web.Response:
    """Flash: the body is the image stream."""
    vm = _vm(request)
    power_off = bool_query(request, "power_off")
    digest = request.query.get("digest")
    if digest is not None and not _DIGEST_RE.fullmatch(digest):
        # checked before anything happens: a bad parameter must not power the guest off
        raise RequestError(f"digest={digest!r} is not a sha256 digest; use sha256: and 64 lowercase hex digits")
    require_disk_image_type(request)

    async def chunks() -> AsyncIterator[bytes]:
        async for chunk in request.content.iter_chunked(1 << 20):
            yield chunk

    await vm.flash(chunks(), power_off=power_off, expected_size=request.content_length, expected_digest=digest)
    return _state(vm)


async def post_disk_pull(request: web.Request) -> web.StreamResponse:
    """Flash from a reference, as a progress stream.

    The transfer is reserved before the 200 of the stream (a second one is a real 409), and it is
    cancelled when the client goes away: nobody would see its result, and the next lease must not
    get it."""
    vm = _vm(request)
    req = await parse(request, PullRequest)
    transfer = vm.reserve_flash(req.reference, power_off=req.power_off)  # before the 200: refusals are 4xx
    return await progress_stream(
        request,
        lambda progress: vm.flash_reference(req.reference, power_off=req.power_off, progress=progress,
                                            transfer=transfer),
        cancel=lambda why: vm.transfers.cancel(why, transfer),
        release=lambda: vm.transfers.end(transfer))


async def get_disk(request: web.Request) -> web.StreamResponse:
    """Dump the disk as one standalone image.

    A dump is a full-size temp copy of the disk in the state volume until its reader has read it all
    or left, so it takes the VM's one disk transfer: dumps started and never read cannot fill the
    volume (a second dump, or a flash, is a 409 meanwhile). The end of the lease (recycle, the next
    claim) cancels it: its conversion is stopped (``Transfers.dump``) or its stream cut short, and
    the copy removed."""
    vm = _vm(request)
    fmt = request.query.get("format", "qcow2")
    if fmt not in ("qcow2", "raw"):
        raise RequestError(f"format={fmt!r} is not supported; use qcow2 or raw")
    transfer = vm.transfers.begin("a disk dump")
    path: Path | None = None
    try:
        path = await vm.dump(fmt, transfer=transfer)  # the lease's end cuts the conversion (transfer_cancelled)
        response = web.StreamResponse(
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(path.stat().st_size)}
        )
        await response.prepare(request)
        sending = asyncio.ensure_future(_send_file(response, path, lambda: vm.transfers.end(transfer)))
        ended = asyncio.ensure_future(transfer.cancelled.wait())
        try:  # a reader that stops reading leaves the write waiting for ever: the lease's end must stop it
            await asyncio.wait({sending, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not sending.done():
                sending.cancel()
                await asyncio.wait({sending})  # its file is closed before the unlink below
        if sending.cancelled():  # the lease ended
            request[STREAM_ERROR_KEY] = "transfer_cancelled"
            if request.transport is not None:  # cut: the reader must not take a part for the whole disk
                request.transport.abort()
            return response
        if isinstance(sending.exception(), ConnectionError):  # the reader left: no failure of the runtime's
            request[STREAM_ERROR_KEY] = "aborted"
            return response
        sending.result()
        await response.write_eof()
        return response
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
        vm.transfers.end(transfer)


async def _send_file(response: web.StreamResponse, path: Path, all_read: Callable[[], None]) -> None:
    """Send the file; ``all_read()`` once its last bytes are written, with no await between: the
    reader may have them all from then on, and a flash or dump it asks for next must not find the
    slot still held (a 409). Not before: a reader that stops short of the end holds the write, and
    the slot with it, so the lease's end cuts it and removes the copy (before, a reader stopping at
    the last chunk freed the slot and kept its full-size copy, dump after dump)."""
    with open(path, "rb") as fh:
        left = os.fstat(fh.fileno()).st_size
        while left > 0 and (chunk := await asyncio.to_thread(fh.read, min(left, 1 << 20))):
            left -= len(chunk)
            await response.write(chunk)
    all_read()


async def get_events(request: web.Request) -> web.StreamResponse:
    """NDJSON event stream (a hello line first) until the client goes away or ``?timeout=`` passes."""
    vm = _vm(request)
    types = set(request.query["types"].split(",")) if request.query.get("types") else None
    until = _events_deadline(request)
    response = await open_stream(request)
    loop = asyncio.get_running_loop()
    # a stream a lease opened with its generation is that lease's: it ends where the lease does,
    # before anything of the next (its claim, boots, flashes) is told to it
    bound = request.get(BOUND_GENERATION_KEY)
    async with vm.events.listen(types) as queue:
        await write_line(response, {"type": "hello", "time": 0, "generation": vm.generation,
                                    "data": {"phase": vm.phase.value}})
        while True:
            wait = EVENTS_IDLE_CHECK_S if until is None else min(EVENTS_IDLE_CHECK_S, until - loop.time())
            if wait <= 0 or (bound is not None and vm.generation != bound):
                await response.write_eof()
                return response
            try:
                event = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                # without this check a filter that never matches keeps the stream (and the
                # runtime's exit) waiting forever
                if client_gone(request):
                    return response
                continue
            if bound is not None and event.generation != bound:
                continue  # (the loop's check ends the stream)
            await write_line(response, event.model_dump_json())


def _events_deadline(request: web.Request) -> float | None:
    """``?timeout=`` seconds: when the event stream ends by itself (None: when the client leaves)."""
    text = request.query.get("timeout")
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= MAX_EVENTS_TIMEOUT:  # also refuses nan and inf
        raise RequestError(f"timeout={text!r} is not a number of seconds in (0, {MAX_EVENTS_TIMEOUT:.0f}]; "
                           "leave it out to stream until you disconnect")
    return asyncio.get_running_loop().time() + seconds


async def post_shutdown(request: web.Request) -> web.Response:
    """Stop the guest and exit the runtime with 0."""
    vm = _vm(request)
    await vm.shutdown()
    return web.json_response(Accepted(status="shutting-down").model_dump(), status=api.POST_SHUTDOWN.status)


#: the handler of each row of the endpoint table
HANDLERS: dict[Endpoint, Handler] = {
    api.GET_VM: get_vm,
    api.GET_SPEC: get_spec,
    api.PUT_SPEC: put_spec,
    api.POST_POWER: post_power,
    api.POST_RECYCLE: post_recycle,
    api.POST_LEASE: post_lease,
    api.PUT_DISK: put_disk,
    api.GET_DISK: get_disk,
    api.POST_PULL: post_disk_pull,
    api.GET_EVENTS: get_events,
    api.POST_SHUTDOWN: post_shutdown,
    api.GET_HEALTHZ: healthz,
    api.GET_READYZ: readyz,
}


def routes(table: Iterable[Endpoint] = api.ENDPOINTS,
           handlers: Mapping[Endpoint, Handler] = HANDLERS) -> list[tuple[str, str, Handler]]:
    """(method, path, handler) for every row of ``table``.

    :raise LookupError: for a row without a handler, or a handler of no row.
    """
    rows = list(table)
    if missing := [str(row) for row in rows if row not in handlers]:
        raise LookupError(f"no handler for {', '.join(missing)}: add one to HANDLERS in vmsidecar_runtime.api.server")
    if stray := [str(row) for row in handlers if row not in rows]:
        raise LookupError(f"HANDLERS serves {', '.join(stray)}, which the endpoint table does not list; add a row "
                          "to vmsidecar_contract.endpoints or drop the handler")
    return [(row.method, row.path, handlers[row]) for row in rows]


#: (method, path, handler) of every operation: importing the server fails when a row has no handler
ROUTES = routes()


def make_app(vm: VmController) -> web.Application:
    """The API application for one controller."""
    app = web.Application(middlewares=[audit_middleware, error_middleware, query_middleware,
                                       generation_middleware],
                          client_max_size=MAX_JSON_BODY)
    app[CONTROLLER] = vm
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app


async def serve_api(vm: VmController, socket_path: Path) -> web.AppRunner:
    """Serve the API on a Unix socket with mode 0660."""
    runner = web.AppRunner(make_app(vm), handle_signals=False, access_log=None)
    await runner.setup()
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()
    # no umask juggling: the process umask keeps others out until share() (perms.restrict_umask)
    site = web.UnixSite(runner, str(socket_path))
    await site.start()
    share(socket_path, 0o660)
    return runner
