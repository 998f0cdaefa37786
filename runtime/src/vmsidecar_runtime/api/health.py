"""Health: ``GET /healthz`` and ``GET /readyz``, on the API socket and on the health-only listener,
and ``GET /metrics`` on the health-only listener only.

The probe handlers are the API's own (one implementation); the health-only app serves them and
the Prometheus metrics (``metrics.py``), and nothing else, on TCP (``serve --health-listen
HOST:PORT``) so that the kubelet's ``httpGet`` probes cost the runtime one small request instead
of a Python process per probe (``vmsidecar-runtime ready``: 1.1-1.7 s of CPU, 61 MB), and
Prometheus scrapes the port the pod already exposes. That port carries no API: every other path
is a 404, every other method a 405, a body or a query a 400, and the requests are small.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.models import Health
from vmsidecar_contract.state import Phase

from .. import metrics, procs
from ..controller import VmController
from .listen import HEALTH_LISTEN_ENV, HEALTH_LISTEN_FLAG, parse_listen

__all__ = ["HEALTH_LISTEN_ENV", "HEALTH_LISTEN_FLAG", "make_health_app", "parse_listen", "serve_health"]

CONTROLLER = web.AppKey("controller", VmController)
#: a probe's request line and headers are short; anything longer is not a probe
MAX_LINE = 1024
MAX_FIELD = 1024
#: probes come every few seconds on a fresh connection: an idle one is closed soon
KEEPALIVE_S = 5.0
HEALTH_ROUTES = ("/healthz", "/readyz", "/metrics")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the runtime answers."""
    return web.json_response(Health(status="ok", phase=request.app[CONTROLLER].phase.value).model_dump())


async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 once the guest is Ready, else 503."""
    vm = request.app[CONTROLLER]
    ready = vm.phase == Phase.READY
    body = Health(status="ready" if ready else "not-ready", phase=vm.phase.value)
    return web.json_response(body.model_dump(), status=200 if ready else 503)


async def metrics_handler(request: web.Request) -> web.Response:
    """The runtime's Prometheus metrics, in the text format ``prometheus_client`` writes."""
    response = web.Response(body=metrics.exposition())
    response.headers["Content-Type"] = metrics.CONTENT_TYPE_LATEST
    return response


def _refusal(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)


@web.middleware
async def _only_probes(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request that is not a bare GET of a health path is refused before a handler runs."""
    if request.path not in HEALTH_ROUTES:
        return _refusal(404, "not_found", f"{request.path} is not served here: this port serves only GET /healthz, "
                        "GET /readyz and GET /metrics (the API is on the runtime's Unix socket)")
    if request.method != "GET":
        response = _refusal(405, "method_not_allowed", f"{request.method} is not allowed on {request.path}; use GET")
        response.headers["Allow"] = "GET"
        return response
    if request.body_exists or request.query_string:
        return _refusal(400, "http_error", f"GET {request.path} takes no body and no query parameters")
    return await handler(request)


def make_health_app(vm: VmController) -> web.Application:
    """The health-only application: three GET routes, no body read, ever."""
    app = web.Application(middlewares=[_only_probes], client_max_size=1)
    app[CONTROLLER] = vm
    app.router.add_get("/healthz", healthz, allow_head=False)
    app.router.add_get("/readyz", readyz, allow_head=False)
    app.router.add_get("/metrics", metrics_handler, allow_head=False)
    metrics.bind(lambda: _scraped(vm))
    return app


def _scraped(vm: VmController) -> metrics.State:
    """What a scrape reads: cheap, no lock (QEMU is the runtime's one qemu-system child, if any)."""
    from ..oci.cache import DiskCache  # the cache's module: not on a warm start's path before the API

    return metrics.State(phase=vm.phase, generation=vm.generation, qemu_pids=metrics.qemu_children(procs.OWN),
                         cache_bytes=DiskCache(vm.paths.cache).size(),
                         standby=vm.snapshot_info.standby)


async def serve_health(vm: VmController, listen: str) -> tuple[web.AppRunner, tuple[str, int]]:
    """Serve the health-only app on TCP ``listen``; returns the runner and the bound address."""
    host, port = parse_listen(listen)
    runner = web.AppRunner(make_health_app(vm), handle_signals=False, access_log=None,
                           max_line_size=MAX_LINE, max_field_size=MAX_FIELD, keepalive_timeout=KEEPALIVE_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise HostError(f"cannot listen on {listen} for the health probes ({e.strerror}); pick a free port with "
                        f"{HEALTH_LISTEN_FLAG} (or {HEALTH_LISTEN_ENV}), or leave it unset to serve none") from None
    bound = runner.addresses[0]
    return runner, (bound[0], bound[1])
