"""What the controller needs from a backend, and the events every backend reports.

Event names say what happened to the guest (``guest.powered_off``), not which hypervisor
interface reported it: the direct QEMU backend maps QMP events, the libvirt backend maps
libvirt's lifecycle callbacks, and neither has to fake the other's names.

This module imports nothing heavy (``BootPlan`` and ``ExitInfo`` only for typing) so that
``python -m vmsidecar_runtime.backend.libvirt.nsinit`` stays a light PID 1; the backends
themselves are imported by ``create_backend`` when a boot needs one.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from vmsidecar_contract.spec import PortForward
    from vmsidecar_contract.state import ExitInfo

    from ..plan import BootPlan
    from ..stream_pipes import StreamPipe
    from .guest_agent import GuestAgent

log = logging.getLogger(__name__)


class BackendEvent(StrEnum):
    """What a backend reports; the value is also the event type published on the API."""

    #: the guest is off, the process/domain still exists; data: {"reason": str, "guest": bool}
    POWERED_OFF = "guest.powered_off"
    #: a reset happened, ours or the guest's; data: {"guest": bool}
    RESET = "guest.reset"
    #: the guest kernel panicked (pvpanic); data: {}
    PANICKED = "guest.panicked"
    #: the guest's CPUs stopped; data: {}
    PAUSED = "guest.paused"
    #: the guest's CPUs run again; data: {}
    RESUMED = "guest.resumed"
    #: the ACPI power button was pressed; data: {}
    POWERDOWN_REQUESTED = "guest.powerdown_requested"
    #: a guest disk write or read failed on the host; data: {"operation": "read"|"write", "action":
    #: "stop" (the guest is paused) | "report" (the guest got the error), "nospace": bool, "reason": str}
    IO_ERROR = "guest.io_error"
    #: the hypervisor process/domain is gone; data: {"returncode"?: int, "signal"?: int, "reason"?: str}
    EXITED = "backend.exited"


#: how a backend hands its events to the controller (always called on the asyncio loop)
EventSink = Callable[[BackendEvent, dict[str, Any]], None]


class Backend(Protocol):
    """One boot of one guest under some hypervisor; built by a ``BackendFactory``.

    A backend reports nothing after its process or domain has ended: the controller takes every
    event as its current boot's (a late EXITED of the last boot would mark the next one Crashed).
    """

    #: ``"qemu"`` | ``"libvirt"`` (the spec's ``backend`` value)
    name: str
    #: what died, for messages: ``"QEMU"`` | ``"the libvirt domain"``
    label: str
    #: whether ``save_state`` works and ``launch`` honours ``plan.incoming`` (memory snapshots); a
    #: class attribute: the snapshot decision asks it before a boot (``factory.supports_snapshots``),
    #: and without it every boot is cold, with the reason in the state's ``snapshot`` field
    supports_snapshots: ClassVar[bool]
    #: whether the guest can go on in the same process after ``save_state`` (``continue_on``): the
    #: capture of a cold boot then costs no new process and no restore; else the controller proves
    #: the snapshot by restoring it in a new one
    continues_after_save: ClassVar[bool]
    #: how the process/domain ended, once it has (``None`` while it runs)
    exit_info: ExitInfo | None
    #: the guest holds the guest agent's port open (an agent runs in it); a capture records it
    guest_agent_open: bool
    #: the runtime's session on the agent's socket, held from before the guest runs until the
    #: process ends (``guest_agent.hold``; the restored guest's clock is set through it), or None
    guest_agent: GuestAgent | None

    async def launch(self, *, load: bool = True) -> None:
        """Start the guest paused (consoles attach before ``resume``); restored from
        ``plan.incoming`` unless ``load`` is False: the process then waits with nothing loaded
        until ``load`` (a parked QEMU, ``controller/standby.py``).

        :raise HostError: when the hypervisor cannot start it.
        """

    async def load(self) -> None:
        """Restore ``plan.incoming`` into the process ``launch(load=False)`` started; it stays paused.

        :raise HostError: when the snapshot's seal check failed or the hypervisor refuses it.
        """

    def upstream(self, name: str) -> Path | StreamPipe | socket.socket:
        """Where the runtime reads and writes the guest's stream ``name`` (after ``launch``): the
        backend's private socket, a connection to it, or the runtime's ends of pipes (the caller
        then owns those two)."""
        ...

    async def resume(self) -> None:
        """Let the guest's CPUs run."""

    async def powerdown(self) -> None:
        """Press the ACPI power button (reported as ``POWERDOWN_REQUESTED``)."""

    async def reset(self) -> None:
        """Hard reset, like a reset button (reported as ``RESET`` with ``guest: False``)."""

    async def save_state(self, path: Path) -> None:
        """Pause the guest and write its RAM and device state to ``path`` (a new file).

        :raise HostError: when the backend cannot (the reason names the device or the limit).
        """
        ...

    async def add_forward(self, forward: PortForward, port: int) -> None:
        """Serve ``forward`` on host port ``port``, the guest running (a spare restore gets its
        forwards when a recycle adopts it: ``controller/standby.py``).

        :raise HostError: when the port cannot be bound.
        """
        ...

    async def disk_size(self) -> int:
        """The guest disk's virtual size in bytes (what a new overlay over it must have)."""
        ...

    async def continue_on(self, overlay: Path) -> None:
        """After ``save_state``, with the guest still paused: from now on the guest writes to
        ``overlay``, a new qcow2 whose backing is the disk so far, which is not written again.

        :raise HostError: when the backend cannot switch (the guest stays on its disk, paused).
        """

    async def quit(self, timeout: float = 5.0, *, reaped: bool = True) -> None:
        """End the process/domain, bounded, and release what the boot held. ``reaped`` False: return
        once it runs no code of its own and holds nothing a next boot needs, though the kernel may
        not have freed its memory yet (``QemuBackend.quit``); it then reports nothing more."""

    def vcpu_seconds(self) -> float | None:
        """The CPU time the guest's vCPUs have used so far (seconds); None when it cannot be read
        (a capture then does not wait for the guest to settle: ``controller/settle.py``)."""

    async def kill(self) -> None:
        """End the process/domain at once."""

    async def wait_exit(self, timeout: float | None = None) -> bool:
        """Wait until the process/domain is gone; False on timeout."""

    @property
    def alive(self) -> bool:
        """Whether the process/domain still exists."""


#: builds the backend for one boot; the controller's seam for tests
BackendFactory = Callable[["BootPlan", EventSink], Backend]

#: shared resources (the private libvirtd) a backend started, by name, with the coroutine that
#: stops them; registered by the backend module that started them (see ``register_shared``)
_SHARED: dict[str, Callable[[], Awaitable[None]]] = {}


def register_shared(name: str, close: Callable[[], Awaitable[None]]) -> None:
    """Have ``close_backends`` call ``close`` at runtime exit (once per ``name``; a later
    registration under the same name replaces the earlier one)."""
    _SHARED[name] = close


async def close_backends() -> None:
    """Stop the shared resources backends started (the private libvirtd); a no-op when none did.

    Called once at runtime exit, after the guest is stopped. Errors are logged, not raised:
    the runtime is on its way out and must still remove its sockets.
    """
    while _SHARED:
        name, close = _SHARED.popitem()
        try:
            await close()
        except Exception:
            log.exception("could not stop the %s backend's shared resources", name)
