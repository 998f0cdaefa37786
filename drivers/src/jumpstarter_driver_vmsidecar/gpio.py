"""GPIO lines of the guest's virtio gpiochip, on the standard ``jumpstarter_driver_gpiod`` clients.

Directions are the guest's (as in the spec): a guest *input* (``direction: in``) is driven by the
host, like a button wired to a board: ``VmGpioOutput`` → ``DigitalOutputClient`` (``on``, ``off``,
``read``). A guest *output* (``direction: out``) is read by the host, like an LED:
``VmGpioInput`` → ``DigitalInputClient`` (``read``, ``wait_for_active``, ``wait_for_inactive``,
``wait_for_edge``). Both talk to the runtime's ``gpio.sock`` (JSON lines, see
``vmsidecar_runtime.devices.gpio_control``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jumpstarter.driver import Driver, export

from .arguments import seconds_or_none
from .metrics import metered_driver
from .uploads import RefusesUploads

if TYPE_CHECKING:
    from .driver import VirtualMachine


@metered_driver
@dataclass(kw_only=True)
class VmGpio(RefusesUploads, Driver):
    """``gpio``: one child per line of the spec."""

    parent: VirtualMachine

    @classmethod
    def client(cls) -> str:
        return "jumpstarter_driver_composite.client.CompositeClient"


@dataclass(kw_only=True)
class _Line(RefusesUploads, Driver):
    parent: VirtualMachine
    line: str

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to ``gpio.sock``, claiming the VM at the lease's first call.

        An API call costs about as much as the GPIO request itself, so it is made only when needed:
        to claim, or when the socket is missing (the runtime is down: its clear error; or it
        restarted without a spec: the link gives it ours again, and the socket comes back).
        """
        link = self.parent.link
        if link.claimed_generation is None:
            await link.check()
        path = link.socket.parent / "gpio.sock"
        try:
            return await asyncio.open_unix_connection(str(path))
        except OSError:
            await link.check()
        try:
            return await asyncio.open_unix_connection(str(path))
        except OSError as e:
            raise RuntimeError(
                f"cannot open the GPIO control socket {path} ({e.strerror}); the runtime serves it while its "
                "spec has gpio lines"
            ) from e

    async def _call(self, request: dict[str, Any], timeout: float | None = 30.0) -> dict[str, Any]:
        reply = await self._ask(request, timeout)
        if reply.get("error") == "generation_changed":
            # the runtime restarted (its generations begun anew, unclaimed): the link claims it again
            # when no other lease has it, else its API call fails with the same sentence
            await self.parent.link.check()
            reply = await self._ask(request, timeout)
        if not reply.get("ok"):
            if reply.get("error") == "timeout":
                raise TimeoutError(reply.get("message"))
            if reply.get("error") in ("busy", "closed"):
                raise RuntimeError(reply.get("message"))
            raise ValueError(reply.get("message"))
        return reply

    async def _ask(self, request: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """One request on its own connection, naming the lease's generation: a tree of an ended lease
        (0.9.0 keeps it while it hands the next lease out) must act on nothing of the next."""
        reader, writer = await self._connect()
        generation = self.parent.link.claimed_generation
        try:
            named = {**request, "line": self.line}
            if generation is not None:
                named["generation"] = generation
            writer.write(json.dumps(named).encode() + b"\n")
            await writer.drain()
            raw = await asyncio.wait_for(reader.readline(), None if timeout is None else timeout + 5)
        finally:
            writer.close()
        if not raw:
            raise RuntimeError("the runtime closed the GPIO control socket (the lease ended, the spec "
                               "changed or the runtime is stopping)")
        return dict(json.loads(raw))

    @export
    async def read_pin(self) -> int:
        """The line's level: 1 (active) or 0 (inactive)."""
        return int((await self._call({"op": "get"}))["value"])


@metered_driver
@dataclass(kw_only=True)
class VmGpioOutput(_Line):
    """A guest input the host drives (``j vm gpio NAME on|off|read``)."""

    @classmethod
    def client(cls) -> str:
        return "jumpstarter_driver_gpiod.client.DigitalOutputClient"

    @export
    async def on(self) -> None:
        """Drive the line high."""
        await self._call({"op": "set", "value": 1})

    @export
    async def off(self) -> None:
        """Drive the line low."""
        await self._call({"op": "set", "value": 0})


@metered_driver
@dataclass(kw_only=True)
class VmGpioInput(_Line):
    """A guest output the host reads and waits on; a wait's ``timeout`` is 0 to 86400 s, or None
    (until it happens or the call is cancelled)."""

    @classmethod
    def client(cls) -> str:
        return "jumpstarter_driver_gpiod.client.DigitalInputClient"

    async def _wait(self, until: str, timeout: object) -> None:
        wait = seconds_or_none(timeout)
        await self._call({"op": "wait", "for": until, "timeout": wait}, wait)

    @export
    async def wait_for_active(self, timeout: float | None = None) -> None:
        """Return once the line is high (at once if it already is)."""
        await self._wait("active", timeout)

    @export
    async def wait_for_inactive(self, timeout: float | None = None) -> None:
        """Return once the line is low (at once if it already is)."""
        await self._wait("inactive", timeout)

    @export
    async def wait_for_edge(self, edge_type: str, timeout: float | None = None) -> None:
        """Return at the next ``rising`` or ``falling`` edge."""
        if edge_type not in ("rising", "falling"):
            raise ValueError(f"Invalid edge type: {edge_type}, must be one of: rising, falling")
        await self._wait(edge_type, timeout)

