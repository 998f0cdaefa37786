"""The guest's byte streams and devices as the shared directory shows them: console hubs (consoles,
virtio-serial channels, SLCAN buses) and the GPIO device, opened to match the spec."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from vmsidecar_contract.spec import VmSpec

from ..backend import Backend
from ..console import ConsoleHub
from ..devices.gpio import GpioDevice
from ..plan import BootPlan, stream_names
from .paths import RuntimePaths

#: streams a person reads: replayed to new readers, logged, and cut into boots
CONSOLES = ("ttyS0", "hvc0")
#: seconds to read an exited backend's last output (its sockets end at once: this bounds a stuck one)
READ_TO_END = 1.0
#: seconds a guest gets to read the input it was sent before it pauses for a capture
INPUT_CONSUMED = 2.0
#: seconds to read what a paused guest's backend wrote before a capture (it writes no more)
OUTPUT_READ = 0.5


class GuestStreams:
    """Owns the hubs and the GPIO device; the controller decides when they attach, detach or clear."""

    def __init__(self, paths: RuntimePaths, require_generation: Callable[[int], None] | None = None) -> None:
        self.paths = paths
        #: the lease's generation rule, for GPIO requests that name their lease (``gpio.sock`` has no API)
        self._require_generation = require_generation
        self.hubs: dict[str, ConsoleHub] = {}
        #: the vhost-user virtio-gpio backend + <shared>/gpio.sock, when the spec has GPIO lines
        self.gpio: GpioDevice | None = None

    async def open_for(self, spec: VmSpec | None) -> None:
        """Serve exactly the spec's streams and GPIO lines (kept when unchanged); None: none."""
        wanted = stream_names(spec) if spec is not None else []
        for name in list(self.hubs):
            if name not in wanted:
                await self.hubs.pop(name).close()
        for name in wanted:
            if name not in self.hubs:
                is_console = name in CONSOLES
                hub = ConsoleHub(name, self.paths.stream_socket(name),
                                 log_path=self.paths.state / f"{name}.log" if is_console else None,
                                 replay=is_console)
                await hub.listen()
                self.hubs[name] = hub
        await self._open_gpio(spec)

    async def _open_gpio(self, spec: VmSpec | None) -> None:
        gpio = spec.gpio if spec is not None else []
        if self.gpio is not None and _wiring(self.gpio.lines) != _wiring(gpio):
            await self.gpio.close()
            self.gpio = None
        if gpio and self.gpio is None:
            self.gpio = GpioDevice(gpio, self._require_generation)
            await self.gpio.listen_control(self.paths.shared / "gpio.sock")

    async def before_launch(self, plan: BootPlan) -> None:
        """QEMU asks the vhost-user GPIO backend for its config while it realizes the device."""
        if self.gpio is not None:
            await self.gpio.start_vhost(plan.gpio_socket)

    async def attach(self, plan: BootPlan, backend: Backend) -> None:
        """Drain every stream from the backend (the guest is still paused).

        :raise TimeoutError: when a backend socket does not accept.
        """
        for name in plan.stream_names:
            hub = self.hubs.get(name)
            if hub is not None:
                await hub.attach(backend.upstream(name))

    async def detach(self, *, exiting: bool = False) -> None:
        """The backend is gone: read what it wrote to the end, stop draining; shared-dir clients stay
        connected. ``exiting``: its process is in its exit and writes nothing more, but its sockets
        and pipes end only once the kernel has freed its memory: what it wrote is read from their
        buffers instead of waiting for their end."""
        if self.gpio is not None:
            await self.gpio.stop_vhost()
        if exiting:
            await self.output_read()
        read_to_end = 0.0 if exiting else READ_TO_END
        await asyncio.gather(*(hub.detach(read_to_end=read_to_end) for hub in self.hubs.values()))

    def hold_new_input(self) -> None:
        """From now on the clients' input waits in the hubs (a capture is to come: ``hold_input``)."""
        for hub in self.hubs.values():
            hub.hold_input()

    async def hold_input(self) -> None:
        """The guest is about to pause for a capture (and may move to a new backend process): hold
        the clients' input from now on, and let the guest read what it was already sent (bounded:
        it may not read at all)."""
        for hub in self.hubs.values():
            hub.hold_input()
        await asyncio.gather(*(hub.input_consumed(INPUT_CONSUMED) for hub in self.hubs.values()))

    def boot_outputs(self) -> dict[str, bytes]:
        """Each console's scrollback of this boot (what a capture keeps for the guests restored from it)."""
        return {name: self.hubs[name].boot_output() for name in CONSOLES if name in self.hubs}

    async def output_read(self) -> None:
        """The guest is paused: let every hub read what the backend already wrote (bounded), so a
        capture's scrollback ends where the guest stopped."""
        await asyncio.gather(*(hub.output_read(OUTPUT_READ) for hub in self.hubs.values()))

    def release_input(self) -> None:
        """Send the held input on to the guest's new backend process (or drop it: a new boot)."""
        for hub in self.hubs.values():
            hub.release_input()

    def new_boot(self) -> None:
        """A new boot: no reader from now on gets an earlier boot's output."""
        for hub in self.hubs.values():
            hub.new_boot()

    def preload(self, consoles: dict[str, bytes]) -> None:
        """Show a restored guest's consoles as its pristine boot left them."""
        for name, data in consoles.items():
            if name in self.hubs:
                self.hubs[name].preload(data)

    def clear_for_next_lease(self) -> None:
        """Forget all scrollback, the console logs too, and disconnect every client, GPIO waits
        included (recycle)."""
        for hub in self.hubs.values():
            hub.clear(disconnect_clients=True)
            hub.forget_log()
        if self.gpio is not None:
            self.gpio.end_lease()

    def boot_has_output(self) -> bool:
        """Whether this boot printed anything on a console yet."""
        return any(self.hubs[name].bytes_seen for name in CONSOLES if name in self.hubs)

    def first_byte_at(self) -> float | None:
        """Monotonic time of this boot's first serial console byte."""
        hub = self.hubs.get("ttyS0")
        return hub.first_byte_at if hub else None

    def tail(self) -> str | None:
        """The serial console's last bytes (for errors and the state of a failed guest)."""
        hub = self.hubs.get("ttyS0")
        return hub.tail() if hub else None

    def sockets(self) -> dict[str, str]:
        """Stream name -> shared-dir socket path."""
        return {name: str(hub.listen_path) for name, hub in self.hubs.items()}

    async def close(self) -> None:
        """Close every socket (the runtime is exiting)."""
        for hub in self.hubs.values():
            await hub.close()
        self.hubs.clear()
        if self.gpio is not None:
            await self.gpio.close()
            self.gpio = None


def _wiring(lines: Iterable[Any]) -> list[tuple[str, str, int]]:
    """What a GPIO device is made of (a spec's lines, or a device's): each line's name, direction and
    initial level, in order; a device is kept while its spec's wiring is the same."""
    return [(x.name, x.direction, x.initial) for x in lines]
