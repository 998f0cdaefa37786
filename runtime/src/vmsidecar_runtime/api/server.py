"""The aiohttp application: routes map one-to-one onto controller operations.

Errors are rendered in one place (``error_middleware``): every failure is
``{"error": code, "message": sentence}`` with 400/404/405/409/413/415/4xx/5xx.

Requests are held to what ``docs/api/openapi.json`` says, no looser: JSON bodies need
``Content-Type: application/json`` and at most ``MAX_JSON_BODY`` bytes, booleans are JSON
booleans, and a query parameter the operation does not have (or one given twice) is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from vmsidecar_contract.errors import RequestError, VmsidecarError
from vmsidecar_contract.models import Accepted, PowerRequest, PullRequest, RecycleRequest
from vmsidecar_contract.spec import load_spec
from vmsidecar_contract.state import Phase

from ..controller import VmController
from ..perms import share
from .health import CONTROLLER, healthz, readyz  # the same handlers serve the health-only listener

log = logging.getLogger(__name__)
#: how often an idle event stream checks that its client is still there
EVENTS_IDLE_CHECK_S = 1.0
#: the largest JSON request body (a spec at every list's maximum fits); larger is a 413. Disk
#: images are not JSON: PUT /v1/vm/disk streams them and has no such limit.
MAX_JSON_BODY = 1 << 20
#: the longest ``GET /v1/events?timeout=`` (seconds), like the other timeouts of the API
MAX_EVENTS_TIMEOUT = 3600.0
#: query parameters per (method, path); any other is a 400 (a typo must not pass silently)
QUERY_PARAMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("PUT", "/v1/vm/disk"): ("power_off", "digest"),
    ("GET", "/v1/vm/disk"): ("format",),
    ("GET", "/v1/events"): ("types", "timeout"),
}
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render every error as ``{"error", "message"}``; never let one stop the server."""
    try:
        return await handler(request)
    except VmsidecarError as e:
        log.info("%s %s -> %d %s: %s", request.method, request.path, e.http_status, e.code, e.message)
        return web.json_response(e.to_dict(), status=e.http_status)
    except HttpRefusal as e:
        log.info("%s %s -> %d: %s", request.method, request.path, e.status, e.message)
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


#: JSON is UTF-8 (RFC 8259); a body that names another charset is refused rather than guessed at
_JSON_CHARSETS = {None, "utf-8", "utf8", "us-ascii"}


def _check_query(request: web.Request) -> None:
    """Refuse a query parameter the operation does not have, or one given twice (which would win?)."""
    resource = request.match_info.route.resource
    known = QUERY_PARAMS.get((request.method, resource.canonical if resource else ""), ())
    for name in request.query:
        if name not in known:
            use = f"it takes {', '.join(known)}" if known else "it takes no query parameters"
            raise RequestError(f"{request.method} {request.path} has no query parameter {name!r}; {use} "
                               "(see docs/api/openapi.json)")
        if len(request.query.getall(name)) > 1:
            raise RequestError(f"query parameter {name!r} is given {len(request.query.getall(name))} times; give it once")


@web.middleware
async def query_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Check the query string of every routed request before its handler runs."""
    if request.match_info.http_exception is None:
        _check_query(request)
    return await handler(request)


class HttpRefusal(Exception):
    """A refusal at the HTTP level (415 here; 413 comes from aiohttp), sent as code ``http_error``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _unsupported_media_type(message: str) -> HttpRefusal:
    return HttpRefusal(415, message)


def _require_json_type(request: web.Request) -> None:
    """A non-empty JSON body must say so: a form or a file sent by mistake is a 415, not parsed."""
    if not request.body_exists:
        return
    ctype = request.headers.get("Content-Type")
    if ctype is None or request.content_type != "application/json":
        sent = f"Content-Type {ctype!r}" if ctype else "no Content-Type"
        raise _unsupported_media_type(f"the request body has {sent}; send JSON with Content-Type: application/json "
                                      "(curl: -H 'Content-Type: application/json')")


