"""Leases: claim a generation, recycle back to pristine.

A mixin of ``VmController`` (like ``DiskOperations``): both are controller calls under the power
lock. A lease is tied to the runtime's generation (docs/architecture.md, "Leases and recycling").

The exporter claims when it hands a lease out, before the lease can do anything (CAN and network
forwards reach the guest without a runtime call). Both ends of a lease cancel the disk transfer of
the lease before: its recycle, and the claim of the next one.
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
    def cancel_transfer(self, reason: str) -> None: ...
    async def _capture_finished(self) -> None: ...
    async def _stop_backend(self, *, graceful: bool, timeout: float = 60.0) -> None: ...
    async def _boot(self) -> None: ...

    # ---- leases --------------------------------------------------------------------------
    async def recycle(self, *, boot: bool = True, if_generation: int | None = None) -> VmState:
        """Back to pristine: guest stopped, overlay and flashed disks discarded, consoles cleared,
        generation bumped; then boot a fresh overlay of the spec's image.

        :raise GenerationChangedError: when ``if_generation`` is no longer the current one (an
            earlier recycle already happened, e.g. the next lease claimed the VM first).
        """
        self._require_generation(if_generation)
        # before the lock: an upload flash of the ending lease holds it while it receives
        self.cancel_transfer(f"the lease it belonged to ended (generation {self.generation} is being recycled)")
        async with self._lock:
            self._require_generation(if_generation)
            await self._recycle_locked(boot=boot)
            return self.state()

    def _require_generation(self, if_generation: int | None) -> None:
        if if_generation is not None and if_generation != self.generation:
            raise GenerationChangedError(
                f"generation {if_generation} was already recycled (now {self.generation}); nothing to do")

    async def claim(self) -> VmState:
        """Start a lease: the caller gets a generation no earlier lease has used.

        A generation already claimed (the previous lease's recycle has not run yet) is recycled
        first, so a new lease never sees the previous one, whatever order the exporter closes
        and opens its driver trees in. An unclaimed one is claimed at once, without waiting for
        the lock (a first boot may hold it for a whole pull, and the exporter waits for the claim
        before it serves the lease): from then on no capture starts; one already under way (it
        began on a guest no lease had) is waited for.
        """
        self.cancel_transfer("the next lease claimed the VM")
        if not self._claimed:
            self._claimed = True
            await self._capture_finished()
            self.events.publish("claimed", generation=self.generation)
            return self.state()
        async with self._lock:
            if self._claimed:
                await self._recycle_locked(boot=True, claim=True)
            self._claimed = True
            self.events.publish("claimed", generation=self.generation)
            return self.state()

    async def _recycle_locked(self, *, boot: bool, claim: bool = False) -> None:
        """``claim``: the fresh generation is the claiming lease's from the start (its boot is
        never captured, and no other claim can take it in the meantime)."""
        await self._stop_backend(graceful=False)
        await self.disks.discard_lease()
        self.streams.clear_for_next_lease()
        self._timings = Timings()
        self._last_error = None
        self._last_exit = None
        self._claimed = claim
        self.events.generation += 1
        self._set_phase(Phase.STOPPED, reason="recycled")
        self.events.publish("recycled", generation=self.generation)
        if boot and self.spec is not None and self.spec.image:
            await self._boot()

