"""The GPIO device as the controller sees it: the virtio-gpio model, its vhost-user slave and ``gpio.sock``.

One :class:`GpioDevice` lives as long as the runtime's spec has the same GPIO lines: the control
socket stays up across power cycles (an exporter may wait on a line while the guest reboots), and
each boot gets a fresh vhost-user listener for its QEMU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vmsidecar_contract.spec import GpioLine

from .gpio_control import GpioControlServer
from .vhost_user import VhostUserSlave
from .virtio_gpio import Line, VirtioGpio


class GpioDevice:
    """Ties the three layers together; the controller's only handle on GPIO."""

    def __init__(self, lines: list[GpioLine],
                 require_generation: Callable[[int], None] | None = None) -> None:
        self.model = VirtioGpio(lines)
        self.vhost = VhostUserSlave(self.model)
        self.control = GpioControlServer(self.model, require_generation)

    @property
    def lines(self) -> list[Line]:
        """The lines, in offset order (``name``, ``direction``, ``initial``, ``value`` …)."""
        return self.model.lines

    async def listen_control(self, path: Path) -> None:
        """Serve the host control socket (mode 0660, handed to the socket owner)."""
        await self.control.listen(path)

    async def start_vhost(self, path: Path) -> None:
        """Power-on: lines back to the spec, then listen for QEMU (before it starts: it reads the config at realize)."""
        await self.vhost.close()
        self.model.reset()
        await self.vhost.listen(path)

    async def stop_vhost(self) -> None:
        """QEMU is gone: drop its session, the guest memory and every armed event buffer."""
        await self.vhost.close()

    def end_lease(self) -> None:
        """A lease ended (its guest is stopped): its pending waits end with ``closed``, its control
        connections close, and the lines are as the spec wires them again, whether a boot follows
        or not (the next lease read what the last one drove until its first power-on)."""
        self.control.end_lease()
        self.model.reset()

    async def close(self) -> None:
        """Stop everything and remove both sockets; pending waits end with ``closed``."""
        await self.vhost.close()
        await self.control.close()