async def _json_body(request: web.Request) -> Any:
    """The body as JSON (``{}`` when empty); every way it can be malformed is a 400 (415: not
    declared as JSON, 413: too large)."""
    _require_json_type(request)
    charset = request.charset.lower() if request.charset else None
    if charset not in _JSON_CHARSETS:
        raise RequestError(f"the request declares charset={request.charset!r}; send the JSON body as UTF-8 "
                           "(Content-Type: application/json)")
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not UTF-8 (byte {e.start} is 0x{raw[e.start]:02x}); "
                           "send UTF-8 JSON") from e
    if not text.strip():
        return {}
    try:
        return json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError as e:
        raise RequestError(f"request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                           "send a JSON object") from e
    except RecursionError as e:
        raise RequestError("request body nests too deeply to be a request; send a flat JSON object") from e


def _not_json(name: str) -> Any:
    # Python's json reads NaN and Infinity; JSON (RFC 8259) has neither
    raise RequestError(f"request body is not valid JSON ({name} is not a JSON number); send a finite number")


async def _model(request: web.Request, model: type[M]) -> M:
    data = await _json_body(request)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        parts = [f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()]
        raise RequestError(f"invalid request body: {'; '.join(parts)}; see docs/api/openapi.json") from e


def _bool_query(request: web.Request, name: str) -> bool:
    """A boolean query parameter: exactly ``true`` or ``false``, as the document's boolean (no 1/yes)."""
    value = request.query.get(name, "false")
    if value not in ("true", "false"):
        raise RequestError(f"query parameter {name}={value!r} is not a boolean; use true or false")
    return value == "true"


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
    data = await _json_body(request)
    if not isinstance(data, dict):
        raise RequestError("the spec must be a JSON object of spec fields")
    if not data:  # PUT replaces: an empty body would silently reset every field, image included
        raise RequestError("the spec is empty; send the whole spec (at least image), as GET /v1/vm/spec returns it")
    await vm.set_spec(load_spec(data, wire=True))
    return _state(vm)


async def post_power(request: web.Request) -> web.Response:
    """Power on/off/reset/cycle."""
    vm = _vm(request)
    req = await _model(request, PowerRequest)
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
    req = await _model(request, RecycleRequest)
    await vm.recycle(boot=req.boot, if_generation=req.if_generation)
    return _state(vm)


async def post_lease(request: web.Request) -> web.Response:
    """Claim the VM for a new lease (recycles first when an earlier lease used this generation)."""
    vm = _vm(request)
    await vm.claim()
    return _state(vm)


async def put_disk(request: web.Request) -> web.Response:
    """Flash: the body is the image stream."""
    vm = _vm(request)
    power_off = _bool_query(request, "power_off")
    digest = request.query.get("digest")
    if digest is not None and not _DIGEST_RE.fullmatch(digest):
        # checked before anything happens: a bad parameter must not power the guest off
        raise RequestError(f"digest={digest!r} is not a sha256 digest; use sha256: and 64 lowercase hex digits")
    ctype = request.headers.get("Content-Type")
    if ctype is not None and request.content_type != "application/octet-stream":
        raise _unsupported_media_type(f"the disk image was sent with Content-Type {ctype!r}; send it as "
                                      "application/octet-stream (curl: -T FILE -H 'Content-Type: application/octet-stream')")

    async def chunks() -> AsyncIterator[bytes]:
        async for chunk in request.content.iter_chunked(1 << 20):
            yield chunk

    await vm.flash(
        chunks(),
        power_off=power_off,
        expected_size=request.content_length,
        expected_digest=digest,
    )
    return _state(vm)


async def post_disk_pull(request: web.Request) -> web.StreamResponse:
    """Flash from a reference; the answer is an NDJSON stream of progress lines and one result.

    The transfer is reserved before the 200 of the stream (a second one is a real 409), and it is
    cancelled when the client goes away: nobody would see its result, and the next lease must not
    get it."""
    vm = _vm(request)
    req = await _model(request, PullRequest)
    vm.host_paths.check_reference(req.reference)  # before the 200 of the stream: a refusal is a 400
    if vm.phase in (Phase.STARTING, Phase.RUNNING, Phase.READY) and not req.power_off:
        from vmsidecar_contract.state import BOOTABLE, require

        require(vm.phase, BOOTABLE, "flash the disk", hint="or send power_off=true to power it off first")
    transfer = vm.begin_transfer(f"the flash from {req.reference}")
    task: asyncio.Task[Any] | None = None
    try:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def progress(done: int, total: int | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, {"type": "progress", "done": done, "total": total})

        task = asyncio.create_task(vm.flash_reference(req.reference, power_off=req.power_off, progress=progress,
                                                      transfer=transfer))
        task.add_done_callback(_retrieve)
        last_sent = 0.0
        while not task.done() or not queue.empty():
            if _client_gone(request):
                vm.cancel_transfer("its client went away", transfer)
                await asyncio.wait({task})
                return response
            with contextlib.suppress(asyncio.TimeoutError):
                line = await asyncio.wait_for(queue.get(), 0.2)
                now = loop.time()
                if now - last_sent >= 0.2 or line.get("done") == line.get("total"):
                    await response.write(json.dumps(line).encode() + b"\n")
                    last_sent = now
        try:
            state = task.result()
            final: dict[str, Any] = {"type": "result", "state": state.model_dump(mode="json")}
        except VmsidecarError as e:
            final = {"type": "error", **e.to_dict()}
        await response.write(json.dumps(final).encode() + b"\n")
        await response.write_eof()
        return response
    finally:
        if task is None:
            vm.end_transfer(transfer)
        elif not task.done():  # the stream broke (the client left mid-write) or the server stops
            vm.cancel_transfer("its client went away", transfer)


def _client_gone(request: web.Request) -> bool:
    # aiohttp does not cancel a handler whose client left; a pull that sends no progress (a stalled
    # registry) would never find out by writing
    return request.transport is None or request.transport.is_closing()


def _retrieve(task: asyncio.Task[Any]) -> None:
    """The result of a transfer whose client left is nobody's: read it so asyncio does not warn."""
    if not task.cancelled():
        task.exception()


async def get_disk(request: web.Request) -> web.StreamResponse:
    """Dump the disk as one standalone image."""
    vm = _vm(request)
    fmt = request.query.get("format", "qcow2")
    if fmt not in ("qcow2", "raw"):
        raise RequestError(f"format={fmt!r} is not supported; use qcow2 or raw")
    path = await vm.dump(fmt)
    response = web.StreamResponse(
        headers={"Content-Type": "application/octet-stream", "Content-Length": str(path.stat().st_size)}
    )
    await response.prepare(request)
    try:
        with open(path, "rb") as fh:
            while chunk := await asyncio.to_thread(fh.read, 1 << 20):
                await response.write(chunk)
    finally:
        path.unlink(missing_ok=True)
    await response.write_eof()
    return response


async def get_events(request: web.Request) -> web.StreamResponse:
    """NDJSON event stream until the client goes away."""
    vm = _vm(request)
    types = set(request.query["types"].split(",")) if request.query.get("types") else None
    until = _events_deadline(request)
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    loop = asyncio.get_running_loop()
    async with vm.events.listen(types) as queue:
        first = {"type": "hello", "time": 0, "generation": vm.generation, "data": {"phase": vm.phase.value}}
        await response.write(json.dumps(first).encode() + b"\n")
        while True:
            wait = EVENTS_IDLE_CHECK_S if until is None else min(EVENTS_IDLE_CHECK_S, until - loop.time())
            if wait <= 0:
                await response.write_eof()
                return response
            try:
                event = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                # aiohttp does not cancel an idle handler whose client left; without this check a
                # filter that never matches keeps the stream (and the runtime's exit) waiting forever
                if request.transport is None or request.transport.is_closing():
                    return response
                continue
            await response.write(event.model_dump_json().encode() + b"\n")


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
    return web.json_response(Accepted(status="shutting-down").model_dump(), status=202)


#: (method, path, handler): the OpenAPI test checks this table against docs/api/openapi.json
ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/v1/vm", get_vm),
    ("GET", "/v1/vm/spec", get_spec),
    ("PUT", "/v1/vm/spec", put_spec),
    ("POST", "/v1/vm/power", post_power),
    ("POST", "/v1/vm/recycle", post_recycle),
    ("POST", "/v1/vm/lease", post_lease),
    ("PUT", "/v1/vm/disk", put_disk),
    ("GET", "/v1/vm/disk", get_disk),
    ("POST", "/v1/vm/disk/pull", post_disk_pull),
    ("GET", "/v1/events", get_events),
    ("POST", "/v1/shutdown", post_shutdown),
    ("GET", "/healthz", healthz),
    ("GET", "/readyz", readyz),
]


def make_app(vm: VmController) -> web.Application:
    """The API application for one controller."""
    app = web.Application(middlewares=[error_middleware, query_middleware], client_max_size=MAX_JSON_BODY)
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
