"""The VM controller: the one state machine behind the API, the CLI and the drivers.

Every public operation takes the power lock (so requests are serialized and there are never two
hypervisors), checks the phase it needs at the door, and publishes events. Disks, streams and
readiness are delegated to their own modules; this one decides *when*.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmsidecar_contract.canhost import check_native_can
from vmsidecar_contract.errors import GuestError, HostError, SpecError, VmsidecarError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import BOOTABLE, LIVE, ExitInfo, Phase, Timings, VmState, require

from .. import ports
from ..accel import AccelChoice, choose_accel
from ..backend import Backend, BackendEvent, BackendFactory, create_backend
from ..events import EventBus
from ..firmware import prepare_firmware
from ..hostpaths import HostPathPolicy
from ..plan import BootPlan
from ..snapshots import CONSOLES, Snapshot
from .disk_ops import DEFAULT_PULL_TIMEOUT_S, DiskOperations, Transfer
from .disks import Disks
from .lease_ops import LeaseOperations
from .paths import RuntimePaths
from .readiness import ReadinessWatch, readiness_state
from .snapshot_ops import SnapshotOperations
from .streams import GuestStreams

log = logging.getLogger(__name__)

#: RESET events this soon after a boot started belong to that boot (see ``_is_new_boot``)
RESET_COALESCE_S = 1.0
#: launches tried when a forward's host port is taken between its choice and QEMU's bind
PORT_ATTEMPTS = 3


def disk_io_error(data: dict[str, Any], paths: RuntimePaths) -> HostError:
    """What a guest paused by a host I/O error on its disk (``guest.io_error``, action stop) is told."""
    why = data.get("reason") or "I/O error"
    if data.get("nospace"):
        return HostError(
            f"the state volume is full: the guest's disk overlay {paths.overlay} cannot grow ({why}), so the guest "
            f"is paused; recycle to drop this lease's disk changes (a power cycle keeps them), and give the state "
            f"directory {paths.state} a larger volume (the emptyDir's sizeLimit, --state-dir) if the guest needs more")
    return HostError(f"the guest's disk could not be {'read' if data.get('operation') == 'read' else 'written'} on "
                     f"the host ({why}), so the guest is paused; check the volume of {paths.state} and recycle")


class VmController(DiskOperations, LeaseOperations, SnapshotOperations):
    """Owns one VM: its spec, disks, backend process, streams and phase."""

    def __init__(
        self,
        spec: VmSpec | None,
        paths: RuntimePaths,
        *,
        backend_factory: BackendFactory = create_backend,
        allow_extra_args: bool = False,
        host_paths: HostPathPolicy | None = None,
        pull_fn: Callable[..., Any] | None = None,
        pull_timeout: float = DEFAULT_PULL_TIMEOUT_S,
    ) -> None:
        self.spec = spec
        self.paths = paths
        self.events = EventBus()
        self.phase = Phase.STOPPED
        self.allow_extra_args = allow_extra_args
        #: host paths API callers may name (none by default); the runtime's own config may name any
        self.host_paths = host_paths or HostPathPolicy()
        self.disks = Disks(paths, pull_fn)
        self.pull_timeout = pull_timeout
        #: the one disk transfer under way (a lease's flash), cancelled when its lease ends
        self._transfer: Transfer | None = None
        self.streams = GuestStreams(paths)
        self.shutdown_requested = asyncio.Event()
        self._backend_factory = backend_factory
        self._lock = asyncio.Lock()
        self._backend: Backend | None = None
        self._plan: BootPlan | None = None
        self._accel: AccelChoice | None = None
        self._readiness = ReadinessWatch(self._mark_ready, lambda e: self._fail(Phase.ERROR, e))
        self._timings = Timings()
        self._last_error: VmsidecarError | None = None
        self._last_exit: ExitInfo | None = None
        self._expect_exit = False
        self._claimed = False
        #: boots since the runtime started (power-on, reset, guest reboot): scrollback, first-byte
        #: time and readiness belong to one boot, so a reader can never take the last boot for this one
        self._boot_count = 0
        self._boot_started = 0.0
        #: started without an image (a pool pod): boot as soon as a spec with an image arrives
        self._boot_on_spec = spec is None or not spec.image
        self._background: set[asyncio.Task[None]] = set()
        self._init_snapshots()

    # ---- state ---------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """Bumped by every recycle: the lease counter of this instance."""
        return self.events.generation

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _set_phase(self, phase: Phase, **data: Any) -> None:
        if phase != self.phase:
            log.info("phase %s -> %s", self.phase.value, phase.value)
            self.phase = phase
            self.events.publish("phase", phase=phase.value, **data)

    def _fail(self, phase: Phase, error: VmsidecarError) -> None:
        self._last_error = error
        log.error("%s", error.message)
        self._set_phase(phase, error=error.to_dict())

    def state(self) -> VmState:
        """A snapshot for ``GET /v1/vm``."""
        disk = self.disks.current
        plan = self._plan
        forwards = {}
        if plan is not None:
            forwards = {f.name: f"{f.host_address}:{plan.ports[f.name]}"
                        for f in plan.spec.network.forwards if f.name in plan.ports}
        return VmState(
            phase=self.phase,
            generation=self.generation,
            boot=self._boot_count,
            claimed=self._claimed,
            backend=self.spec.backend if self.spec else "qemu",
            image=self.spec.image if self.spec else None,
            image_digest=disk.digest if disk else None,
            disk=disk.source if disk else None,
            accel=self._accel.accel if self._accel else None,
            accel_reason=self._accel.reason if self._accel else None,
            timings=self._timings,
            forwards=forwards,
            sockets=self.streams.sockets(),
            last_error=self._last_error.to_dict() if self._last_error else None,
            last_exit=self._last_exit,
            console_tail=self.streams.tail() if self.phase in (Phase.ERROR, Phase.CRASHED) else None,
            snapshot=self.snapshot_info,
            **readiness_state(self.spec, self.disks.current),
        )

    # ---- lifecycle of the controller -----------------------------------------------------
    async def start(self, *, boot: bool = True) -> None:
        """Open the streams; with an image in the spec, pull and boot in the background."""
        for d in (self.paths.cache, self.paths.state, self.paths.run):
            d.mkdir(parents=True, exist_ok=True)
        await self.disks.discard_earlier_process()
        if self.spec is not None:
            await self.streams.open_for(self.spec)
            if boot and self.spec.image:
                self._spawn(self._autostart())

    async def _autostart(self) -> None:
        with contextlib.suppress(VmsidecarError):  # already recorded as last_error / phase
            await self.power_on()

    async def close(self) -> None:
        """Stop the guest (bounded) and close every socket."""
        async with self._lock:
            await self._stop_backend(graceful=True, timeout=20)
        await self.streams.close()

    async def kill(self) -> None:
        """Last resort (grace period over): SIGKILL the backend, whatever the controller was doing."""
        backend = self._backend
        if backend is not None and backend.alive:
            await backend.kill()
        await self.streams.close()

    # ---- spec ----------------------------------------------------------------------------
    async def set_spec(self, spec: VmSpec, *, from_api: bool = True) -> bool:
        """Replace the spec; returns False when it equals the current one (idempotent).

        :raise SpecError: extra_args over the API without --allow-extra-args.
        :raise HostPathError: a host path over the API that the administrator did not allow.
        :raise StateError: while the VM runs with a different spec.
        """
        if from_api and spec.extra_args and not self.allow_extra_args:
            raise SpecError(
                "extra_args may only be set by an administrator; start the runtime with --allow-extra-args "
                "or put them in the runtime's own --spec file"
            )
        if from_api:
            self.host_paths.check_spec(spec, self.spec)
        check_native_can(spec)
        async with self._lock:
            if spec == self.spec:
                return False
            require(self.phase, BOOTABLE, "replace the spec")
            if self.spec is None or spec.image != self.spec.image or spec.arch != self.spec.arch:
                self.disks.forget_image()
            self.spec = spec
            await self.streams.open_for(spec)
            self.events.publish("spec", spec=spec.model_dump(mode="json"))
            if self._boot_on_spec and spec.image:
                self._boot_on_spec = False
                self._spawn(self._autostart())
            return True

    def _require_spec(self) -> VmSpec:
        if self.spec is None:
            raise SpecError("the runtime has no VM spec yet; PUT /v1/vm/spec or start it with --spec/--image",
                            code="no_spec")
        return self.spec

    # ---- power ---------------------------------------------------------------------------
    async def power_on(self) -> VmState:
        """Boot the guest (pulling the image first if needed); idempotent like a latched switch.

        :raise StateError: while stopping.
        """
        async with self._lock:
            if self.phase in LIVE:
                return self.state()
            require(self.phase, BOOTABLE, "power on")
            await self._boot()
            return self.state()

    async def _boot(self) -> None:
        """Boot: restore the snapshot when this fresh overlay of the spec's image has one, else cold."""
        spec = self._require_spec()
        await self._stop_backend(graceful=False)  # a leftover from Error/Crashed
        try:
            check_native_can(spec)
            await self._ensure_disk()
            self._set_phase(Phase.STARTING)
            self._accel = choose_accel(spec.accel, spec.arch)
            snap = self._plan_snapshot(spec, self._accel.accel)
            if snap is not None and await self._restore_or_fall_back(snap):
                self._set_ready()
                return
            await self._cold_boot()
        except VmsidecarError as e:
            await self._stop_backend(graceful=False)
            self._fail(Phase.ERROR, e)
            raise

    def _new_plan(self, overlay: Path, incoming: Path | None = None) -> BootPlan:
        spec = self._require_spec()
        assert self._accel is not None
        return BootPlan(spec=spec, accel=self._accel.accel, disk=overlay, disk_format="qcow2",
                        run_dir=self.paths.run, ports=ports.allocate(spec.network.forwards),
                        firmware=prepare_firmware(spec, self.paths.state), incoming=incoming)

    async def _launch(self, overlay: Path, incoming: Path | None = None) -> None:
        """Start the backend paused, attach every stream, then let the guest run.

        A free host port for a forward is only free until QEMU binds it: another process may take
        it in between. QEMU then refuses the forwarding rule and exits; the launch is retried on
        new ports.
        """
        for attempt in range(1, PORT_ATTEMPTS + 1):
            plan = self._new_plan(overlay, incoming)
            self._plan = plan
            self._expect_exit = False
            self._last_exit = None
            self._backend = self._backend_factory(plan, self._on_backend_event)
            await self.streams.before_launch(plan)
            try:
                await self._backend.launch()
                break
            except HostError as e:
                if "host forwarding rule" not in e.message or attempt == PORT_ATTEMPTS:
                    raise
                log.warning("a forward's host port was taken before QEMU bound it; retrying on new ports")
                await self._quiet_stop()
        assert self._backend is not None
        await self.streams.attach(plan)
        await self._backend.resume()
        assert self._accel is not None
        self._set_phase(Phase.RUNNING, accel=self._accel.accel, accel_reason=self._accel.reason)

    async def _cold_boot(self) -> None:
        """Boot the guest from its disk; the readiness watch decides when it is Ready."""
        overlay = await self.disks.overlay()
        self._begin_boot("power-on")
        self.snapshot_info = self.snapshot_info.model_copy(update={"boot": "cold"})
        await self._launch(overlay)
        self._readiness.arm(self._require_spec(), self.streams.hubs, self.disks.current)

    async def _launch_restored(self, snap: Snapshot, *, new_boot: bool = True) -> None:
        """Run from a memory snapshot: a fresh overlay on its frozen disk; a new boot shows the
        pristine boot's scrollback (a capture continues the boot it interrupted)."""
        overlay = await self.disks.overlay(self._overlay_backing(snap))
        if new_boot:
            self._begin_boot("restore")
            self.streams.preload({name: snap.console(name) for name in CONSOLES})
        await self._launch(overlay, snap.memory)

    async def power_off(self, *, graceful: bool = True, timeout: float = 60.0) -> VmState:
        """Power the guest off: ACPI first when graceful (bounded by ``timeout``), then quit."""
        async with self._lock:
            await self._off_locked(graceful=graceful, timeout=timeout)
            return self.state()

    async def _off_locked(self, *, graceful: bool, timeout: float) -> None:
        if self.phase in LIVE or self.phase == Phase.ERROR:
            await self._stop_backend(graceful=graceful, timeout=timeout)
        self._set_phase(Phase.STOPPED)

    async def reset(self) -> VmState:
        """Hard reset, like the reset button; the guest reboots on the same disk.

        :raise StateError: unless the guest runs.
        """
        async with self._lock:
            require(self.phase, LIVE, "reset")
            assert self._backend is not None
            self._readiness.disarm()
            self._begin_boot("reset")
            await self._backend.reset()
            self._set_phase(Phase.RUNNING, reason="reset")
            self._readiness.arm(self._require_spec(), self.streams.hubs, self.disks.current)
            return self.state()

    async def cycle(self, *, graceful: bool = False, timeout: float = 60.0) -> VmState:
        """Off then on (hard off by default, like a power strip)."""
        async with self._lock:
            await self._off_locked(graceful=graceful, timeout=timeout)
            await self._boot()
            return self.state()

    async def _stop_backend(self, *, graceful: bool, timeout: float = 60.0) -> None:
        backend = self._backend
        if backend is None:
            return
        self._readiness.disarm()
        self._expect_exit = True
        if backend.alive:
            # A guest still booting has nothing to save and usually no ACPI handler yet: stop it hard.
            graceful = graceful and self.phase == Phase.READY
            self._set_phase(Phase.STOPPING, graceful=graceful)
            if graceful:
                await self._acpi_powerdown(backend, timeout)
        await self._quiet_stop()

    async def _quiet_stop(self) -> None:
        """End the backend process without a phase change (also the capture's hand-over)."""
        backend = self._backend
        if backend is None:
            return
        self._expect_exit = True
        await backend.quit(timeout=5 if backend.alive else 1)
        self._last_exit = backend.exit_info
        await self.streams.detach()
        self._backend = None

    async def _acpi_powerdown(self, backend: Backend, timeout: float) -> bool:
        """Press the ACPI power button and wait for the guest to power off; False on timeout."""
        async with self.events.listen({BackendEvent.POWERED_OFF, BackendEvent.EXITED}) as queue:
            try:
                await backend.powerdown()
                await asyncio.wait_for(queue.get(), timeout)
                return True
            except (VmsidecarError, OSError, EOFError):
                return False
            except TimeoutError:
                log.warning("guest ignored ACPI power-down for %.0f s; forcing it off", timeout)
                self.events.publish("powerdown_timeout", timeout=timeout)
                return False

    # ---- per boot ------------------------------------------------------------------------
    def _begin_boot(self, reason: str) -> None:
        """A new boot starts: its own scrollback, first-byte time and readiness timings."""
        self._boot_count += 1
        self._boot_started = time.monotonic()
        self._timings = Timings(launched_at=time.time(), pull=self._timings.pull)
        self.streams.new_boot()
        self.events.publish("boot", boot=self._boot_count, reason=reason)

    def _is_new_boot(self) -> bool:
        """Whether a RESET event starts a boot. Our own system_reset, and the one or two resets
        SeaBIOS adds within ~50 ms of it, belong to the boot already begun; so does a reset before
        the boot printed anything. No guest reboots within a second of starting."""
        return self.streams.boot_has_output() and time.monotonic() - self._boot_started > RESET_COALESCE_S

    def _mark_ready(self) -> None:
        """The readiness watch saw the pattern: Ready, unless this boot first captures a snapshot."""
        if not self._ready_or_capture():
            self._set_ready()

    def _set_ready(self) -> None:
        first = self.streams.first_byte_at()
        self._timings = self._timings.model_copy(update={
            "ready": round(time.monotonic() - self._boot_started, 3),
            "first_console_byte": round(first - self._boot_started, 3) if first else None,
        })
        self._set_phase(Phase.READY, timings=self._timings.model_dump())

    # ---- backend events ------------------------------------------------------------------
    def _on_backend_event(self, event: BackendEvent, data: dict[str, Any]) -> None:
        self.events.publish(event.value, **data)
        backend = self._backend
        if event == BackendEvent.POWERED_OFF and backend is not None and not self._expect_exit:
            # The guest powered itself off (or answered ACPI): the backend waits; end it.
            self._expect_exit = True
            self._spawn(self._guest_powered_off(backend, data))
        elif event == BackendEvent.RESET and self.phase in (Phase.RUNNING, Phase.READY) and self._is_new_boot():
            self._begin_boot("guest reboot")
            self._set_phase(Phase.RUNNING, reason="guest reset")
            self._readiness.arm(self._require_spec(), self.streams.hubs, self.disks.current)
        elif event == BackendEvent.EXITED and backend is not None and not self._expect_exit:
            self._spawn(self._backend_crashed(backend))
        elif event == BackendEvent.IO_ERROR and data.get("action") == "stop" and self.phase in LIVE:
            self._readiness.disarm()
            self._fail(Phase.ERROR, disk_io_error(data, self.paths))

    async def _guest_powered_off(self, backend: Backend, data: dict[str, Any]) -> None:
        async with self._lock:
            if self._backend is backend:
                await self._stop_backend(graceful=False)
                self._set_phase(Phase.STOPPED, reason=data.get("reason", "guest-shutdown"))

    async def _backend_crashed(self, backend: Backend) -> None:
        async with self._lock:
            if self._backend is not backend:
                return
            self._readiness.disarm()
            info = backend.exit_info or ExitInfo()
            why = info.reason  # libvirt knows no exit status, only why the domain stopped
            info.reason = f"{backend.label} exited without being asked to"
            self._last_exit = info
            await self.streams.detach()
            self._backend = None
            how = (f"signal {info.signal}" if info.signal else f"exit code {info.returncode}"
                   if info.returncode is not None or not why else why)
            tail = " | ".join(info.stderr_tail[-3:]) or "no output"
            self._fail(Phase.CRASHED, GuestError(
                f"{backend.label} died unexpectedly ({how}; stderr: {tail}); power on again to recover"))

    async def shutdown(self) -> None:
        """Stop the guest and ask the runtime process to exit 0 (ExitAndReplace)."""
        async with self._lock:
            await self._stop_backend(graceful=True, timeout=20)
            self._set_phase(Phase.STOPPED, reason="shutdown")
        self.shutdown_requested.set()
