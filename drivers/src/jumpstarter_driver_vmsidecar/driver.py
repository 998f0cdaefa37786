"""``VirtualMachine``: the root driver of a VM served by the vmsidecar runtime.

Config (all optional but ``socket``)::

    vm:
      type: jumpstarter_driver_vmsidecar.driver.VirtualMachine
      config:
        socket: /shared/vmsidecar/api.sock
        recycle: InPlaceReuse          # or ExitAndReplace (default)
        spec: {image: REGISTRY/REPO:TAG, memory: 1G, network: {forwards: [{name: ssh, guest_port: 22}]}}

Children: ``power``, ``console`` (ttyS0), ``hvc0`` (virtio console), ``storage``, and one network
child per named port forward of the spec.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jumpstarter.driver import Driver, export

from vmsidecar_runtime.errors import GenerationChangedError, VmsidecarError
from vmsidecar_runtime.spec import VmSpec, load_spec

from .console import VmConsole
from .lease_exit import request_exit_after_lease
from .link import RuntimeLink, translate
from .network import VmForward
from .power import VmPower
from .storage import VmStorage

log = logging.getLogger(__name__)

RECYCLE_STRATEGIES = ("ExitAndReplace", "InPlaceReuse")
RESERVED_NAMES = {"power", "console", "hvc0", "storage", "can", "gpio"}


@dataclass(kw_only=True)
class VirtualMachine(Driver):
    """A VM served by a vmsidecar runtime over its Unix-socket API."""

    socket: str = "/shared/vmsidecar/api.sock"
    spec: dict[str, Any] | None = None
    recycle: str = "ExitAndReplace"
    #: seconds the guest gets to answer ACPI power-down before it is forced off
    graceful_timeout: float = 60.0
    #: flashing a running VM powers it off first (False: refuse with a clear message)
    flash_power_off: bool = True
    link: RuntimeLink = field(init=False, repr=False)
    _spec: VmSpec | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recycle not in RECYCLE_STRATEGIES:
            raise ValueError(
                f"recycle: {self.recycle!r} is not a recycle strategy; use ExitAndReplace or InPlaceReuse"
            )
        self.graceful_timeout = float(self.graceful_timeout)
        if self.spec is not None:
            try:
                self._spec = load_spec(self.spec)
            except VmsidecarError as e:
                raise ValueError(f"spec in the exporter config: {e.message}") from e
        self.link = RuntimeLink(Path(self.socket), spec=self._spec, on_claim=self._on_claim)
        self.children["power"] = VmPower(parent=self)
        self.children["console"] = VmConsole(parent=self, socket_name="console.sock")
        if self._spec is None or self._spec.virtio_console:
            self.children["hvc0"] = VmConsole(parent=self, socket_name="hvc0.sock")
        self.children["storage"] = VmStorage(parent=self)
        for fwd in self._spec.network.forwards if self._spec else []:
            if fwd.name in RESERVED_NAMES:
                raise ValueError(f"port forward name {fwd.name!r} clashes with a child driver; rename the forward")
            self.children[fwd.name] = VmForward(parent=self, forward=fwd.name)

    @classmethod
    def client(cls) -> str:
        return "jumpstarter_driver_composite.client.CompositeClient"

    # ---- lease lifecycle -----------------------------------------------------------------
    def reset(self) -> None:
        """Session start: hand our spec to the runtime (idempotent); the lease claim waits for a real call."""
        super().reset()
        self.link = RuntimeLink(Path(self.socket), spec=self._spec, on_claim=self._on_claim)
        if self._spec is not None:
            spec = self._spec
            try:
                self.link.run_sync(lambda c: c.put_spec(spec), timeout=30)
            except VmsidecarError as e:
                log.warning("could not push the spec to the runtime yet (%s); will retry on first use", e.message)
            except Exception as e:  # runtime not up yet: the exporter keeps running
                log.warning("runtime not reachable at %s yet (%s); will retry on first use", self.socket, e)

    def _on_claim(self) -> None:
        if self.recycle == "ExitAndReplace":
            request_exit_after_lease(log)

    def close(self) -> None:
        """Session end: for a tree that served a lease, recycle (InPlaceReuse) or stop the runtime (ExitAndReplace)."""
        try:
            generation = self.link.claimed_generation
            if generation is None:
                return  # the start-up session, or a lease that never touched the VM
            if self.recycle == "InPlaceReuse":
                try:
                    self.link.run_sync(lambda c: c.recycle(boot=True, if_generation=generation))
                    log.info("recycled generation %d for the next lease", generation)
                except GenerationChangedError:
                    log.info("generation %d was already recycled by the next lease", generation)
            else:
                self.link.run_sync(lambda c: c.shutdown(), timeout=60)
                log.info("runtime shut down after the lease (ExitAndReplace)")
        except Exception as e:
            log.error("end-of-lease %s failed: %s", self.recycle, e)
        finally:
            self.link.close()
            super().close()

    # ---- extras for Python clients -------------------------------------------------------
    @export
    async def state(self) -> dict[str, Any]:
        """The runtime's state (phase, generation, accel, forwards, timings…)."""
        try:
            return (await self.link.client().state()).model_dump(mode="json")
        except VmsidecarError as e:
            raise translate(e) from e

    @export
    async def wait_ready(self, timeout: float = 600.0) -> dict[str, Any]:
        """Wait until the guest is Ready (the readiness regex was seen)."""
        return (await self.link.call(lambda c: c.wait_ready(float(timeout)))).model_dump(mode="json")
