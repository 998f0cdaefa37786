"""``LibvirtBackend``: a ``Backend`` over libvirt-python (the ``libvirt`` extra).

The domain is transient (``createXML``) and created paused, so the console hubs attach before
``resume()``. libvirt's lifecycle and reboot callbacks arrive in libvirt's event thread, are
handed to the asyncio loop and mapped to ``BackendEvent`` (``map_lifecycle``); every libvirt call
runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import PortForward
from vmsidecar_contract.state import ExitInfo

from ... import confinement
from ...confinement import READ_WRITE, Rule
from ...libvirt_emulator import RULES_ENV, encode_rules
from ...plan import VIRTIO_CONSOLE, BootPlan
from ...stream_pipes import ConsoleFifos, StreamPipe
from ..base import BackendEvent, EventSink
from ..common import emulator_path
from ..netguard import NetGuard, guarded
from . import connection
from .daemon import import_libvirt
from .xml import bound_sockets, render_domain

if TYPE_CHECKING:
    from ..guest_agent import GuestAgent

log = logging.getLogger(__name__)

# virDomainEventType and details: stable libvirt ABI numbers, so this module imports without libvirt
_SUSPENDED, _RESUMED, _STOPPED, _SHUTDOWN, _CRASHED = 3, 4, 5, 6, 8
#: SHUTDOWN detail HOST: QEMU ended on a signal (a destroy); the STOPPED that follows decides
_SHUTDOWN_HOST = 2
_STOPPED_REASON = {0: "shutdown", 1: "destroyed", 2: "crashed", 3: "migrated", 4: "saved", 5: "failed",
                   6: "from-snapshot"}


def map_lifecycle(event: int, detail: int) -> tuple[BackendEvent, dict[str, Any]] | None:
    """The ``BackendEvent`` (and its data) for a libvirt lifecycle event, or None when it is not
    reported. ``EXITED`` carries the reason the domain stopped (libvirt knows no exit status)."""
    if event == _SUSPENDED:
        return BackendEvent.PAUSED, {}
    if event == _RESUMED:
        return BackendEvent.RESUMED, {}
    if event == _SHUTDOWN and detail != _SHUTDOWN_HOST:
        # FINISHED (0: the QEMU did not say who asked) or GUEST (1): the guest powered itself off
        return BackendEvent.POWERED_OFF, {"reason": "guest-shutdown", "guest": True}
    if event == _CRASHED:
        return BackendEvent.PANICKED, {}
    if event == _STOPPED:
        return BackendEvent.EXITED, {"reason": f"domain stopped: {_STOPPED_REASON.get(detail, str(detail))}"}
    return None


class LibvirtBackend:
    """One transient libvirt domain for one boot plan."""

    name = "libvirt"
    label = "the libvirt domain"
    #: libvirt's own save/restore (virDomainSave) is not wired in yet: recycles boot cold
    supports_snapshots: ClassVar[bool] = False
    continues_after_save: ClassVar[bool] = False

    def __init__(self, plan: BootPlan, on_event: EventSink) -> None:
        """Check libvirt-python is there; nothing starts before ``launch``.

        :raise HostError: naming the fix when libvirt-python (the ``libvirt`` extra) is missing.
        """
        self._libvirt = import_libvirt()  # fail at once, with the fix, when the extra is missing
        self.plan = plan
        self._on_event = on_event
        self.domain_name = f"vmsidecar-{plan.run_dir.name.removeprefix('vmsidecar-')}"
        self.exit_info: ExitInfo | None = None
        #: never asked: this backend has no memory snapshots (``supports_snapshots``)
        self.guest_agent_open = False
        self.guest_agent: GuestAgent | None = None  # the domain has no agent channel: no snapshot's clock to set
        self._exited = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: connection.Connection | None = None
        self._dom: Any = None
        self._unsubscribe: Callable[[], None] | None = None
        self._remove_close_cb: Callable[[], None] | None = None
        self.create_seconds: float | None = None
        self._log_offset = 0
        #: our reset() calls whose reboot event has not arrived yet (libvirt's event does not say who)
        self._own_resets = 0
        #: the runtime's side of the NIC's filter (``netguard``), attached before the guest runs
        self._guard: NetGuard | None = None
        #: the virtio console's named pipes (private daemon) and the runtime's ends, until a hub takes them
        self._console_fifos: ConsoleFifos | None = None
        self._console_ends: StreamPipe | None = None

    @property
    def uri(self) -> str | None:
        """The libvirt URI this boot uses (set after ``launch``)."""
        return self._conn.uri if self._conn else None

    # ---- launch --------------------------------------------------------------------------
    def upstream(self, name: str) -> Path | StreamPipe:
        """Where the runtime reads and writes stream ``name``: the virtio console's named pipes
        (the caller owns the ends from now on) under the private daemon, else the domain's socket."""
        if name == VIRTIO_CONSOLE and self._console_ends is not None:
            ends, self._console_ends = self._console_ends, None
            return ends
        return self.plan.console_socket(name)

    async def launch(self, *, load: bool = True) -> None:
        """Create the domain paused (``load``: no snapshot ever is: ``supports_snapshots``).

        :raise HostError: when libvirt refuses the domain or the daemon is unreachable.
        """
        libvirt = self._libvirt
        self._loop = asyncio.get_running_loop()
        self._conn = await connection.connect(self.plan.spec.libvirt_uri, self.plan.run_dir)
        conn = self._conn.conn
        # QEMU drops what the guest writes on hvc0 that its chardev cannot take: named pipes hold 64 KiB
        # of small writes, a socket ~200 (stream_pipes.py). Only under the private daemon: QEMU then
        # runs as this UID and the pipes stay 0600 (a system daemon's QEMU has a user of its own).
        piped = self._conn.daemon is not None and self.plan.spec.virtio_console
        if piped:
            try:
                self._console_fifos = ConsoleFifos(self.plan.stream_pipe(VIRTIO_CONSOLE))
            except OSError as e:
                await self.close()
                raise HostError(f"the guest's virtio console pipes could not be made in {self.plan.run_dir} "
                                f"({e.strerror or e}); free the run directory's volume, or set virtio_console: false") from e
        if self._conn.daemon is not None:  # its QEMU without a capability, in the plan's Landlock domain
            emulator = self._conn.daemon.emulator(emulator_path(self.plan.spec.arch))
            xml = render_domain(self.plan, self.domain_name, piped_console=piped, emulator=str(emulator),
                                qemu_env=self._confinement())
        else:  # an external daemon's QEMU is its own to confine
            xml = render_domain(self.plan, self.domain_name)
        for left in bound_sockets(xml):  # an earlier boot's, which a confined QEMU cannot remove
            if left.is_socket():
                left.unlink(missing_ok=True)
        if self._conn.daemon is None and self.plan.run_dir.stat().st_mode & 0o777 != 0o777:
            # a system daemon runs QEMU as its own user, which must create the console sockets here
            self.plan.run_dir.chmod(0o1777)
        self._unsubscribe = self._conn.subscribe(self.domain_name, self._domain_event)
        self._remove_close_cb = self._conn.on_close(self._connection_lost)
        log.debug("domain XML:\n%s", xml)
        log_path = self._conn.log_path(self.domain_name)
        with contextlib.suppress(OSError):
            self._log_offset = log_path.stat().st_size if log_path else 0  # the log is per name, appended
        started = time.monotonic()
        try:
            self._dom = await asyncio.to_thread(conn.createXML, xml, libvirt.VIR_DOMAIN_START_PAUSED)
        except libvirt.libvirtError as e:
            await self.close()
            tail = " | ".join(self._log_tail()[-3:])
            raise HostError(f"libvirt could not start the domain ({e}{'; ' + tail if tail else ''}); "
                            "fix the cause libvirt names (image, firmware or spec)") from e
        self.create_seconds = round(time.monotonic() - started, 3)
        if self._console_fifos is not None:
            try:
                self._console_ends = self._console_fifos.open()
            except OSError as e:
                await self.quit()
                raise HostError(f"the guest's virtio console pipes could not be opened ({e}); "
                                "power on again, or set virtio_console: false") from e
        log.info("libvirt domain %s created paused in %.2f s on %s", self.domain_name, self.create_seconds,
                 self._conn.uri)
        if not await asyncio.to_thread(self._is_active):
            self._mark_exited("the domain ended right after start")
        elif guarded(self.plan):
            self._guard = NetGuard(self.plan)
            await self._guard.attach()

    def _confinement(self) -> dict[str, str]:
        """What ``libvirt_emulator`` confines the private daemon's QEMU with beyond its own rules:
        the files of the boot plan (``confinement.plan_rules``) and the console's named pipes; or
        nothing, said so, when the administrator turned confinement off."""
        if not confinement.wanted():
            return {confinement.ENV: "off"}
        fifos = self._console_fifos
        pipes = [Rule(p, READ_WRITE) for p in (fifos.input, fifos.output)] if fifos is not None else []
        return {RULES_ENV: encode_rules([*confinement.plan_rules(self.plan), *pipes])}

    # ---- events (libvirt's event thread → asyncio) ---------------------------------------
    def _domain_event(self, kind: str, event: int, detail: int) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the runtime is exiting
            if kind == "reboot":  # QEMU's RESET, ours or the guest's
                self._loop.call_soon_threadsafe(self._handle_reboot)
            else:
                self._loop.call_soon_threadsafe(self._handle_lifecycle, event, detail)

    def _connection_lost(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._mark_exited, "the libvirt connection closed")

    def _emit(self, event: BackendEvent, data: dict[str, Any]) -> None:
        if not self._exited.is_set():  # nothing of a domain is reported after its end
            self._on_event(event, data)

    def _handle_reboot(self) -> None:
        ours = self._own_resets > 0
        self._own_resets = max(0, self._own_resets - 1)
        self._emit(BackendEvent.RESET, {"guest": not ours})

    def _handle_lifecycle(self, event: int, detail: int) -> None:
        log.debug("libvirt lifecycle event %d detail %d", event, detail)
        mapped = map_lifecycle(event, detail)
        if mapped is None:
            return
        kind, data = mapped
        if kind == BackendEvent.EXITED:
            self._mark_exited(data["reason"])
        else:
            self._emit(kind, data)

    def _mark_exited(self, reason: str) -> None:
        if self._exited.is_set():
            return
        self.exit_info = ExitInfo(stderr_tail=self._log_tail(), reason=reason)
        self._exited.set()
        self._detach()
        self._on_event(BackendEvent.EXITED, {"reason": reason})

    def _log_tail(self, lines: int = 20) -> list[str]:
        """The domain log's last lines (libvirt's stand-in for QEMU's stderr)."""
        path: Path | None = self._conn.log_path(self.domain_name) if self._conn else None
        if path is None:
            return []
        try:
            with path.open("rb") as fh:
                fh.seek(self._log_offset)
                text = fh.read().decode(errors="replace")
        except OSError:
            return []
        kept = [line for line in text.splitlines() if line.strip()]
        # libvirt starts each boot's log with QEMU's command line (one argument per line): skip it
        argv_end = max((i for i, line in enumerate(kept) if line.endswith("\\") or line.startswith("-msg ")),
                       default=-1)
        return kept[argv_end + 1:][-lines:]

    # ---- guest control -------------------------------------------------------------------
    def _require_dom(self) -> Any:
        if self._dom is None or self._exited.is_set():
            raise HostError("the libvirt domain is not running; power the VM on first")
        return self._dom

    async def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return await asyncio.to_thread(fn)
        except self._libvirt.libvirtError as e:
            raise HostError(f"libvirt could not {what} ({e})") from e

    def _is_active(self) -> bool:
        try:
            return bool(self._dom is not None and self._dom.isActive())
        except self._libvirt.libvirtError:
            return False

    async def load(self) -> None:
        raise HostError("the libvirt backend has no memory snapshots to load")

    async def resume(self) -> None:
        """Let the guest run."""
        dom = self._require_dom()
        await self._call("resume the guest", dom.resume)

    async def powerdown(self) -> None:
        """Press the ACPI power button (what QMP ``system_powerdown`` does)."""
        dom = self._require_dom()
        await self._call("press the power button",
                         lambda: dom.shutdownFlags(self._libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN))
        # libvirt has no event for the button, so the one who pressed it says so
        self._emit(BackendEvent.POWERDOWN_REQUESTED, {})

    async def reset(self) -> None:
        """Hard reset, like a reset button (libvirt reports QEMU's RESET as a reboot event)."""
        dom = self._require_dom()
        self._own_resets += 1  # before the call: its reboot event may arrive before the call returns
        try:
            await self._call("reset the guest", lambda: dom.reset(0))
        except HostError:
            self._own_resets = max(0, self._own_resets - 1)
            raise

    def vcpu_seconds(self) -> float | None:
        return None  # this backend has no memory snapshots (``supports_snapshots``): nothing waits on it

    @property
    def alive(self) -> bool:
        """Whether the domain still exists."""
        return self._dom is not None and not self._exited.is_set()

    async def wait_exit(self, timeout: float | None = None) -> bool:
        """Wait for the domain to end; False on timeout."""
        try:
            await asyncio.wait_for(self._exited.wait(), timeout)
            return True
        except TimeoutError:
            if self._dom is not None and not await asyncio.to_thread(self._is_active):
                self._mark_exited("domain gone")  # the event was lost (connection hiccup)
                return True
            return False

    async def save_state(self, path: Path) -> None:
        """Not supported on this backend yet.

        :raise HostError: always, naming the way out.
        """
        raise HostError("the libvirt backend has no memory snapshots yet; recycles boot cold "
                        "(use backend: qemu for sub-second recycles)")

    async def add_forward(self, forward: PortForward, port: int) -> None:
        raise HostError("the libvirt backend has no memory snapshots, so no spare restore gets its forwards late")

    async def disk_size(self) -> int:
        raise HostError("the libvirt backend has no memory snapshots yet")

    async def continue_on(self, overlay: Path) -> None:
        raise HostError("the libvirt backend has no memory snapshots yet")

    async def quit(self, timeout: float = 5.0, *, reaped: bool = True) -> None:
        """Destroy the domain (QEMU is ended; nothing of it is left in libvirt), bounded; libvirt
        reports the domain's end once its QEMU is reaped, whatever ``reaped`` asks."""
        if self.alive:
            await self._destroy()
            await self.wait_exit(timeout)
        await self.close()

    async def kill(self) -> None:
        """Destroy the domain at once."""
        if self.alive:
            await self._destroy()
            await self.wait_exit(10)

    async def _destroy(self) -> None:
        dom = self._dom
        with contextlib.suppress(self._libvirt.libvirtError):  # already gone
            await asyncio.to_thread(dom.destroy)

    async def close(self) -> None:
        """Stop listening to the domain's events, close the NIC's filter and the console's pipes
        (the domain must be gone)."""
        self._detach()
        if self._console_ends is not None:  # never handed to a hub
            os.close(self._console_ends.output)
            os.close(self._console_ends.input)
            self._console_ends = None
        if self._console_fifos is not None:
            self._console_fifos.remove()
            self._console_fifos = None
        if self._guard is not None:
            await self._guard.close()
            self._guard = None

    def _detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._remove_close_cb is not None:
            self._remove_close_cb()
            self._remove_close_cb = None
