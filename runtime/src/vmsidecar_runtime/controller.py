"""The VM controller: the one state machine behind the API, the CLI and the drivers.

Every public operation takes the power lock (so requests are serialized and there are never
two QEMUs), checks the phase it needs at the door, and publishes events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from . import ports
from .accel import AccelChoice, choose_accel
from .canhost import check_native_can
from .console import ConsoleHub
from .devices.gpio import GpioDevice
from .disk import DiskImage, check_image, create_overlay, install_image, receive_image, run_tool
from .errors import GenerationChangedError, GuestError, HostError, ImageError, SpecError, VmsidecarError
from .events import EventBus
from .firmware import prepare_firmware
from .hostpaths import HostPathPolicy
from .plan import BootPlan
from .spec import VmSpec
from .state import BOOTABLE, LIVE, ExitInfo, Phase, Timings, VmState, require

log = logging.getLogger(__name__)

#: RESET events this soon after a boot started belong to that boot (see ``_is_new_boot``)
RESET_COALESCE_S = 1.0


class Backend(Protocol):
    """What the controller needs from a backend (direct QEMU or libvirt)."""

    name: str
    exit_info: ExitInfo | None

    async def launch(self) -> None: ...
    async def resume(self) -> None: ...
    async def powerdown(self) -> None: ...
    async def reset(self) -> None: ...
    async def quit(self, timeout: float = 5.0) -> None: ...
    async def kill(self) -> None: ...
    async def wait_exit(self, timeout: float | None = None) -> bool: ...
    @property
    def alive(self) -> bool: ...


BackendFactory = Callable[[BootPlan, Callable[[str, dict[str, Any]], None]], Backend]


@dataclass(frozen=True)
class RuntimePaths:
    """Where the runtime keeps things: shared sockets, image cache, per-instance state, private sockets."""

    shared: Path
    cache: Path
    state: Path
    run: Path

    def stream_socket(self, stream: str) -> Path:
        """The shared-dir socket for a guest stream (design §2)."""
        if stream == "ttyS0":
            return self.shared / "console.sock"
        if stream.startswith("can-"):
            return self.shared / "can" / f"{stream.removeprefix('can-')}.sock"
        if stream.startswith("channel-"):
            return self.shared / "channels" / f"{stream.removeprefix('channel-')}.sock"
        return self.shared / f"{stream}.sock"


def default_backend_factory(plan: BootPlan, on_event: Callable[[str, dict[str, Any]], None]) -> Backend:
    """Pick the backend the spec names."""
    if plan.spec.backend == "libvirt":
        from .libvirt_backend import LibvirtBackend  # optional extra

        return LibvirtBackend(plan, on_event)
    from .qemu.backend import QemuBackend

    return QemuBackend(plan, on_event)


class VmController:
    """Owns one VM: its spec, disks, backend process, consoles and phase."""

    def __init__(
        self,
        spec: VmSpec | None,
        paths: RuntimePaths,
        *,
        backend_factory: BackendFactory = default_backend_factory,
        allow_extra_args: bool = False,
        host_paths: HostPathPolicy | None = None,
        pull_fn: Callable[..., Any] | None = None,
    ) -> None:
        self.spec = spec
        self.paths = paths
        self.events = EventBus()
        self.phase = Phase.STOPPED
        self.allow_extra_args = allow_extra_args
        #: host paths API callers may name (none by default); the runtime's own config may name any
        self.host_paths = host_paths or HostPathPolicy()
        self._backend_factory = backend_factory
        self._pull_fn = pull_fn
        self._lock = asyncio.Lock()
        self._backend: Backend | None = None
        self._plan: BootPlan | None = None
        self._base: DiskImage | None = None
        self._flashed: DiskImage | None = None
        self._accel: AccelChoice | None = None
        self._timings = Timings()
        self._last_error: VmsidecarError | None = None
        self._last_exit: ExitInfo | None = None
        self._expect_exit = False
        self._claimed = False
        self._hubs: dict[str, ConsoleHub] = {}
        #: the vhost-user virtio-gpio backend + <shared>/gpio.sock, when the spec has GPIO lines
        self.gpio: GpioDevice | None = None
        self._ready_task: asyncio.Task[None] | None = None
        self._ready_window = b""
        self._launched_at = 0.0
        #: boots since the runtime started (power-on, reset, guest reboot): scrollback, first-byte
        #: time and readiness belong to one boot, so a reader can never take the last boot for this one
        self._boot_count = 0
        self.shutdown_requested = asyncio.Event()
        #: started without an image (a pool pod): boot as soon as a spec with an image arrives
        self._boot_on_spec = spec is None or not spec.image
        self._background: set[asyncio.Task[None]] = set()

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
        disk = self._flashed or self._base
        plan = self._plan
        forwards = {}
        if plan is not None:
            forwards = {
                f.name: f"{f.host_address}:{plan.ports[f.name]}" for f in plan.spec.network.forwards if f.name in plan.ports
            }
        tail = None
        if self.phase in (Phase.ERROR, Phase.CRASHED) and "ttyS0" in self._hubs:
            tail = self._hubs["ttyS0"].tail()
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
            sockets={name: str(hub.listen_path) for name, hub in self._hubs.items()},
            last_error=self._last_error.to_dict() if self._last_error else None,
            last_exit=self._last_exit,
            console_tail=tail,
        )

    # ---- lifecycle of the controller -----------------------------------------------------
    async def start(self, *, boot: bool = True) -> None:
        """Open the consoles; with an image in the spec, pull and boot in the background."""
        for d in (self.paths.cache, self.paths.state, self.paths.run):
            d.mkdir(parents=True, exist_ok=True)
        if self.spec is not None:
            await self._open_hubs(self.spec)
            if boot and self.spec.image:
                self._spawn(self._autostart())

    async def _autostart(self) -> None:
        with contextlib.suppress(VmsidecarError):  # already recorded as last_error / phase
            await self.power_on()

    async def _open_hubs(self, spec: VmSpec) -> None:
        wanted = ["ttyS0", *(["hvc0"] if spec.virtio_console else [])]
        wanted += [f"channel-{c.name}" for c in spec.channels]
        wanted += [f"can-{c.name}" for c in spec.can if c.mode == "slcan"]
        for name in list(self._hubs):
            if name not in wanted:
                await self._hubs.pop(name).close()
        for name in wanted:
            if name not in self._hubs:
                is_console = name in ("ttyS0", "hvc0")
                hub = ConsoleHub(
                    name,
                    self.paths.stream_socket(name),
                    log_path=self.paths.state / f"{name}.log" if is_console else None,
                    replay=is_console,
                )
                await hub.listen()
                self._hubs[name] = hub
        if self.gpio is not None and [(x.name, x.direction, x.initial) for x in self.gpio.lines] != [
            (x.name, x.direction, x.initial) for x in spec.gpio
        ]:
            await self.gpio.close()
            self.gpio = None
        if spec.gpio and self.gpio is None:
            self.gpio = GpioDevice(spec.gpio)
            await self.gpio.listen_control(self.paths.shared / "gpio.sock")

    async def close(self) -> None:
        """Stop the guest (bounded) and close every socket."""
        async with self._lock:
            await self._stop_backend(graceful=True, timeout=20)
        for hub in self._hubs.values():
            await hub.close()
        self._hubs.clear()
        if self.gpio is not None:
            await self.gpio.close()

    async def kill(self) -> None:
        """Last resort (grace period over): SIGKILL the backend, whatever the controller was doing."""
        backend = self._backend
        if backend is not None and backend.alive:
            await backend.kill()
        for hub in self._hubs.values():
            await hub.close()
        self._hubs.clear()

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
            image_changed = self.spec is None or spec.image != self.spec.image or spec.arch != self.spec.arch
            self.spec = spec
            if image_changed:
                self._base = None
                self._flashed = None
                self._overlay.unlink(missing_ok=True)
            await self._open_hubs(spec)
            self.events.publish("spec", spec=spec.model_dump(mode="json"))
            if self._boot_on_spec and spec.image:
                self._boot_on_spec = False
                self._spawn(self._autostart())
            return True

    # ---- images --------------------------------------------------------------------------
    @property
    def _overlay(self) -> Path:
        return self.paths.state / "overlay.qcow2"

    @property
    def _flash_dir(self) -> Path:
        return self.paths.state / "flashed"

    async def pull(self, reference: str | None = None, *, progress: Callable[[int, int | None], None] | None = None
                   ) -> DiskImage:
        """Pull an image into the cache (or reuse it) and return it as a base disk.

        :raise ImageError: for every pull failure, with the cause and the fix.
        """
        from .oci import pull as oci_pull

        spec = self._require_spec()
        ref = reference or spec.image
        if not ref:
            raise SpecError("the spec has no image; set image (an OCI reference, oci-layout:DIR or file:PATH)")
        started = time.monotonic()

        def report(done: int, total: int | None) -> None:
            if progress:
                progress(done, total)

        pulled = await asyncio.to_thread(self._pull_fn or oci_pull, ref, self.paths.cache, arch=spec.arch,
                                         progress=report)
        await check_image(pulled.path, pulled.format, f"image {ref}")  # also re-checks older cache entries
        self._timings = self._timings.model_copy(update={"pull": round(time.monotonic() - started, 3)})
        self.events.publish("pulled", reference=ref, digest=pulled.digest, cached=pulled.cached,
                            bytes_downloaded=pulled.bytes_downloaded)
        return DiskImage(pulled.path, pulled.format, pulled.digest, ref)

    async def _ensure_base(self) -> DiskImage:
        if self._flashed is not None:
            return self._flashed
        if self._base is None:
            previous = self.phase
            self._set_phase(Phase.PULLING)
            try:
                self._base = await self.pull()
            except VmsidecarError as e:
                self._fail(Phase.ERROR, e)
                raise
            self._set_phase(previous if previous != Phase.PULLING else Phase.STOPPED)
        return self._base

    def _require_spec(self) -> VmSpec:
        if self.spec is None:
            raise SpecError("the runtime has no VM spec yet; PUT /v1/vm/spec or start it with --spec/--image",
                            code="no_spec")
        return self.spec

    # ---- power ---------------------------------------------------------------------------
    async def power_on(self) -> VmState:
        """Boot the guest (pulling the image first if needed).

        :raise StateError: when already on.
        """
        async with self._lock:
            if self.phase in LIVE:
                return self.state()  # on is idempotent, like pressing a latched power switch
            require(self.phase, BOOTABLE, "power on")
            await self._boot()
            return self.state()

    async def _boot(self) -> None:
        spec = self._require_spec()
        await self._stop_backend(graceful=False)  # a leftover from Error/Crashed
        try:
            check_native_can(spec)
            base = await self._ensure_base()
            self._set_phase(Phase.STARTING)
            self._accel = choose_accel(spec.accel, spec.arch)
            if not self._overlay.exists():
                await create_overlay(base, self._overlay)
            plan = BootPlan(
                spec=spec,
                accel=self._accel.accel,
                disk=self._overlay,
                disk_format="qcow2",
                run_dir=self.paths.run,
                ports=ports.allocate(spec.network.forwards),
                firmware=prepare_firmware(spec, self.paths.state),
            )
            self._plan = plan
            self._expect_exit = False
            self._last_exit = None
            self._last_error = None
            self._begin_boot("power-on")
            backend = self._backend_factory(plan, self._on_backend_event)
            self._backend = backend
            if self.gpio is not None:  # QEMU asks the vhost-user backend for its config at realize
                await self.gpio.start_vhost(plan.run_dir / "gpio-vhost.sock")
            await backend.launch()
            for name in plan.stream_names:
                hub = self._hubs.get(name)
                if hub is not None:
                    await hub.attach(plan.console_socket(name))
            await backend.resume()
        except VmsidecarError as e:
            await self._stop_backend(graceful=False)
            self._fail(Phase.ERROR, e)
            raise
        self._set_phase(Phase.RUNNING, accel=self._accel.accel, accel_reason=self._accel.reason)
        self._arm_readiness()

    async def power_off(self, *, graceful: bool = True, timeout: float = 60.0) -> VmState:
        """Power the guest off: ACPI first when graceful (bounded by ``timeout``), then quit."""
        async with self._lock:
            if self.phase in LIVE or self.phase == Phase.ERROR:
                await self._stop_backend(graceful=graceful, timeout=timeout)
            self._set_phase(Phase.STOPPED)
            return self.state()

    async def reset(self) -> VmState:
        """Hard reset, like the reset button; the guest reboots on the same disk."""
        async with self._lock:
            require(self.phase, LIVE, "reset")
            assert self._backend is not None
            self._disarm_readiness()
            self._begin_boot("reset")
            await self._backend.reset()
            self._set_phase(Phase.RUNNING, reason="reset")
            self._arm_readiness()
            return self.state()

    async def cycle(self, *, graceful: bool = False, timeout: float = 60.0) -> VmState:
        """Off then on (hard off by default, like a power strip)."""
        async with self._lock:
            if self.phase in LIVE or self.phase == Phase.ERROR:
                await self._stop_backend(graceful=graceful, timeout=timeout)
            self._set_phase(Phase.STOPPED)
            await self._boot()
            return self.state()

    async def _stop_backend(self, *, graceful: bool, timeout: float = 60.0) -> None:
        backend = self._backend
        if backend is None:
            return
        self._disarm_readiness()
        self._expect_exit = True
        if backend.alive:
            # A guest still booting has nothing to save and usually no ACPI handler yet: stop it hard.
            graceful = graceful and self.phase == Phase.READY
            self._set_phase(Phase.STOPPING, graceful=graceful)
            if graceful:
                await self._acpi_powerdown(backend, timeout)
            await backend.quit()
        else:
            await backend.quit(timeout=1)
        self._last_exit = backend.exit_info
        if self.gpio is not None:
            await self.gpio.stop_vhost()
        for name, hub in self._hubs.items():
            if name in ("ttyS0", "hvc0") or name.startswith(("can-", "channel-")):
                await hub.detach()
        self._backend = None

    async def _acpi_powerdown(self, backend: Backend, timeout: float) -> bool:
        """Press the ACPI power button and wait for the guest to power off; False on timeout."""
        async with self.events.listen({"qemu.shutdown", "qemu.exited"}) as queue:
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

    # ---- backend events ------------------------------------------------------------------
    def _on_backend_event(self, name: str, data: dict[str, Any]) -> None:
        self.events.publish(f"qemu.{name.lower()}", **data)
        backend = self._backend
        if name == "SHUTDOWN" and backend is not None and not self._expect_exit:
            # The guest powered itself off (or answered ACPI): with -no-shutdown QEMU waits; end it.
            self._expect_exit = True
            self._spawn(self._guest_powered_off(backend, data))
        elif name == "RESET" and self.phase in (Phase.RUNNING, Phase.READY) and self._is_new_boot():
            self._begin_boot("guest reboot")
            self._set_phase(Phase.RUNNING, reason="guest reset")
            self._arm_readiness()
        elif name == "EXITED" and backend is not None and not self._expect_exit:
            self._spawn(self._backend_crashed(backend))

    async def _guest_powered_off(self, backend: Backend, data: dict[str, Any]) -> None:
        async with self._lock:
            if self._backend is backend:
                await self._stop_backend(graceful=False)
                self._set_phase(Phase.STOPPED, reason=data.get("reason", "guest-shutdown"))

    async def _backend_crashed(self, backend: Backend) -> None:
        async with self._lock:
            if self._backend is not backend:
                return
            self._disarm_readiness()
            info = backend.exit_info or ExitInfo()
            backend_reason = info.reason  # libvirt knows no exit status, only why the domain stopped
            info.reason = "QEMU exited without being asked to"
            self._last_exit = info
            for hub in self._hubs.values():
                await hub.detach()
            self._backend = None
            how = (f"signal {info.signal}" if info.signal else f"exit code {info.returncode}"
                   if info.returncode is not None or not backend_reason else backend_reason)
            tail = " | ".join(info.stderr_tail[-3:]) or "no output"
            self._fail(
                Phase.CRASHED,
                GuestError(f"QEMU died unexpectedly ({how}; stderr: {tail}); power on again to recover"),
            )

    # ---- per boot ------------------------------------------------------------------------
    def _begin_boot(self, reason: str) -> None:
        """A new boot starts: its own scrollback, first-byte time and readiness timings."""
        self._boot_count += 1
        self._launched_at = time.monotonic()
        self._timings = Timings(launched_at=time.time(), pull=self._timings.pull)
        for hub in self._hubs.values():
            hub.new_boot()
        self.events.publish("boot", boot=self._boot_count, reason=reason)

    def _is_new_boot(self) -> bool:
        """Whether a RESET event starts a boot. Our own system_reset, and the one or two resets
        SeaBIOS adds within ~50 ms of it, belong to the boot already begun; so does a reset before
        the boot printed anything. No guest reboots within a second of starting."""
        printed = any(hub.bytes_seen for name, hub in self._hubs.items() if name in ("ttyS0", "hvc0"))
        return printed and time.monotonic() - self._launched_at > RESET_COALESCE_S

    # ---- readiness -----------------------------------------------------------------------
    def _arm_readiness(self) -> None:
        self._disarm_readiness()
        spec = self._require_spec()
        if spec.readiness.pattern is None:
            self._mark_ready()
            return
        hub = self._hubs.get(spec.readiness.console)
        if hub is None:
            self._fail(Phase.ERROR, SpecError(f"readiness console {spec.readiness.console} is not enabled in the spec"))
            return
        self._ready_task = asyncio.create_task(self._await_ready(hub, spec), name="readiness")

    def _disarm_readiness(self) -> None:
        if self._ready_task is not None and self._ready_task is not asyncio.current_task():
            self._ready_task.cancel()
        self._ready_task = None

    async def _await_ready(self, hub: ConsoleHub, spec: VmSpec) -> None:
        pattern = re.compile(spec.readiness.pattern.encode())  # type: ignore[union-attr]
        seen = asyncio.Event()
        window = bytearray()

        def on_data(data: bytes) -> None:
            window.extend(data)
            if pattern.search(window):
                seen.set()
            del window[:-4096]

        with hub.watch(on_data):
            try:
                await asyncio.wait_for(seen.wait(), spec.readiness.timeout)
            except TimeoutError:
                tail = hub.tail(800).strip().replace("\r", "")
                self._fail(
                    Phase.ERROR,
                    GuestError(
                        f"the guest did not print {spec.readiness.pattern!r} on {spec.readiness.console} within "
                        f"{spec.readiness.timeout:.0f} s (console tail: {tail[-400:]!r}); check the image boots, "
                        "or change readiness.pattern/timeout"
                    ),
                )
                return
        self._mark_ready()

    def _mark_ready(self) -> None:
        now = time.monotonic()
        hub = self._hubs.get("ttyS0")
        first = hub.first_byte_at if hub else None
        self._timings = self._timings.model_copy(
            update={
                "ready": round(now - self._launched_at, 3),
                "first_console_byte": round(first - self._launched_at, 3) if first else None,
            }
        )
        self._set_phase(Phase.READY, timings=self._timings.model_dump())

    async def wait_for_phase(self, *phases: Phase, timeout: float) -> Phase:
        """Wait until the VM is in one of ``phases``.

        :raise TimeoutError: when it does not get there in time.
        """
        async with self.events.listen({"phase"}) as queue:
            deadline = asyncio.get_running_loop().time() + timeout
            while self.phase not in phases:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    raise TimeoutError(f"VM is {self.phase.value}, not {'|'.join(p.value for p in phases)}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(queue.get(), remaining)
            return self.phase

    # ---- recycle, flash, dump ------------------------------------------------------------
    async def recycle(self, *, boot: bool = True, if_generation: int | None = None) -> VmState:
        """Back to pristine: guest stopped, overlay and flashed disks discarded, consoles cleared,
        generation bumped; then boot a fresh overlay of the spec's image.

        :raise GenerationChangedError: when ``if_generation`` is no longer the current one (an
            earlier recycle already happened, e.g. the next lease claimed the VM first).
        """
        async with self._lock:
            if if_generation is not None and if_generation != self.generation:
                raise GenerationChangedError(
                    f"generation {if_generation} was already recycled (now {self.generation}); nothing to do"
                )
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
        self._overlay.unlink(missing_ok=True)
        self._flashed = None
        shutil.rmtree(self._flash_dir, ignore_errors=True)
        shutil.rmtree(self.paths.state / "firmware", ignore_errors=True)
        for hub in self._hubs.values():
            hub.clear(disconnect_clients=True)
        self._timings = Timings()
        self._last_error = None
        self._last_exit = None
        self._claimed = False
        self.events.generation += 1
        self._set_phase(Phase.STOPPED, reason="recycled")
        self.events.publish("recycled", generation=self.generation)
        if boot and self.spec is not None and self.spec.image:
            await self._boot()

    async def flash(
        self,
        chunks: AsyncIterable[bytes],
        *,
        power_off: bool = False,
        expected_size: int | None = None,
        expected_digest: str | None = None,
    ) -> VmState:
        """Replace the disk with a streamed image (atomic; the old disk stays on any failure).

        :raise StateError: while the VM runs and ``power_off`` is not set.
        :raise ImageError: for a bad image.
        """
        async with self._lock:
            if self.phase in LIVE and not power_off:
                require(self.phase, BOOTABLE, "flash the disk", hint="or send power_off=true to power it off first")
            received = await receive_image(
                chunks, self._flash_dir, expected_size=expected_size, expected_digest=expected_digest
            )
            if self.phase in LIVE or self.phase == Phase.ERROR:
                await self._stop_backend(graceful=False)
                self._set_phase(Phase.STOPPED, reason="flash")
            previous = self._flashed
            self._flashed = install_image(received, self._flash_dir)
            if previous is not None and previous.path != self._flashed.path:
                previous.path.unlink(missing_ok=True)
            self._overlay.unlink(missing_ok=True)
            self.events.publish("flashed", digest=received.digest, size=received.size, format=received.format)
            return self.state()

    async def flash_reference(self, reference: str, *, power_off: bool = False,
                              progress: Callable[[int, int | None], None] | None = None) -> VmState:
        """Pull an image by reference (an API call: host paths only where allowed) and make it the
        disk (the cache keeps it read-only).

        :raise HostPathError: for a ``file:``/``oci-layout:`` reference the administrator did not allow.
        :raise StateError: while the VM runs (also when it was powered on during the pull) and
            ``power_off`` is not set.
        """
        self.host_paths.check_reference(reference)
        if self.phase in LIVE and not power_off:
            require(self.phase, BOOTABLE, "flash the disk", hint="or send power_off=true to power it off first")
        disk = await self.pull(reference, progress=progress)
        async with self._lock:
            if self.phase in LIVE and not power_off:  # powered on while the image was being pulled
                require(self.phase, BOOTABLE, "flash the disk", hint="or send power_off=true to power it off first")
            if self.phase in LIVE or self.phase == Phase.ERROR:
                await self._stop_backend(graceful=False)
                self._set_phase(Phase.STOPPED, reason="flash")
            self._flashed = disk
            self._overlay.unlink(missing_ok=True)
            self.events.publish("flashed", digest=disk.digest, reference=reference)
            return self.state()

    async def dump(self, fmt: str = "qcow2") -> Path:
        """Write the current disk (base + this lease's changes) to one standalone image file.

        :raise StateError: while the guest runs (its writes would make the copy inconsistent).
        """
        async with self._lock:
            require(self.phase, BOOTABLE, "dump the disk (power it off first)")
            source = self._overlay if self._overlay.exists() else (self._flashed or await self._ensure_base()).path
            out = self.paths.state / f"dump.{fmt}"
            rc, _, err = await run_tool("qemu-img", "convert", "-O", fmt, str(source), str(out))
            if rc != 0:
                raise HostError(f"cannot write the disk dump ({err.strip()}); free space in {out.parent}")
            return out

    async def shutdown(self) -> None:
        """Stop the guest and ask the runtime process to exit 0 (ExitAndReplace)."""
        async with self._lock:
            await self._stop_backend(graceful=True, timeout=20)
            self._set_phase(Phase.STOPPED, reason="shutdown")
        self.shutdown_requested.set()


__all__ = ["ImageError", "RuntimePaths", "VmController"]
