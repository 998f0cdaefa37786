"""The VM controller: the one state machine behind the API, the CLI and the drivers.

``VmController`` keeps the state machine (``PhaseMachine``: the phase, and the power lock every
operation takes, so there are never two hypervisors), the spec and the lease generation. Each
public operation checks its phase at the door and calls collaborators built here, none of which
holds the controller: ``Power`` (boot, stop, reset, and what the guest does on its own; with
``Boot`` and ``Machine``), ``SnapshotOps`` (when to restore or capture, and why not), ``Lease``
(the claim, what a lease leaves behind), ``DiskOps`` and ``Transfers`` (flash, dump, pull).
A recycle reads top to bottom in ``recycle`` and ``_recycle_locked``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterable, Callable
from pathlib import Path
from typing import Any

from vmsidecar_contract.canhost import check_native_can
from vmsidecar_contract.errors import GenerationChangedError, VmsidecarError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import BOOTABLE, LIVE, Phase, SnapshotInfo, VmState

from .. import metrics
from ..backend import BackendFactory, create_backend
from ..disk import DiskImage
from ..events import EventBus
from ..hostpaths import HostPathPolicy
from ..readiness_rules import readiness_state
from . import pool_spec
from .admission import admit_api_spec, admit_snapshot_source
from .disk_ops import DiskOps
from .disks import Disks, Progress
from .lease import Lease, bound_call
from .ledger import LeaseLedger
from .paths import RuntimePaths
from .phase import PhaseMachine, require_spec
from .power import Power
from .snapshot_ops import SnapshotOps
from .streams import GuestStreams
from .transfers import DEFAULT_PULL_TIMEOUT_S, Transfer, Transfers

log = logging.getLogger(__name__)


class _Unclaimed(enum.Enum):
    """What a VM no lease has claimed yet serves (None is a spec too: none)."""

    UNCLAIMED = "unclaimed"


UNCLAIMED = _Unclaimed.UNCLAIMED


class VmController:
    """Owns one VM: its spec, phase, power lock and generation."""

    def __init__(self, spec: VmSpec | None, paths: RuntimePaths, *, backend_factory: BackendFactory = create_backend,
                 allow_extra_args: bool = False, host_paths: HostPathPolicy | None = None,
                 pull_fn: Callable[..., Any] | None = None, pull_timeout: float = DEFAULT_PULL_TIMEOUT_S) -> None:
        self.spec = spec
        self.paths = paths
        self.events = EventBus()  # holds the generation every event is stamped with
        self.allow_extra_args = allow_extra_args
        #: host paths API callers may name (none by default); the runtime's own config may name any
        self.host_paths = host_paths or HostPathPolicy()
        self.shutdown_requested = asyncio.Event()
        self.disks = Disks(paths, pull_fn)
        self.streams = GuestStreams(paths, self.require_lease_generation)
        self._phases = PhaseMachine(self.events)
        #: the VM's one disk transfer slot (``Transfers``: begin, end, cancel)
        self.transfers = Transfers(self.disks, self.events, pull_timeout)
        self._lease = Lease(self.disks, self.streams, self.events)
        self._phases.lock.on_acquired = self._lease.require_bound_call
        self._snapshots = SnapshotOps(paths, self.disks)
        self._power = Power(paths, self._phases, self.events, self.disks, self.streams, self._snapshots,
                            self._lease, self.transfers, backend_factory)
        self._disk_ops = DiskOps(self._phases, self.events, self.disks, self.transfers, self._power,
                                 self.host_paths, lambda: self._lease.ledger)
        #: started without an image (a pool pod): boot as soon as a spec with an image arrives
        self._boot_on_spec = spec is None or not spec.image
        #: the runtime's own spec: its ``--spec`` (None without), or one set over the API before any
        #: lease claimed the VM, or the first claim's: what a claim naming none serves (docs/security.md
        #: row 50), and the one snapshot source a lease's spec may name (row 40). Without ``--spec``,
        #: the one a runtime killed on this state directory was claimed with (``start``)
        self._own_spec = spec
        #: the own spec is that killed runtime's: it holds as though a lease had claimed this one too
        self._own_spec_held = False
        #: the spec the last claim served (the exporter's, else the runtime's own); ``UNCLAIMED``
        #: before the first claim. What a lease changed over the API is undone by the recycles that end it
        self._served_spec: VmSpec | _Unclaimed | None = UNCLAIMED
        self._background: set[asyncio.Task[None]] = set()

    # ---- state ---------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phases.phase

    @property
    def generation(self) -> int:
        """Bumped by every recycle: the lease counter of this instance."""
        return self.events.generation

    @property
    def pull_timeout(self) -> float:
        """Seconds one pull or upload flash may take (serve --pull-timeout)."""
        return self.transfers.pull_timeout

    @property
    def ledger(self) -> LeaseLedger:
        """What the current generation's lease did (the API's audit middleware counts power operations)."""
        return self._lease.ledger

    @property
    def snapshot_info(self) -> SnapshotInfo:
        """``snapshot`` of ``GET /v1/vm``: the snapshot's state and the spare restore's."""
        standby, reason = self._power.standby.status(self.spec)
        return self._snapshots.info.model_copy(update={"standby": standby, "standby_reason": reason,
                                                       "storing": self._snapshots.storing})

    def state(self) -> VmState:
        """A snapshot for ``GET /v1/vm``."""
        disk, machine, error = self.disks.current, self._power.machine, self._phases.last_error
        return VmState(
            phase=self.phase, generation=self.generation, boot=machine.boot_count, claimed=self._lease.claimed,
            backend=self.spec.backend if self.spec else "qemu", image=self.spec.image if self.spec else None,
            image_digest=disk.digest if disk else None, disk=disk.source if disk else None,
            accel=machine.accel.accel if machine.accel else None,
            accel_reason=machine.accel.reason if machine.accel else None,
            timings=machine.timings, forwards=machine.forwards(), sockets=self.streams.sockets(),
            last_error=error.to_dict() if error else None, last_exit=machine.last_exit,
            console_tail=self.streams.tail() if self.phase in (Phase.ERROR, Phase.CRASHED) else None,
            snapshot=self.snapshot_info, **readiness_state(self.spec, disk),
        )

    # ---- lifecycle of the controller -----------------------------------------------------
    async def start(self, *, boot: bool = True) -> None:
        """Clear what an earlier runtime process left but its pool spec (``pool_spec.py``), open the
        streams; with an image in the spec, pull and boot in the background."""
        for d in (self.paths.cache, self.paths.state, self.paths.run):
            d.mkdir(parents=True, exist_ok=True)
        await self.disks.discard_earlier_process()
        if self._own_spec is None:  # no --spec: the pool's, if a runtime was killed here mid-lease
            self._own_spec = pool_spec.remembered(self.paths.state)
            self._own_spec_held = self._own_spec is not None
        if self.spec is not None:
            await self.streams.open_for(self.spec)
            if boot and self.spec.image:
                self._spawn(self._autostart())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _autostart(self) -> None:
        with contextlib.suppress(VmsidecarError):  # already recorded as last_error / phase
            await self.power_on()

    async def close(self) -> None:
        """Stop the guest (bounded) and close every socket."""
        pool_spec.forget(self.paths.state)  # a clean stop: no runtime after this one is mid-lease
        async with self._phases.lock:
            await self._power.stop(graceful=True, timeout=20)
            await self._power.standby.drop("the runtime stops")
            await self._snapshots.drop_staging()  # a capture that will not happen: its RAM file goes
        await self.streams.close()

    async def kill(self) -> None:
        """Last resort (grace period over): SIGKILL the backend, whatever the controller was doing."""
        await self._power.machine.kill()
        await self._power.standby.kill()
        await self.streams.close()

    async def shutdown(self) -> None:
        """Stop the guest and ask the runtime process to exit 0 (ExitAndReplace)."""
        async with self._phases.lock:
            await self._power.stop(graceful=True, timeout=20)
            await self._power.standby.drop("the runtime shuts down")
            self._phases.set(Phase.STOPPED, reason="shutdown")
            self._lease.summarize("shutdown")
        self.shutdown_requested.set()

    # ---- spec ----------------------------------------------------------------------------
    async def set_spec(self, spec: VmSpec, *, from_api: bool = True) -> bool:
        """Replace the spec; returns False when it equals the current one (idempotent).

        :raise SpecError: extra_args over the API without --allow-extra-args.
        :raise HostPathError: a host path over the API that the administrator did not allow.
        :raise StateError: while the VM runs with a different spec.
        """
        if from_api:
            self._admit(spec)
        if spec == self.spec:  # the exporter's claim sends it first: it must not wait for a first boot's pull
            return False
        check_native_can(spec)
        async with self._phases.lock:
            if spec == self.spec:
                return False
            self._phases.require(BOOTABLE, "replace the spec")
            await self._apply_spec(spec)
            if from_api and self._served_spec is UNCLAIMED and not self._own_spec_held:
                self._own_spec = spec  # no lease yet: the runtime's administrator's
            if self._boot_on_spec and spec.image:
                self._boot_on_spec = False
                self._spawn(self._autostart())
            return True

    async def _apply_spec(self, spec: VmSpec | None) -> None:
        """Make ``spec`` the VM's (under the lock, the guest not running); None (a lease's spec the
        claim after it drops, the runtime having none of its own): no spec, no image, no stream."""
        if spec is None or self.spec is None or spec.image != self.spec.image or spec.arch != self.spec.arch:
            self.disks.forget_image()
        self.spec = spec
        await self._power.standby.drop("the spec changed; the next Ready makes a spare of the new one")
        await self.streams.open_for(spec)
        if spec is None:
            self._boot_on_spec = True  # as a pod started without one: the next spec with an image boots
        self.events.publish("spec", spec=spec.model_dump(mode="json") if spec else None)

    # ---- power ---------------------------------------------------------------------------
    async def power_on(self) -> VmState:
        """Boot the guest (pulling the image first if needed); idempotent like a latched switch.

        :raise StateError: while stopping.
        """
        async with self._phases.lock:
            if self.phase in LIVE:
                return self.state()
            self._phases.require(BOOTABLE, "power on")
            await self._power.boot(require_spec(self.spec))
            return self.state()

    async def power_off(self, *, graceful: bool = True, timeout: float = 60.0) -> VmState:
        """Power the guest off: ACPI first when graceful (bounded by ``timeout``), then quit."""
        async with self._phases.lock:
            await self._power.off(graceful=graceful, timeout=timeout)
            return self.state()

    async def reset(self) -> VmState:
        """Hard reset, like the reset button; the guest reboots on the same disk.

        :raise StateError: unless the guest runs.
        """
        async with self._phases.lock:
            self._phases.require(LIVE, "reset")
            await self._power.reset()
            return self.state()

    async def cycle(self, *, graceful: bool = False, timeout: float = 60.0) -> VmState:
        """Off then on (hard off by default, like a power strip)."""
        async with self._phases.lock:
            await self._power.off(graceful=graceful, timeout=timeout)
            await self._power.boot(require_spec(self.spec))
            return self.state()

    # ---- leases --------------------------------------------------------------------------
    def require_lease_generation(self, generation: int) -> None:
        """A call bound to the lease that claimed ``generation`` (``GENERATION_HEADER``): see
        :meth:`Lease.require_claimed`. :raise GenerationChangedError: it ended."""
        self._lease.require_claimed(generation)

    def lease_bound_call(self, generation: int) -> contextlib.AbstractContextManager[None]:
        """While the current task serves a call bound to the lease of ``generation``: each time it
        takes the power lock the lease must still have the VM (it may have waited behind the next
        lease's claim). :raise GenerationChangedError: from the lock, when it has not."""
        return bound_call(generation)

    async def recycle(self, *, boot: bool = True, if_generation: int | None = None) -> VmState:
        """Back to pristine: guest stopped, overlay and flashed disks discarded, consoles cleared,
        generation bumped; then boot a fresh overlay of the spec's image.

        :raise GenerationChangedError: when ``if_generation`` is no longer the current one (an
            earlier recycle already happened, e.g. the next lease claimed the VM first).
        """
        self._lease.require_generation(if_generation)
        # before the lock: an upload flash of the ending lease holds it while it receives, a graceful
        # power-off while its guest ignores the button
        self.transfers.cancel(f"the lease it belonged to ended (generation {self.generation} is being recycled)")
        self._lease.end()
        async with self._phases.lock:
            self._lease.require_generation(if_generation)
            await self._recycle_locked(boot=boot)
            return self.state()

    async def claim(self, *, token: str | None = None, spec: VmSpec | None = None,
                    still_asked: Callable[[], bool] | None = None) -> VmState:
        """Start a lease: the caller gets a generation no earlier lease has used.

        A generation already claimed (the previous lease's recycle has not run yet) is recycled
        first, so a new lease never sees the previous one, whatever order the exporter closes
        and opens its driver trees in. An unclaimed one is claimed at once, without waiting for
        the lock (a first boot may hold it for a whole pull, and the exporter waits for the claim
        before it serves the lease): from then on no capture starts; one already under way (it
        began on a guest no lease had) is waited for. A recycle under way is waited for too (its
        generation is unclaimed before its guest boots).

        ``spec``: the spec the lease is served (the exporter's): a VM with another (an earlier
        lease set one over the API) is recycled onto it, and the recycles that end this lease
        return to it; a runtime with none yet takes it and boots it in the background, as a ``PUT``.
        A claim without one (an exporter with no spec of its own) is served the runtime's own spec
        the same way, or no spec when the runtime has none: a spec a lease set is never the next
        lease's (docs/security.md row 50).

        The answer waits until a restored guest's clock is set (a new boot's restore is Ready
        before its clock: ``Boot.clock_settled``), so nothing of the lease reaches it earlier.

        ``still_asked``: False once the caller has gone; a claim that waited for the lock is then
        dropped there, having done nothing (its lease may have ended, the VM be the next lease's).

        :raise SpecError, HostPathError: ``spec`` is not one the API takes.
        :raise GenerationChangedError: another claim recycled the VM while this one waited for the clock.
        """
        await self._claim(token, spec, still_asked)
        generation = self.generation
        await self._power.clock_settled()
        if self.generation != generation:  # another claimer recycled the VM meanwhile: this lease has nothing
            raise GenerationChangedError(f"generation {generation}, which this claim took, was recycled for another "
                                         f"claim (now {self.generation}) while it waited for the restored guest's "
                                         "clock; claim again")
        return self.state()

    async def _claim(self, token: str | None, spec: VmSpec | None, still_asked: Callable[[], bool] | None) -> None:
        if spec is not None:
            self._admit(spec)
            check_native_can(spec)
        if self._lease.claimed_by(token):  # asked again: its first answer was lost
            return
        if self._served_spec is UNCLAIMED:  # the first claim: the pool's exporter's
            if spec is not None and not self._own_spec_held:
                self._own_spec = spec
            if self._own_spec is not None:
                pool_spec.remember(self.paths.state, self._own_spec)
        self.transfers.cancel("the next lease claimed the VM")
        if self._lease.claimed:  # another lease's: it ends (what it holds the lock with stops waiting)
            self._lease.end()
        if spec is not None and self.spec is None:  # a pool pod's first claim: no boot to wait for
            await self.set_spec(spec, from_api=False)
        served = spec if spec is not None else self._own_spec
        if served == self.spec and self._lease.claim_unclaimed(token):
            self._served_spec = served
            await self._snapshots.capture_finished()
            self._claimed()
            return
        async with self._phases.lock:
            if self._lease.claimed_by(token):  # (its first request was ahead of this one for the lock)
                return
            if still_asked is not None and not still_asked():
                log.warning("a claim whose caller left while it waited for the VM was dropped (generation %d "
                            "stays as it is)", self.generation)
                return
            self._served_spec = served
            if self.spec != served or not self._lease.claim_unclaimed(token):
                await self._recycle_locked(boot=True, claim=True, token=token)
            self._claimed()

    def _admit(self, spec: VmSpec) -> None:
        """What a spec sent over the API may not do (``admission.py``); once a lease has claimed the
        VM (or a killed runtime's, whose pool spec this one holds to), that includes bringing a
        snapshot source the runtime's own spec does not name.

        :raise SpecError, HostPathError: it does."""
        admit_api_spec(spec, self.spec, host_paths=self.host_paths, allow_extra_args=self.allow_extra_args)
        if self._served_spec is not UNCLAIMED or self._own_spec_held:
            admit_snapshot_source(spec, self._own_spec.snapshot_source if self._own_spec else None)

    def _claimed(self) -> None:
        self._lease.ledger.claimed()
        metrics.leases_claimed.inc()
        self.events.publish("claimed", generation=self.generation)

    async def _recycle_locked(self, *, boot: bool, claim: bool = False, token: str | None = None) -> None:
        """``claim``: the fresh generation is the claiming lease's (of ``token``) from the start (its
        boot is never captured, and no other claim can take it in the meantime)."""
        started = time.monotonic()
        with self._lease.recycling():
            await self._recycle_steps(started, boot=boot, claim=claim, token=token)

    async def _recycle_steps(self, started: float, *, boot: bool, claim: bool, token: str | None) -> None:
        with metrics.outcome(metrics.recycles):
            await self._power.stop(graceful=False)
            # disk files, scrollback, console clients, the ledger's summary
            await self._lease.clear(claim=claim, token=token)
            self._power.machine.forget_lease()  # timings, last exit
            self._phases.last_error = None
            # again, under the lock, with no await before the generation moves on: the ending lease's
            # calls still passed while this recycle waited for the lock (a claim's, behind its power
            # operation), and a transfer one of them began meanwhile runs outside the lock: left in
            # the slot, it would refuse the next lease's flash and dump (409) until its deadline
            self.transfers.cancel(f"the lease it belonged to ended (generation {self.generation} was recycled)")
            self.events.generation += 1
            self._phases.set(Phase.STOPPED, reason="recycled")
            self.events.publish("recycled", generation=self.generation)
            if self._served_spec is not UNCLAIMED and self.spec != self._served_spec:  # a lease set its own
                await self._apply_spec(self._served_spec)
            if boot and self.spec is not None and self.spec.image:
                self._boot_on_spec = False
                await self._power.boot(self.spec, recycle_started=started)

    # ---- disks ---------------------------------------------------------------------------
    async def pull(self, reference: str | None = None, *, progress: Progress | None = None,
                   transfer: Transfer | None = None) -> DiskImage:
        """Pull an image into the cache (or reuse it) as a base disk; nothing is installed (``Transfers.pull``)."""
        return await self._power.pull(require_spec(self.spec), reference, progress=progress, transfer=transfer)

    async def flash(self, chunks: AsyncIterable[bytes], *, power_off: bool = False, expected_size: int | None = None,
                    expected_digest: str | None = None) -> VmState:
        """Replace the disk with a streamed image (``DiskOps.flash``)."""
        await self._disk_ops.flash(chunks, power_off=power_off, expected_size=expected_size,
                                   expected_digest=expected_digest)
        return self.state()

    def reserve_flash(self, reference: str, *, power_off: bool = False) -> Transfer:
        """Refuse a flash from ``reference`` that cannot start, else reserve its transfer for
        ``flash_reference`` (``DiskOps.reserve_flash``).

        :raise GenerationChangedError: the call is bound to a lease that ended since it arrived (its
            pull runs in a task of its own, which the power lock's check does not see)."""
        self._lease.require_bound_call()
        return self._disk_ops.reserve_flash(reference, power_off=power_off)

    async def flash_reference(self, reference: str, *, power_off: bool = False, progress: Progress | None = None,
                              transfer: Transfer | None = None) -> VmState:
        """Pull an image by reference, ``progress`` hearing every chunk, and make it the disk
        (``DiskOps.flash_reference``)."""
        await self._disk_ops.flash_reference(self.spec, reference, power_off=power_off, progress=progress,
                                             transfer=transfer)
        return self.state()

    async def dump(self, fmt: str = "qcow2", *, transfer: Transfer | None = None) -> Path:
        """Write the current disk (base + this lease's changes) to a new standalone image file,
        which the caller deletes (``DiskOps.dump``); cancelling ``transfer`` stops it."""
        return await self._disk_ops.dump(self.spec, fmt, transfer)
