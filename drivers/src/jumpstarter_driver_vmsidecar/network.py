"""Port forwards: one NetworkInterface child per named forward of the spec."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anyio import connect_tcp
from jumpstarter.driver import Driver, export, exportstream
from jumpstarter_driver_network.driver import NetworkInterface

from .metrics import metered_driver
from .uploads import RefusesUploads

if TYPE_CHECKING:
    from .driver import VirtualMachine


@metered_driver
@dataclass(kw_only=True)
class VmForward(RefusesUploads, NetworkInterface, Driver):
    """``j vm <name> forward-tcp PORT``: the runtime picked the host port at boot; it is read each time."""

    parent: VirtualMachine
    forward: str

    async def _host_port(self) -> tuple[str, int]:
        state = await self.parent.link.call(lambda c: c.state())
        address = state.forwards.get(self.forward)
        if address is None:
            raise ValueError(
                f"port forward {self.forward!r} has no address while the VM is {state.phase.value}; power the VM on "
                "first (forwards exist only while the guest runs)"
            )
        host, port = address.rsplit(":", 1)
        return ("127.0.0.1" if host == "0.0.0.0" else host), int(port)

    @exportstream
    @asynccontextmanager
    async def connect(self) -> AsyncGenerator[Any, None]:
        """A TCP stream to the guest port."""
        host, port = await self._host_port()
        async with await connect_tcp(host, port) as stream:
            await self.parent.link.check()  # again: a later claim stops the QEMU this goes through
            yield stream

    @export
    async def address(self) -> str:
        """``tcp://HOST:PORT`` of the forward on the exporter's host."""
        host, port = await self._host_port()
        return f"tcp://{host}:{port}"
