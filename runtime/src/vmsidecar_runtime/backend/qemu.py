"""Direct QEMU backend: one process per boot, one persistent QMP connection, events.

"Process up" and "guest running" are separate steps: QEMU starts paused (``-S``), the runtime
attaches to every console, then ``resume()`` sends ``cont``. QMP events are mapped to
``BackendEvent`` (``map_qmp_event``); the process's end is ``EXITED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from qemu.qmp import EventListener, QMPClient
from qemu.qmp.error import QMPError
from qemu.qmp.message import Message

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import PortForward, VmSpec
from vmsidecar_contract.state import ExitInfo

from .. import confinement
from ..plan import BootPlan, shared_with_another_qemu
from ..procs import Child, exiting_or_gone, spawn, threads_cpu_seconds
from ..stream_pipes import StreamPipe, StreamPipes
from .base import BackendEvent, EventSink, register_shared
from .common import emulator_path, hostfwd_rule, listening_sockets, qemu_binary
from .guest_agent import GuestAgent, hold
from .netguard import NetGuard, guarded
from .qemu_argv import DISK_NODE, GUEST_AGENT_PORT_ID, NETDEV_ID, build_argv, piped_streams

log = logging.getLogger(__name__)
#: QEMU's output lines logged one by one per process; after them, one line every OUTPUT_EVERY seconds
#: counts the rest: the guest can make QEMU print without end (a virtio-serial control message naming
#: no port is one ``error_report`` each), which must not become the runtime's log flood
OUTPUT_LOGGED = 50
OUTPUT_EVERY = 10.0

#: bound on writing or loading a memory snapshot (hundreds of MB at disk speed)
MIGRATION_TIMEOUT_S = 120.0
#: the QMP events ``map_qmp_event`` understands
QMP_EVENTS = ("SHUTDOWN", "POWERDOWN", "RESET", "STOP", "RESUME", "GUEST_PANICKED", "BLOCK_IO_ERROR")
#: the QMP events the listener asks QEMU for: those, and VSERPORT_CHANGE, which the backend keeps
#: to itself (``guest_agent_open``)
LISTENED_EVENTS = (*QMP_EVENTS, "VSERPORT_CHANGE")
#: the migration bandwidth of every snapshot save: QEMU's default (128 MiB/s) is meant for a live
#: migration sharing a network; a save to a local file of a paused guest has nothing to share
#: (issue 23: 96 MB in 0.75 s throttled, 0.16 s lifted). QEMU takes bytes per second.
UNTHROTTLED = 1 << 40
#: SHUTDOWN causes after which QEMU exits despite ``-no-shutdown`` (QMP ``quit`` and a host signal
#: override it): the guest is not "powered off and waiting"; the EXITED that follows decides
EXITING_CAUSES = frozenset({"host-qmp-quit", "host-signal"})
#: QEMU 7.2's words when the guest's RAM cannot be allocated (its own anonymous RAM: physmem.c's
#: ``qemu_ram_alloc_internal``; a file or memfd backend's mapping: ``file_ram_alloc``)
RAM_REFUSED = ("cannot set up guest memory", "unable to map backing store for guest RAM")
#: QEMU 7.2's words for a machine type or CPU model it does not have (the spec checks only their form)
NO_SUCH_MODEL = {"machine": "unsupported machine type", "cpu": "unable to find CPU model"}
#: QEMUs that quit and are exiting while the runtime goes on (``QemuBackend.quit``): reaped by
#: these tasks, which ``close_backends`` waits for at the runtime's exit
_EXITING: set[asyncio.Task[None]] = set()
_SIMPLE = {
    "POWERDOWN": BackendEvent.POWERDOWN_REQUESTED,
    "STOP": BackendEvent.PAUSED,
    "RESUME": BackendEvent.RESUMED,
    "GUEST_PANICKED": BackendEvent.PANICKED,
}


def map_qmp_event(name: str, data: dict[str, Any]) -> tuple[BackendEvent, dict[str, Any]] | None:
    """The ``BackendEvent`` (and its data) for a QMP event, or None when it is not reported."""
    if name == "SHUTDOWN":
        reason = str(data.get("reason", "guest-shutdown"))
        if reason in EXITING_CAUSES:
            return None
        return BackendEvent.POWERED_OFF, {"reason": reason, "guest": bool(data.get("guest", True))}
    if name == "RESET":
        return BackendEvent.RESET, {"guest": bool(data.get("guest", False))}
    if name == "BLOCK_IO_ERROR":
        return BackendEvent.IO_ERROR, {"operation": str(data.get("operation", "")), "action": str(data.get("action", "")),
                                       "nospace": bool(data.get("nospace", False)),
                                       "reason": str(data.get("reason", ""))}
    if name in _SIMPLE:
        return _SIMPLE[name], {}
    return None


async def exits_done() -> None:
    """Until every QEMU left exiting by ``QemuBackend.quit`` is reaped (``close_backends``; a state
    volume too full for the next overlay until an exiting QEMU closes the last, ``Disks.overlay``)."""
    while _EXITING:
        await asyncio.gather(*_EXITING, return_exceptions=True)


def _log_late_failure(reply: asyncio.Future[Any]) -> None:
    if not reply.cancelled() and (error := reply.exception()) is not None:
        log.warning("QEMU answered cont with an error after it resumed the guest: %s", error)


def _poll_waits() -> Iterator[float]:
    """Seconds between polls of a migration: a templated snapshot's device state is saved or loaded
    in ~5-20 ms, a full stream's RAM in seconds; a fixed 10-20 ms made the short one wait for the
    poll (a recycle's restore, a capture's pause)."""
    wait = 0.001
    while True:
        yield wait
        wait = min(wait * 2, 0.02)



class _QmpClient(QMPClient):
    """qemu.qmp's client, but its default listener (``events``: every event, kept in a history and a
    queue nothing here reads) hears nothing. A guest can make QEMU emit events without end (a loop
    writing the ACPI CPU hotplug _OST status: ACPI_DEVICE_OST is not among the events QEMU throttles),
    and each stayed in the runtime's memory for as long as its QEMU ran (~1.9 KB an event). The
    listeners are qemu.qmp's own list, which it offers no way to dispatch past but this method."""

    async def _event_dispatch(self, msg: Message) -> None:
        for listener in self._listeners:
            if listener is not self.events:
                await listener.put(msg)


