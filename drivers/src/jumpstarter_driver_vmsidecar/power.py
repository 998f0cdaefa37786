"""Power: the standard PowerInterface over the runtime's power API."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jumpstarter.driver import Driver, export
from jumpstarter_driver_power.common import PowerReading
from jumpstarter_driver_power.driver import PowerInterface

from .metrics import metered_driver
from .uploads import RefusesUploads

if TYPE_CHECKING:
    from .driver import VirtualMachine

#: What ``read`` reports: a virtual board draws nothing when off, a nominal 5 V / 1 A when on.
ON_READING = PowerReading(voltage=5.0, current=1.0)
OFF_READING = PowerReading(voltage=0.0, current=0.0)


@metered_driver
@dataclass(kw_only=True)
class VmPower(RefusesUploads, PowerInterface, Driver):
    """``j vm power on|off|cycle|read``; ``hard_reset`` presses the reset button."""

    parent: VirtualMachine

    @export
    async def on(self) -> None:
        """Power the guest on (pulls the image on first use); no-op when already on."""
        await self.parent.link.call(lambda c: c.power("on"))

    @export
    async def off(self) -> None:
        """Power the guest off: ACPI power button, then forced after the configured timeout."""
        timeout = self.parent.graceful_timeout
        await self.parent.link.call(lambda c: c.power("off", graceful=True, timeout=timeout))

    @export
    async def hard_reset(self) -> None:
        """Press the reset button: the guest reboots on the same disk (``Driver.reset`` is the lease hook)."""
        await self.parent.link.call(lambda c: c.power("reset"))

    @export
    async def read(self) -> AsyncGenerator[PowerReading, None]:
        """One reading: nominal power when the guest runs, zero otherwise."""
        state = await self.parent.link.call(lambda c: c.state())
        yield ON_READING if state.phase.value in ("Starting", "Running", "Ready") else OFF_READING
