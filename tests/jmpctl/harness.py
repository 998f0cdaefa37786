"""``JmpController``: the test-facing object. A grpc.aio server on its own thread and loop,
config writers for ``jmp run`` / ``jmp shell``, waits on recorded status, leases, processes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Self

import grpc
import yaml
from jumpstarter_protocol.jumpstarter.client.v1 import client_pb2_grpc
from jumpstarter_protocol.jumpstarter.v1 import jumpstarter_pb2_grpc, router_pb2_grpc

from .certs import make_self_signed
from .controller import ClientService, ControllerService, ExporterRecord, LeaseRecord, Registry
from .router import Router

BIN = Path(sys.executable).parent  # the venv's bin: jmp, j
TESTS = Path(__file__).resolve().parents[1]  # on PYTHONPATH so test-only drivers import in `jmp run`

# Exporters ping every 20 s without calls (0.9.0 defaults); the gRPC server default would
# answer that with GOAWAY(too_many_pings) after a few minutes.
_SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_ping_strikes", 0),
]


def fake_jwt(subject: str) -> str:
    """An unsigned JWT without ``exp``: 0.9.0's ``jmp shell`` decodes the client token (expiry
    checks) and fails on opaque strings; without ``exp`` it never warns or refreshes."""
    def b64(obj: dict[str, str]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()
    return f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64({'iss': 'jmpctl', 'sub': subject})}.c2ln"


@dataclass
class LeaseHandle:
    """A lease the test created (as client ``client``); drive it with ``jmp shell --lease``."""

    ctl: JmpController
    name: str
    exporter: str
    client: str
    client_config: Path
    released_at: float | None = None  # monotonic, set when the context manager releases it

    @property
    def env(self) -> dict[str, str]:
        """Environment for ``jmp shell --client-config C`` (JMP_LEASE names this lease)."""
        return self.ctl.env() | {"JMP_LEASE": self.name}

    def argv(self, *cmd: str) -> list[str]:
        return [str(BIN / "jmp"), "shell", "--client-config", str(self.client_config),
                "--lease", self.name, "--", *cmd]

    def shell(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``jmp shell --client-config C --lease NAME -- cmd...`` and capture its output."""
        return subprocess.run(self.argv(*cmd), env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    @property
    def record(self) -> LeaseRecord:
        return self.ctl.registry.leases[self.name]


@dataclass
class JmpController:
    """A minimal Jumpstarter controller + router for tests. Use as a context manager."""

    workdir: Path
    host: str = "127.0.0.1"
    port: int = 0
    registry: Registry = field(init=False)
    router: Router = field(init=False)
    processes: list[subprocess.Popen] = field(init=False, default_factory=list)
    _procs_by_name: dict[str, subprocess.Popen] = field(init=False, default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = field(init=False, default=None)
    _server: grpc.aio.Server | None = field(init=False, default=None)

    # -- lifecycle ---------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tls = make_self_signed(self.workdir / "tls")
        self.router = Router()
        self.registry = Registry(self.router)

    def start(self) -> Self:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jmpctl", daemon=True)
        self._thread.start()
        self.port = self.run(self._serve())
        self.registry.router_endpoint = self.endpoint
        return self

    async def _serve(self) -> int:
        server = grpc.aio.server(options=_SERVER_OPTIONS)
        jumpstarter_pb2_grpc.add_ControllerServiceServicer_to_server(ControllerService(self.registry), server)
        client_pb2_grpc.add_ClientServiceServicer_to_server(ClientService(self.registry), server)
        router_pb2_grpc.add_RouterServiceServicer_to_server(self.router, server)
        creds = grpc.ssl_server_credentials([(self.tls.key_pem, self.tls.cert_pem)])
        port = server.add_secure_port(f"{self.host}:{self.port}", creds)
        await server.start()
        self._server = server
        return port

    def stop(self) -> None:
        for proc in self.processes:
            stop_process(proc)
        if self._loop is None:
            return
        if self._server is not None:
            self.run(self._server.stop(grace=1))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run(self, coro) -> Any:
        """Run a coroutine on the controller's loop and wait for its result."""
        assert self._loop is not None, "controller not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a plain function on the controller's loop (registry mutations must happen there)."""
        async def wrapper() -> Any:
            return fn(*args, **kwargs)
        return self.run(wrapper())

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    # -- configs -----------------------------------------------------------------------
    def exporter_config(self, export: dict[str, Any], name: str = "vm", **extra: Any) -> Path:
        """Write an ExporterConfig pointing at this controller; ``extra`` adds top-level keys
        (``hooks=...``, ``failureDetection=...``, ``description=...``)."""
        cfg = {
            "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "ExporterConfig",
            "metadata": {"namespace": "default", "name": name},
            "endpoint": self.endpoint, "token": fake_jwt(f"exporter:{name}"),
            "tls": {"ca": self.tls.ca_b64, "insecure": False},
            "export": export, **extra,
        }
        return self._write(self.workdir / "exporters" / f"{name}.yaml", cfg)

    def client_config(self, name: str = "c") -> Path:
        """Write a ClientConfig for client ``name`` (all driver clients allowed: ``UNSAFE``)."""
        cfg = {
            "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "ClientConfig",
            "metadata": {"namespace": "default", "name": name},
            "endpoint": self.endpoint, "token": fake_jwt(f"client:{name}"),
            "tls": {"ca": self.tls.ca_b64, "insecure": False},
            "drivers": {"allow": ["UNSAFE"]},
        }
        return self._write(self.workdir / "clients" / f"{name}.yaml", cfg)

    @staticmethod
    def _write(path: Path, cfg: dict[str, Any]) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for jmp/j subprocesses: venv bin first, private XDG config dir,
        no inherited JMP_*/JUMPSTARTER_* variables, tests/ on PYTHONPATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JMP_", "JUMPSTARTER_"))}
        env |= {
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            "XDG_CONFIG_HOME": str(self.workdir / "xdg"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")])),
            "NONINTERACTIVE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        return env | extra

    # -- exporter processes --------------------------------------------------------------
    def start_exporter(self, config: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``jmp run --exporter-config CONFIG``; output goes to ``proc.log_path``; stopped at teardown."""
        name = yaml.safe_load(config.read_text())["metadata"]["name"]
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        log_path = logs / f"{name}-{len(self.processes)}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen([str(BIN / "jmp"), "run", "--exporter-config", str(config)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env() | (env or {}))
        proc.log_path = log_path  # type: ignore[attr-defined]
        self.processes.append(proc)
        self._procs_by_name[name] = proc
        return proc

    @staticmethod
    def log_text(proc: subprocess.Popen) -> str:
        path: Path = proc.log_path  # type: ignore[attr-defined]
        return path.read_text(errors="replace") if path.exists() else ""

    # -- waiting on recorded state -------------------------------------------------------
    def _wait(self, name: str, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        proc = self._procs_by_name.get(name)
        with self.registry.cond:
            while not (result := pred()):
                left = deadline - time.monotonic()
                if left <= 0 or (proc is not None and proc.poll() is not None):
                    tail = self.log_text(proc)[-3000:] if proc is not None else ""
                    rc = proc.poll() if proc is not None else None
                    raise TimeoutError(f"{what} (exporter {name}: exit={rc}, "
                                       f"status log={self.status_log(name)})\n{tail}")
                self.registry.cond.wait(min(left, 0.2))
        return result

    def exporter(self, name: str) -> ExporterRecord | None:
        return self.registry.exporters.get(name)

    def wait_registered(self, name: str, timeout: float = 30) -> ExporterRecord:
        """Registered and its Status stream open (i.e. leasable once AVAILABLE)."""
        def ok() -> ExporterRecord | None:
            x = self.registry.exporters.get(name)
            return x if x is not None and x.registered and x.online else None
        return self._wait(name, ok, timeout, f"{name} did not register within {timeout} s")

    def wait_status(self, name: str, status: str, timeout: float = 30, since: float = 0.0) -> float:
        """Monotonic time of the first ``status`` report at or after ``since``."""
        def ok() -> float | None:
            x = self.registry.exporters.get(name)
            return next((t for t, s, _ in (x.status_log if x else ()) if s == status and t >= since), None)
        return self._wait(name, ok, timeout, f"{name} did not report {status} within {timeout} s")

    def wait_event(self, name: str, prefix: str, timeout: float = 30, since: float = 0.0) -> float:
        """Monotonic time of the first event (``register``, ``unregister: ...``, ``status stream closed``)."""
        def ok() -> float | None:
            x = self.registry.exporters.get(name)
            return next((t for t, e in (x.events if x else ()) if e.startswith(prefix) and t >= since), None)
        return self._wait(name, ok, timeout, f"{name}: no event {prefix!r} within {timeout} s")

    def status_log(self, name: str) -> list[tuple[float, str]]:
        with self.registry.cond:
            x = self.registry.exporters.get(name)
            return [(t, s) for t, s, _ in x.status_log] if x else []

    async def wait_registered_async(self, name: str, timeout: float = 30) -> ExporterRecord:
        return await asyncio.to_thread(self.wait_registered, name, timeout)

    async def wait_status_async(self, name: str, status: str, timeout: float = 30, since: float = 0.0) -> float:
        return await asyncio.to_thread(self.wait_status, name, status, timeout, since)

    # -- leases from the test side ----------------------------------------------------------
    def create_lease(self, exporter: str = "", *, client: str = "c", selector: str = "",
                     duration: timedelta = timedelta(minutes=30)) -> str:
        rec = self.call(self.registry.create_lease, client=client, exporter_name=exporter,
                        selector=selector, duration=duration)
        return rec.name

    def release(self, lease: str) -> float:
        """End a lease as the controller would (``leased=False`` to the exporter); monotonic time."""
        rec = self.call(self.registry.release, lease, "test")
        return rec.released_at

    @contextlib.contextmanager
    def lease(self, exporter: str, *, client: str = "c", duration: timedelta = timedelta(minutes=30),
              timeout: float = 30) -> Iterator[LeaseHandle]:
        """Lease ``exporter`` for ``client``; yields a :class:`LeaseHandle`; releases on exit."""
        name = self.create_lease(exporter, client=client, duration=duration)
        handle = LeaseHandle(self, name, exporter, client, self.client_config(client))
        try:
            self._wait(exporter, lambda: self.registry.leases[name].exporter, timeout,
                       f"lease {name} was not assigned within {timeout} s")
            yield handle
        finally:
            handle.released_at = self.release(name)


def _descendants(pid: int) -> list[int]:
    """Child processes of ``pid`` (recursively), read from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return [d for c in children for d in (c, *_descendants(c))]


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> int:
    """SIGTERM ``jmp run`` (it forwards the signal to its child); if it is still alive after
    ``timeout``, SIGKILL its descendants and then it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in _descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait(5)
    return proc.returncode
