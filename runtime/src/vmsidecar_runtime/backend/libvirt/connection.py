"""libvirt connections and the event loop thread behind them.

One ``Connections`` per process (``CONNECTIONS``): libvirt's event implementation is process-wide,
and the boots of one runtime share a connection (to ``libvirt_uri``, or to the private daemon it
starts on first use, see ``daemon``). Every libvirt call that may be an RPC (open, close, callback
registration) runs in a worker thread, never on the asyncio loop; event callbacks run in the
event thread and are handed to asyncio by the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmsidecar_contract.errors import HostError

from ..base import register_shared
from .daemon import PrivateDaemon, import_libvirt

log = logging.getLogger(__name__)


class EventLoop:
    """libvirt's default event implementation, registered once and run in a daemon thread.

    Callbacks run in that thread; backends hand them to asyncio with ``call_soon_threadsafe``.
    libvirt's event implementation is process-wide (registered once, before the first
    connection), so the one ``Connections`` of the process owns the one ``EventLoop``.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def ensure(self) -> None:
        """Start the thread unless it runs already."""
        libvirt = import_libvirt()
        with self._lock:
            if self._thread is not None:
                return
            # libvirt prints every error to stderr by default, also the ones we expect and handle
            # (destroying a domain that just went away): errors reach us as libvirtError instead
            libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
            libvirt.virEventRegisterDefaultImpl()

            def run() -> None:
                while True:
                    try:
                        libvirt.virEventRunDefaultImpl()
                    except Exception:  # pragma: no cover - never let the loop thread die
                        log.exception("libvirt event loop")
                        time.sleep(0.1)

            self._thread = threading.Thread(target=run, name="libvirt-events", daemon=True)
            self._thread.start()




# ---- connections ----------------------------------------------------------------------------
#: handler(kind, event, detail) for one domain; kind is "lifecycle" or "reboot"
DomainHandler = Callable[[str, int, int], None]


class Connection:
    """One open libvirt connection (shared by the boots of this runtime) and what is behind it.

    It registers libvirt's lifecycle and reboot callbacks once and dispatches them by domain
    name (libvirt refuses a second registration of the same callback on one connection).
    """

    def __init__(self, conn: Any, uri: str, daemon: PrivateDaemon | None) -> None:
        """Register the callbacks on ``conn`` (RPCs: construct it in a worker thread)."""
        libvirt = import_libvirt()
        self.conn = conn
        self.uri = uri
        self.daemon = daemon
        self._on_close: set[Callable[[], None]] = set()
        self._domains: dict[str, DomainHandler] = {}
        conn.registerCloseCallback(self._closed, None)
        self._callback_ids = [
            conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._lifecycle, None),
            conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_REBOOT, self._reboot, None),
        ]

    def close(self) -> None:
        """Deregister the callbacks and close the connection (errors ignored: it may be gone).

        RPCs: call it in a worker thread.
        """
        for callback_id in self._callback_ids:
            with contextlib.suppress(Exception):
                self.conn.domainEventDeregisterAny(callback_id)
        self._callback_ids = []
        with contextlib.suppress(Exception):
            self.conn.unregisterCloseCallback()
        with contextlib.suppress(Exception):
            self.conn.close()

    def _dispatch(self, dom: Any, kind: str, event: int, detail: int) -> None:
        try:
            handler = self._domains.get(dom.name())  # the name is cached in the object: no RPC
        except Exception:  # the domain vanished meanwhile
            return
        if handler is not None:
            handler(kind, event, detail)

    def _lifecycle(self, _conn: Any, dom: Any, event: int, detail: int, _opaque: Any) -> None:
        self._dispatch(dom, "lifecycle", event, detail)

    def _reboot(self, _conn: Any, dom: Any, _opaque: Any) -> None:
        self._dispatch(dom, "reboot", 0, 0)

    def subscribe(self, domain: str, handler: DomainHandler) -> Callable[[], None]:
        """Route events of ``domain`` to ``handler`` (replacing an earlier boot's); returns the remover."""
        self._domains[domain] = handler

        def remove() -> None:
            if self._domains.get(domain) is handler:
                del self._domains[domain]

        return remove

    def _closed(self, _conn: Any, reason: int, _opaque: Any) -> None:
        log.warning("libvirt connection to %s closed (reason %d)", self.uri, reason)
        for cb in list(self._on_close):
            cb()

    def on_close(self, cb: Callable[[], None]) -> Callable[[], None]:
        """Call ``cb`` (in the event thread) if the connection drops; returns the remover."""
        self._on_close.add(cb)
        return lambda: self._on_close.discard(cb)

    def log_path(self, domain: str) -> Path | None:
        """Where QEMU's output for ``domain`` lands, when this host can read it."""
        if self.daemon is not None:
            return self.daemon.log_path(domain)
        if self.uri.startswith("qemu:///system"):
            return Path("/var/log/libvirt/qemu") / f"{domain}.log"
        return None


