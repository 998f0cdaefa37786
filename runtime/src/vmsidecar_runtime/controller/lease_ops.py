"""Leases: claim a generation, recycle back to pristine.

A mixin of ``VmController`` (like ``DiskOperations``): both are controller calls under the power
lock. A lease is tied to the runtime's generation (docs/architecture.md, "Leases and recycling").
"""

from __future__ import annotations

import asyncio
from typing import Any

from vmsidecar_contract.errors import GenerationChangedError, VmsidecarError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import ExitInfo, Phase, Timings, VmState

from ..events import EventBus
from .disks import Disks
from .streams import GuestStreams


class LeaseOperations:
    """Claim and recycle."""

    # provided by VmController
    disks: Disks
    streams: GuestStreams
    events: EventBus
    spec: VmSpec | None
    _lock: asyncio.Lock
    _claimed: bool
    _timings: Timings
    _last_error: VmsidecarError | None
    _last_exit: ExitInfo | None

    @property
    def generation(self) -> int: ...
    def state(self) -> VmState: ...
    def _set_phase(self, phase: Phase, **data: Any) -> None: ...
    async def _stop_backend(self, *, graceful: bool, timeout: float = 60.0) -> None: ...
    async def _boot(self) -> None: ...

    # ---- leases --------------------------------------------------------------------------
    async def recycle(self, *, boot: bool = True, if_generation: int | None = None) -> VmState:
        """Back to pristine: guest stopped, overlay and flashed disks discarded, consoles cleared,
        generation bumped; then boot a fresh overlay of the spec's image.

        :raise GenerationChangedError: when ``if_generation`` is no longer the current one (an
            earlier recycle already happened, e.g. the next lease claimed the VM first).
        """
        async with self._lock:
            if if_generation is not None and if_generation != self.generation:
                raise GenerationChangedError(
                    f"generation {if_generation} was already recycled (now {self.generation}); nothing to do")
            await self._recycle_locked(boot=boot)
            return self.state()

    async def claim(self) -> VmState:
        """Start a lease: the caller gets a generation no earlier lease has used.

        A generation already claimed (the previous lease's recycle has not run yet) is recycled
        first, so a new lease never sees the previous one, whatever order the exporter closes
        and opens its driver trees in.
        """
        async with self._lock:
            if self._claimed:
                await self._recycle_locked(boot=True)
            self._claimed = True
            self.events.publish("claimed", generation=self.generation)
            return self.state()

    async def _recycle_locked(self, *, boot: bool) -> None:
        await self._stop_backend(graceful=False)
        await self.disks.discard_lease()
        self.streams.clear_for_next_lease()
        self._timings = Timings()
        self._last_error = None
        self._last_exit = None
        self._claimed = False
        self.events.generation += 1
        self._set_phase(Phase.STOPPED, reason="recycled")
        self.events.publish("recycled", generation=self.generation)
        if boot and self.spec is not None and self.spec.image:
            await self._boot()

