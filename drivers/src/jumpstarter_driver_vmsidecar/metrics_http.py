"""The exporter's metrics listener: ``GET /metrics`` and nothing else, in a thread of its own.

A thread, not the exporter's event loop: jumpstarter's ``_handle_child`` creates and owns that
loop for each exporter lifetime, and the single-process runner restarts it in a loop, while the
counters and this listener live as long as the process. Whoever reaches the port reads counters
only: there is no other path (404), no other method (405), no body is read, a client that sends
nothing is dropped after ``TIMEOUT_S`` and at most ``MAX_CLIENTS`` are served at once.
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vmsidecar_contract import listen

from .metrics import REGISTRY

METRICS_LISTEN_ENV = "VMSIDECAR_EXPORTER_METRICS_LISTEN"
METRICS_LISTEN_FLAG = "--metrics-listen"
TIMEOUT_S = 10.0
MAX_CLIENTS = 8

log = logging.getLogger(__name__)


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port). :raise ValueError: naming the flag, the value and the form it takes."""
    return listen.parse_listen(value, flag=METRICS_LISTEN_FLAG, env=METRICS_LISTEN_ENV, example_port=8082)


class _Handler(BaseHTTPRequestHandler):
    timeout = TIMEOUT_S
    server_version = "vmsidecar-exporter"
    sys_version = ""

    def do_GET(self) -> None:
        # the request line's own target: http.server folds a leading "//" into "/" in self.path
        if self.requestline.split(" ")[1:2] != ["/metrics"]:
            self._answer(404, b"not found: this listener serves GET /metrics only\n")
            return
        self._answer(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)

    def _refuse_method(self) -> None:
        self._answer(405, b"method not allowed: this listener serves GET /metrics only\n", allow="GET")

    do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_TRACE = do_CONNECT = _refuse_method

    def _answer(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
                allow: str | None = None) -> None:
        self.close_connection = True  # one request per connection: nothing to hold open
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if allow:
            self.send_header("Allow", allow)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # scrapes every 15 s would flood the exporter's log
        log.debug(format, *args)


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # a flood of idle connections costs no threads
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @property
    def port(self) -> int:
        return int(self.server_address[1])


def serve_metrics(value: str) -> MetricsServer:
    """Serve ``/metrics`` on ``HOST:PORT`` in a daemon thread; the server (``port`` says which port).

    :raise ValueError: a bad address. :raise OSError: the address cannot be bound.
    """
    try:
        server = MetricsServer(parse_listen(value))
    except OSError as e:
        raise OSError(e.errno, f"cannot serve metrics on {value} ({e.strerror}); pick a free port or another "
                               f"address for {METRICS_LISTEN_FLAG}") from e
    threading.Thread(target=server.serve_forever, name="vmsidecar-metrics", daemon=True).start()
    host, port = str(server.server_address[0]), server.server_address[1]
    log.info("exporter metrics on http://%s/metrics", f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return server