class Connections:
    """This process's libvirt connections, by URI (``""``: the runtime's private daemon, started on
    first use), and the event thread behind them.

    The runtime has exactly one, ``CONNECTIONS``: libvirt's event implementation is process-wide,
    the boots of one runtime share its private daemon, and ``serve`` stops that daemon at exit
    (``close_backends`` → ``close_all``) without knowing which boot started it.
    """

    def __init__(self) -> None:
        self.events = EventLoop()
        self._by_uri: dict[str, Connection] = {}
        self._lock = asyncio.Lock()  # binds to a loop only when contended (Python >= 3.10)

    async def connect(self, uri: str | None, run_dir: Path) -> Connection:
        """The connection for ``uri``; with None, to the runtime's private daemon (started on first use).

        :raise HostError: when libvirt-python is missing or the daemon cannot be reached.
        """
        libvirt = import_libvirt()
        self.events.ensure()
        key = uri or ""
        async with self._lock:
            existing = self._by_uri.get(key)
            if existing is not None and existing.conn.isAlive():  # the client's own state: no RPC
                return existing
            daemon = None
            started = False
            target = uri
            if uri is None:
                daemon = existing.daemon if existing is not None else None
                if daemon is None or daemon.proc is None or daemon.proc.returncode is not None:
                    daemon = PrivateDaemon(run_dir / "libvirt")
                    await daemon.start()
                    started = True
                target = daemon.uri
            assert target is not None
            try:
                self._by_uri[key] = await asyncio.to_thread(_open, libvirt, target, daemon)
            except libvirt.libvirtError as e:
                if started and daemon is not None:  # nobody else knows about it: do not leave it running
                    await daemon.stop()
                raise HostError(f"cannot connect to libvirt at {target} ({e}); start the daemon or fix "
                                "libvirt_uri") from e
            # the runtime's exit (``close_backends``) closes the connections and stops the private daemon
            register_shared("libvirt", self.close_all)
            log.info("libvirt URI: %s", target)
            return self._by_uri[key]

    async def close_all(self) -> None:
        """Close every connection and stop the private daemon (runtime exit)."""
        while self._by_uri:
            _key, connection = self._by_uri.popitem()
            await asyncio.to_thread(connection.close)
            if connection.daemon is not None:
                await connection.daemon.stop()


def _open(libvirt: Any, uri: str, daemon: PrivateDaemon | None) -> Connection:
    """Open ``uri`` with keepalive and register the callbacks (RPCs: run in a worker thread)."""
    conn = libvirt.open(uri)
    try:
        conn.setKeepAlive(5, 3)  # a dead daemon closes the connection (→ EXITED) instead of hanging calls
        return Connection(conn, uri, daemon)
    except BaseException:
        with contextlib.suppress(Exception):
            conn.close()
        raise


#: the runtime process's libvirt connections (see ``Connections``)
CONNECTIONS = Connections()


async def connect(uri: str | None, run_dir: Path) -> Connection:
    """``CONNECTIONS.connect``: what backends use."""
    return await CONNECTIONS.connect(uri, run_dir)


async def close_all() -> None:
    """``CONNECTIONS.close_all`` (registered with ``close_backends``, which ``serve`` calls at exit)."""
    await CONNECTIONS.close_all()
