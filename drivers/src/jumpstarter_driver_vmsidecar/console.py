"""Consoles: a PySerialClient-compatible ``connect`` stream on the runtime's console sockets."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anyio import connect_unix
from jumpstarter.driver import Driver, export, exportstream

from .metrics import metered_driver
from .uploads import RefusesUploads

if TYPE_CHECKING:
    from .driver import VirtualMachine


@metered_driver
@dataclass(kw_only=True)
class VmConsole(RefusesUploads, Driver):
    """``j vm console start-console|pipe`` and ``.pexpect()``: the guest's serial or virtio console.

    A new connection first receives the current boot's scrollback, then live output.
    """

    parent: VirtualMachine
    #: socket file name in the runtime's shared directory
    socket_name: str = "console.sock"

    @classmethod
    def client(cls) -> str:
        return "jumpstarter_driver_pyserial.client.PySerialClient"

    @exportstream
    @asynccontextmanager
    async def connect(self) -> AsyncGenerator[Any, None]:
        """A byte stream to and from the guest console."""
        await self.parent.link.check()  # claims the VM; clear error when the runtime is down
        path = self.parent.link.socket.parent / self.socket_name
        try:
            stream = await connect_unix(str(path))
        except OSError as e:
            raise RuntimeError(
                f"cannot open the guest console {path} ({e.strerror}); the console is enabled in the VM spec "
                "and the runtime serves it while it runs"
            ) from e
        async with stream:
            await self.parent.link.check()  # again: a later claim drops this client with every other
            yield stream

    # PySerial compatibility: a virtual console has no modem lines; these are accepted no-ops.
    @export
    def set_dtr(self, value: bool) -> None:
        """No-op (a virtual console has no DTR line)."""

    @export
    def set_rts(self, value: bool) -> None:
        """No-op (a virtual console has no RTS line)."""