class _Events(EventListener):
    """An event listener that keeps no history (qemu.qmp's keeps every event it accepted): the pump
    reads each as it comes."""

    async def put(self, event: Message) -> None:
        if self.accept(event):
            await self._queue.put(event)

class QemuBackend:
    """Runs one QEMU process for one boot plan."""

    name = "qemu"
    label = "QEMU"
    supports_snapshots: ClassVar[bool] = True
    continues_after_save: ClassVar[bool] = True

    def __init__(self, plan: BootPlan, on_event: EventSink) -> None:
        self.plan = plan
        self._on_event = on_event
        self._proc: Child | None = None
        self._qmp: QMPClient | None = None
        self._stderr: deque[str] = deque(maxlen=20)
        self._tasks: list[asyncio.Task[None]] = []
        #: the readers of QEMU's stdout and stderr, and the watcher of its end (``_watch_exit``),
        #: which waits for the readers to reach the pipes' end
        self._readers: list[asyncio.Task[None]] = []
        self._watcher: asyncio.Task[None] | None = None
        self.exit_info: ExitInfo | None = None
        self._exited = asyncio.Event()
        #: the SHUTDOWN cause when QEMU announced a host-side end (``EXITING_CAUSES``)
        self._host_shutdown = ""
        #: the runtime's side of the NIC's filter (``netguard``), attached before the guest runs
        self._guard: NetGuard | None = None
        #: the guest holds the guest agent's port open (QMP VSERPORT_CHANGE): an agent runs
        self.guest_agent_open = False
        self.guest_agent: GuestAgent | None = None
        #: this process's virtio console pipes, until the hubs take the runtime's ends
        self._pipes: StreamPipes | None = None
        #: the runtime's connections to this process's console sockets, until the hubs take them
        self._held: dict[str, socket.socket] = {}
        #: the process's end is reported (EXITED); not once ``quit`` left it exiting on its own
        self._reports_exit = True

    # ---- launch --------------------------------------------------------------------------
    async def launch(self, *, load: bool = True, qmp_timeout: float = 30.0) -> None:
        """Start QEMU paused and connect QMP; restore ``plan.incoming`` unless ``load`` is False.

        :raise HostError: when the QEMU binary is missing or QEMU exits before QMP answers.
        """
        emulator = emulator_path(self.plan.spec.arch)  # fail early, naming the package, when QEMU is missing
        argv = build_argv(self.plan)
        log.info("starting %s", " ".join(argv))
        for left in listening_sockets(argv):  # a confined QEMU cannot remove its predecessor's
            if left.is_socket():
                left.unlink(missing_ok=True)
        self._pipes = StreamPipes(self.plan.stream_pipe, piped_streams(self.plan.spec))
        ram_fd = (self.plan.ram.fd,) if self.plan.ram is not None and self.plan.ram.fd is not None else ()
        try:
            with confinement.domain(confinement.qemu_rules(self.plan, emulator)) as ruleset:
                self._proc = await spawn(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,  # a Ctrl-C on the runtime's terminal must not kill QEMU behind its back
                    die_with_parent=True,
                    no_capabilities=True,
                    confine=ruleset,
                    pass_fds=(*ram_fd, *self._pipes.qemu_fds),
                )
        except BaseException:
            self._pipes.close()
            raise
        self._pipes.close_qemu_ends()
        self._readers = [asyncio.create_task(self._collect(self._proc.stdout), name="qemu-stdout"),
                         asyncio.create_task(self._collect(self._proc.stderr), name="qemu-stderr")]
        self._watcher = asyncio.create_task(self._watch_exit(), name="qemu-wait")
        await self._connect_qmp(qmp_timeout)
        self._pipes.remove_links()  # QEMU has opened its chardevs
        await self._hold_sockets()
        # held before a restore's load, so QEMU accepts it while the load's commands run and the
        # restored guest never hears the host side close (guest_agent's docstring)
        self.guest_agent = await hold(self.plan.guest_agent_socket)
        if guarded(self.plan):
            self._guard = NetGuard(self.plan)
            await self._guard.attach()
        if self.plan.incoming is not None and load:
            await self._restore(self.plan.incoming)

    async def load(self) -> None:
        assert self.plan.incoming is not None, "load() is for a QEMU started with an incoming snapshot"
        await self._restore(self.plan.incoming)

    def upstream(self, name: str) -> Path | StreamPipe | socket.socket:
        """Where the runtime reads and writes stream ``name``: the runtime's ends of its pipes, or
        its connection to QEMU's socket, held since the launch (the caller owns either from now
        on); QEMU's socket once they were taken."""
        pipe = self._pipes.take(name) if self._pipes is not None else None
        held = self._held.pop(name, None)
        return pipe or held or self.plan.console_socket(name)

    async def _hold_sockets(self) -> None:
        # QEMU serves each console socket to one client: whoever connects first has the guest's
        # console (a same-UID process, a QEMU a guest escaped into: a connect by path is not
        # confined), until the runtime attaches, which for a standby spare is at the next recycle
        loop = asyncio.get_running_loop()
        piped = piped_streams(self.plan.spec)
        for name in (name for name in self.plan.stream_names if name not in piped):
            held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.setblocking(False)
            try:
                await loop.sock_connect(held, str(self.plan.console_socket(name)))
            except OSError as e:  # (the hub connects by path at its attach, as it would have)
                log.warning("QEMU's socket for %s could not be held from its start (%s)", name, e)
                held.close()
                continue
            self._held[name] = held

    async def _collect(self, stream: asyncio.StreamReader | None) -> None:
        assert stream is not None
        await collect_output(stream, self._stderr)

    async def _watch_exit(self) -> None:
        assert self._proc is not None
        rc = await self._proc.wait()
        with contextlib.suppress(asyncio.TimeoutError):
            # let the pipes flush so the exit message carries QEMU's last words
            await asyncio.wait_for(asyncio.gather(*self._readers), 2)
        self.exit_info = ExitInfo(
            returncode=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None,
            stderr_tail=list(self._stderr),
            reason=self._host_shutdown,
        )
        self._exited.set()
        if not self._reports_exit:
            return
        data: dict[str, Any] = {"returncode": rc} if rc >= 0 else {"signal": -rc}
        if self._host_shutdown:
            data["reason"] = self._host_shutdown
        self._on_event(BackendEvent.EXITED, data)

    async def _connect_qmp(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        qmp = _QmpClient("vmsidecar")
        while True:
            if self._exited.is_set():
                raise HostError(self._early_exit_message())
            try:
                if not self.plan.qmp_socket.exists():  # qemu.qmp logs every refused attempt as an error
                    raise FileNotFoundError(self.plan.qmp_socket)
                await qmp.connect(str(self.plan.qmp_socket))
                break
            except (QMPError, OSError):
                if loop.time() > deadline:
                    await self.kill()
                    raise HostError(
                        f"QEMU did not open its QMP socket within {timeout:.0f} s; "
                        "check the runtime log for QEMU's stderr"
                    ) from None
                # QEMU creates the socket ~0.05-0.1 s after its start (TCG): a coarse poll would add
                # up to its whole interval to every launch, a warm start's included
                await asyncio.sleep(0.01)
        self._qmp = qmp
        listener = _Events(LISTENED_EVENTS)
        qmp.register_listener(listener)
        self._tasks.append(asyncio.create_task(self._pump_events(listener), name="qmp-events"))

    def _early_exit_message(self) -> str:
        info = self.exit_info or ExitInfo()
        tail = " | ".join(info.stderr_tail[-5:]) or "no output"
        if (named := _spec_start_failure(self.plan.spec, tail)) is not None:
            return named
        return (
            f"QEMU exited during start-up (exit code {info.returncode}, signal {info.signal}): {tail}; "
            "fix the cause QEMU names (image, firmware or spec)"
        )

    async def _pump_events(self, listener: EventListener) -> None:
        async for event in listener:
            raw = event.get("data")
            name, data = str(event["event"]), dict(raw) if isinstance(raw, dict) else {}
            if name == "SHUTDOWN" and data.get("reason") in EXITING_CAUSES:
                self._host_shutdown = str(data["reason"])
            if name == "VSERPORT_CHANGE" and data.get("id") == GUEST_AGENT_PORT_ID:
                self.guest_agent_open = bool(data.get("open"))
            mapped = map_qmp_event(name, data)
            if mapped is not None:
                self._on_event(*mapped)

    # ---- memory snapshots ----------------------------------------------------------------
    async def _pass_file(self, path: Path, flags: int, name: str) -> None:
        # The stream goes through a file descriptor handed over QMP (getfd): QEMU's exec: would
        # need a shell, and fd: needs no path QEMU could be tricked into opening.
        assert self._qmp is not None
        fd = os.open(path, flags, 0o600)
        try:
            self._qmp.send_fd_scm(fd)
            await self._execute("getfd", fdname=name)
        finally:
            os.close(fd)

    async def _add_fds(self, path: Path, flags: tuple[int, ...]) -> int:
        """Hand QEMU descriptors of ``path`` opened with each of ``flags`` as one fd set
        (``add-fd``); its id (QEMU opens ``/dev/fdset/ID`` by taking the one of matching access)."""
        assert self._qmp is not None
        fdset: int | None = None
        for flag in flags:
            fd = os.open(path, flag | os.O_CLOEXEC)
            try:
                self._qmp.send_fd_scm(fd)
                added = await self._execute("add-fd", **({} if fdset is None else {"fdset-id": fdset}))
                fdset = int(added["fdset-id"])
            finally:
                os.close(fd)
        assert fdset is not None
        return fdset

    async def _restore(self, path: Path, timeout: float = MIGRATION_TIMEOUT_S) -> None:
        """Load a memory snapshot into the paused QEMU (it stays paused until ``resume``), once its
        seal check passed (``plan.incoming_check``): no migration starts and not one byte of the
        stream reaches QEMU before.

        :raise HostError: when the seal check failed, QEMU refuses the stream (it then exits) or
            takes too long.
        """
        if self.plan.incoming_check is not None and (problem := await self.plan.incoming_check) is not None:
            raise HostError(f"the memory snapshot was not loaded: {problem}")
        try:
            if self.plan.ram is not None:  # a templated snapshot: the RAM is the file, the stream has none
                await self._ignore_shared_ram()
            await self._pass_file(path, os.O_RDONLY, "incoming")
            await self._execute("migrate-incoming", uri="fd:incoming")
            deadline = asyncio.get_running_loop().time() + timeout
            waits = _poll_waits()
            while (await self._execute("query-status"))["status"] == "inmigrate":
                if asyncio.get_running_loop().time() > deadline:
                    raise HostError(f"restoring the memory snapshot took over {timeout:.0f} s")
                await asyncio.sleep(next(waits))
            result = await self._execute("query-migrate")
        except (QMPError, EOFError, OSError) as e:  # QEMU exits when it cannot load the stream
            await self.wait_exit(5)
            tail = " | ".join(self._stderr) or str(e)
            raise HostError(f"QEMU could not load the memory snapshot ({tail})") from e
        if result.get("status") not in (None, "completed"):
            raise HostError(f"QEMU did not load the memory snapshot ({result.get('status')})")

    async def save_state(self, path: Path, timeout: float = MIGRATION_TIMEOUT_S) -> None:
        """Pause the guest and write its RAM and device state to ``path`` (a new file); only its
        device state when its RAM is a shared file (``plan.ram``: a templated snapshot).

        :raise HostError: when QEMU cannot migrate this guest (e.g. a device that blocks migration).
        """
        try:
            await self._execute("stop")
            await self._execute("migrate-set-parameters", **{"max-bandwidth": UNTHROTTLED})
            if self.plan.ram is not None and self.plan.ram.share:
                await self._ignore_shared_ram()
            await self._pass_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "snapshot")
            await self._execute("migrate", uri="fd:snapshot")
            deadline = asyncio.get_running_loop().time() + timeout
            waits = _poll_waits()
            while (status := await self._execute("query-migrate")).get("status") not in ("completed", "failed"):
                if asyncio.get_running_loop().time() > deadline:
                    await self._execute("migrate_cancel")
                    raise HostError(f"writing the memory snapshot took over {timeout:.0f} s")
                await asyncio.sleep(next(waits))
        except QMPError as e:
            raise HostError(f"QEMU cannot snapshot this guest ({e})") from e
        if status["status"] != "completed":
            raise HostError(f"QEMU cannot snapshot this guest ({status.get('error-desc', 'migration failed')})")

    async def disk_size(self) -> int:
        """The virtual size of the guest's disk (its qcow2 node, ``disk0``)."""
        try:
            nodes = await self._execute("query-named-block-nodes", flat=True)
            return int(next(n["image"]["virtual-size"] for n in nodes if n.get("node-name") == DISK_NODE))
        except (QMPError, StopIteration, KeyError, TypeError, ValueError) as e:
            raise HostError(f"QEMU did not tell the size of the guest's disk ({e!r})") from e

    async def continue_on(self, overlay: Path) -> None:
        """Put ``overlay`` (a qcow2 made over the disk, not opened yet) on top of the guest's disk
        node (``blockdev-snapshot``: QEMU drains and flushes the disk so far and no longer writes it).

        QEMU opens the overlay without its backing (``backing: null``, as ``blockdev-snapshot``
        requires) and names the format: the qcow2 header is never probed. The overlay comes as
        descriptors (an fd set: QEMU's Landlock domain grants it no file made after its start), one
        read-write and one read-only for a reopen. The node keeps QEMU's paths as they were; the
        caller renames files afterwards (QEMU holds them open).

        :raise HostError: QEMU refused; the guest stays on its disk and nothing was added.
        """
        node = f"{DISK_NODE}-top"
        try:
            fdset = await self._add_fds(overlay, (os.O_RDWR, os.O_RDONLY))
            await self._execute("blockdev-add", driver="qcow2", **{"node-name": node}, backing=None,
                                file={"driver": "file", "filename": f"/dev/fdset/{fdset}"})
        except (QMPError, OSError) as e:
            raise HostError(f"QEMU cannot open the new overlay {overlay} ({e})") from e
        try:
            await self._execute("blockdev-snapshot", node=DISK_NODE, overlay=node)
        except QMPError as e:
            with contextlib.suppress(QMPError):
                await self._execute("blockdev-del", **{"node-name": node})
            raise HostError(f"QEMU cannot move the guest's writes to a new overlay ({e})") from e

    async def _ignore_shared_ram(self) -> None:
        # x-ignore-shared: a shared RAM block is neither written nor loaded (it is the file); both
        # ends of a templated snapshot set it (QEMU's docs: "VM templating")
        await self._execute("migrate-set-capabilities",
                            capabilities=[{"capability": "x-ignore-shared", "state": True}])

    # ---- guest control -------------------------------------------------------------------
    def _connected(self) -> QMPClient:
        if self._qmp is None:
            raise HostError("QEMU is not running; power the VM on first")
        return self._qmp

    async def _execute(self, cmd: str, **args: Any) -> Any:
        return await self._connected().execute(cmd, args or None)

    async def resume(self) -> None:
        """Let the guest run (``cont``); over at QEMU's RESUME event.

        QEMU sends RESUME as it starts the vCPUs, and the reply to ``cont`` only after its VM-state
        handlers and a turn of its main loop: 25 ms later under TCG, a quarter of a recycle. An
        error comes as the reply, before any RESUME; a reply that comes after RESUME is only logged.
        """
        qmp = self._connected()
        listener = EventListener("RESUME")
        with qmp.listen(listener):
            reply = asyncio.ensure_future(qmp.execute("cont"))
            resumed = asyncio.ensure_future(listener.get())
            try:
                await asyncio.wait({reply, resumed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                resumed.cancel()
        if reply.done():
            reply.result()  # the error QEMU refused cont with, if any
        else:
            reply.add_done_callback(_log_late_failure)

    async def add_forward(self, forward: PortForward, port: int) -> None:
        """Slirp's rules change only through HMP's ``hostfwd_add`` (QMP has no command for them): one
        line made of the validated spec's address and port numbers."""
        failed = await self._execute("human-monitor-command",
                                     **{"command-line": f"hostfwd_add {NETDEV_ID} {hostfwd_rule(forward, port)}"})
        if failed.strip():  # HMP answers nothing when the rule is set
            raise HostError(f"the forward {forward.name!r} could not be bound to host port {port} ({failed.strip()})")

    async def powerdown(self) -> None:
        """Ask the guest to power off (ACPI power button; QEMU reports POWERDOWN)."""
        await self._execute("system_powerdown")

    async def reset(self) -> None:
        """Hard reset the guest, like a reset button."""
        await self._execute("system_reset")

    def vcpu_seconds(self) -> float | None:
        if not self.alive:
            return None
        assert self._proc is not None
        return threads_cpu_seconds(self._proc.pid, "CPU ")  # "CPU 0/TCG", "CPU 0/KVM": -name debug-threads=on

    @property
    def alive(self) -> bool:
        """Whether the QEMU process is still running."""
        return self._proc is not None and not self._exited.is_set()

    async def wait_exit(self, timeout: float | None = None) -> bool:
        """Wait for the process to end; False on timeout."""
        try:
            await asyncio.wait_for(self._exited.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def quit(self, timeout: float = 5.0, *, reaped: bool = True) -> None:
        """Stop QEMU: ``quit`` over QMP, then SIGTERM, then SIGKILL, each bounded.

        After ``quit`` QEMU stops its vCPUs, closes its disks, its network (a forward's host port),
        its monitor, chardevs and objects, then exits; the kernel then frees its memory, which took
        0.12 s for a guest with 1.5 GiB written (every 4 KiB page unmapped), and as long after a
        lease that wrote as much. Once QEMU has entered its exit (``PF_EXITING``) it holds nothing
        a next boot needs but that memory, and the space of a disk unlinked meanwhile (the kernel
        closes its files after freeing its memory: ``exits_done``): unless ``reaped``, it is reaped in a task
        (``close_backends`` waits for it) and reports nothing more, so a recycle does not wait for
        the kernel. Not for a GPIO device or a native CAN bus: the runtime's vhost-user backend and
        the host's interface are shared with the next QEMU, and their sockets may close only with
        the process."""
        if self.alive and self._qmp is not None:
            with contextlib.suppress(QMPError, OSError, EOFError, asyncio.TimeoutError):
                await asyncio.wait_for(self._qmp.execute("quit"), timeout)
            if (not reaped and shared_with_another_qemu(self.plan.spec) is None
                    and await self._entered_exit(timeout)):
                self._reap_beside()
                await self.close()
                return
        if not await self.wait_exit(timeout) and self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)
            if not await self.wait_exit(timeout):
                await self.kill()
        await self.close()

    async def _entered_exit(self, timeout: float) -> bool:
        """Until QEMU is in its exit (or gone); False after ``timeout``. Its own clean-up after the
        monitor closed takes milliseconds."""
        assert self._proc is not None
        deadline = asyncio.get_running_loop().time() + timeout
        waits = _poll_waits()
        while not (self._exited.is_set() or exiting_or_gone(self._proc.pid)):
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(next(waits))
        return True

    def _reap_beside(self) -> None:
        proc = self._proc
        assert proc is not None
        self._reports_exit = False  # and ``close`` leaves the exit's watcher and readers to this reap

        async def reap() -> None:
            if not await self.wait_exit(30):  # an exit stuck in the kernel: nothing more to do than ask again
                log.warning("QEMU (pid %d) has not finished its exit 30 s after quit; killing it", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await self.wait_exit()

        task = asyncio.create_task(reap(), name=f"qemu-exit-{proc.pid}")
        _EXITING.add(task)
        task.add_done_callback(_EXITING.discard)
        register_shared("qemu-exits", exits_done)

    async def kill(self) -> None:
        """SIGKILL QEMU and wait for it."""
        if self._proc is not None and self.alive:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self.wait_exit(10)

    async def close(self) -> None:
        """Drop the QMP connection, the NIC's filter, the pipes nobody took and helper tasks (the
        process must be gone)."""
        if self._pipes is not None:
            self._pipes.close()
            self._pipes = None
        for held in self._held.values():
            held.close()
        self._held.clear()
        if self.guest_agent is not None:
            await self.guest_agent.close()
            self.guest_agent = None
        if self._guard is not None:
            await self._guard.close()
            self._guard = None
        if self._qmp is not None:
            with contextlib.suppress(Exception):
                await self._qmp.disconnect()
            self._qmp = None
        tasks = list(self._tasks)
        # reaped beside the next boot (``_reap_beside``), the exit's watcher and readers outlive this:
        # reaped means the process *and* its pipes read to their end (a pipe left open when the loop
        # closes is a transport collected on a closed loop, "Event loop is closed", seen in the suite)
        if self._reports_exit:
            tasks += [t for t in (*self._readers, self._watcher) if t is not None]
        for task in tasks:
            if not task.done():
                task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []


async def collect_output(stream: asyncio.StreamReader, tail: deque[str]) -> None:
    """Read QEMU's stdout or stderr to its end into ``tail`` (the exit's last words), logging the
    first :data:`OUTPUT_LOGGED` lines, then a count every :data:`OUTPUT_EVERY` seconds."""
    logged = held = 0
    said = time.monotonic()
    text = ""
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # past the reader's 64 KiB: dropped, and the reading goes on (else QEMU blocks)
            line = b"(a line longer than 64 KiB, not kept)\n"
        if not line:
            break
        text = line.decode(errors="replace").rstrip()
        tail.append(text)
        if logged < OUTPUT_LOGGED:
            logged += 1
            log.warning("qemu: %s", text)
            continue
        held += 1
        if time.monotonic() - said >= OUTPUT_EVERY:
            log.warning("qemu: %d more lines (the last: %.200s)", held, text)
            held, said = 0, time.monotonic()
    if held:
        log.warning("qemu: %d more lines (the last: %.200s)", held, text)


def _spec_start_failure(spec: VmSpec, tail: str) -> str | None:
    """QEMU's start-up failures whose fix is a spec field: the field, its value and the fix, with
    QEMU's words (``tail``); None for the others, whose fix is in QEMU's words alone."""
    if any(words in tail for words in RAM_REFUSED):
        return (f"QEMU could not allocate the guest's {spec.memory} MiB of RAM ({tail}): this host, or the pod's "
                "memory limit, cannot give that much; lower the spec's memory (memory:, VMSIDECAR_MEMORY) or run "
                "the guest where there is more")
    for field, words in NO_SUCH_MODEL.items():
        if words in tail and (value := getattr(spec, field)):
            env = f"VMSIDECAR_{field.upper()}"
            return (f"the spec's {field} '{value}' is not one this QEMU has ({tail}); leave {field} out for the "
                    f"default, or name one `{qemu_binary(spec.arch)} -{field} help` lists ({field}:, {env})")
    return None
