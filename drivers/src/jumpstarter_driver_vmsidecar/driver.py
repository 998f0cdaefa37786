"""``VirtualMachine``: the root driver of a VM served by the vmsidecar runtime.

Config (all optional but ``socket``)::

    vm:
      type: jumpstarter_driver_vmsidecar.driver.VirtualMachine
      config:
        socket: /shared/vmsidecar/api.sock
        recycle: InPlaceReuse          # or ExitAndReplace (default)
        spec: {image: REGISTRY/REPO:TAG, memory: 1G, network: {forwards: [{name: ssh, guest_port: 22}]}}

Children: ``power``, ``console`` (ttyS0), ``hvc0`` (virtio console), ``storage``, one network
child per named port forward of the spec, CAN (``can`` for a single bus, else one child per bus
named after the bus; upstream ``jumpstarter_driver_can.driver.Can`` → ``CanClient``) and ``gpio``
(one ``DigitalOutputClient``/``DigitalInputClient`` child per line).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jumpstarter.driver import Driver, export

from vmsidecar_contract.canhost import check_native_can
from vmsidecar_contract.client import RuntimeUnavailableError
from vmsidecar_contract.errors import GenerationChangedError, VmsidecarError
from vmsidecar_contract.spec import VmSpec, load_spec

from .arguments import seconds
from .console import VmConsole
from .lease_exit import request_exit_after_lease, serves_a_lease
from .link import RuntimeLink
from .metrics import lease_ended, lease_started, metered_driver
from .power import VmPower
from .storage import VmStorage
from .uploads import RefusesUploads

log = logging.getLogger(__name__)

RECYCLE_STRATEGIES = ("ExitAndReplace", "InPlaceReuse")
RESERVED_NAMES = {"power", "console", "hvc0", "storage", "can", "gpio"}
#: how long (and how often) a spec the runtime could not take at session start is offered again
SPEC_RETRY_S = 120.0
SPEC_RETRY_EVERY_S = 0.5
#: how long a tree handed the next lease waits for a claim attempt an earlier tree has under way:
#: long enough for that request to be at the runtime, which takes claims in the order they come
SUPERSEDE_WAIT_S = 1.0
#: the tree of each runtime (its API socket) that was handed a lease last
_lease_trees: dict[str, weakref.ref[VirtualMachine]] = {}
_lease_trees_lock = threading.Lock()


@metered_driver
@dataclass(kw_only=True)
class VirtualMachine(RefusesUploads, Driver):
    """A VM served by a vmsidecar runtime over its Unix-socket API."""

    socket: str = "/shared/vmsidecar/api.sock"
    spec: dict[str, Any] | None = None
    recycle: str = "ExitAndReplace"
    #: seconds the guest gets to answer ACPI power-down before it is forced off
    graceful_timeout: float = 60.0
    #: flashing a running VM powers it off first (False: refuse with a clear message)
    flash_power_off: bool = True
    #: let ``flash``/``dump`` URLs name this pod (loopback) or link-local addresses (the cloud
    #: metadata service): for a laptop serving its own disks; never in a shared pod
    allow_local_urls: bool = False
    link: RuntimeLink = field(init=False, repr=False)
    _spec: VmSpec | None = field(init=False, default=None, repr=False)
    #: upstream ``Can`` children, whose python-can buses ``close`` shuts down
    _can_children: list[Any] = field(init=False, default_factory=list, repr=False)
    #: when this tree's lease began (``metrics.lease_started``); None for a tree that serves no lease
    _lease_began: float | None = field(init=False, default=None, repr=False)
    #: set by ``close`` (and the next ``reset``): the background claim retry of this tree stops
    _retry_stop: threading.Event = field(init=False, default_factory=threading.Event, repr=False)
    #: held by that retry around each attempt, so ``close`` sees a claim it made before its stop
    _retry_gate: threading.Lock = field(init=False, default_factory=threading.Lock, repr=False)

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
        # The children a spec may not ask for import their upstream driver only when it does: the
        # network driver (websockets, wsproto, h11) and python-can cost more to import than the rest
        # of the tree, at every exporter start (a `jmp shell`'s included).
        if self._spec is not None and self._spec.network.forwards:
            from .network import VmForward
        for fwd in self._spec.network.forwards if self._spec else []:
            if fwd.name in RESERVED_NAMES:
                raise ValueError(f"port forward name {fwd.name!r} clashes with a child driver; rename the forward")
            self.children[fwd.name] = VmForward(parent=self, forward=fwd.name)
        if self._spec is not None:
            self._add_can(self._spec)
            if self._spec.gpio:
                from .gpio import VmGpio, VmGpioInput, VmGpioOutput

                gpio = VmGpio(parent=self)
                for line in self._spec.gpio:
                    kind = VmGpioOutput if line.direction == "in" else VmGpioInput
                    gpio.children[line.name] = kind(parent=self, line=line.name)
                self.children["gpio"] = gpio

    def _add_can(self, spec: VmSpec) -> None:
        """``can`` for one bus, else one child per bus (``VmCan``: upstream's ``Can``, its arguments
        checked); slcan buses use our python-can interface, native ones python-can's socketcan."""
        try:
            check_native_can(spec)
        except VmsidecarError as e:
            raise ValueError(f"spec in the exporter config: {e.message}") from e
        if spec.can:
            from .can import VmCan
        for bus in spec.can:
            name = "can" if len(spec.can) == 1 else bus.name
            if len(spec.can) > 1 and (name in RESERVED_NAMES or name in self.children):
                raise ValueError(f"CAN bus name {name!r} clashes with a child driver; rename the bus")
            if bus.mode == "slcan":
                channel = f"{Path(self.socket).parent / 'can' / f'{bus.name}.sock'};bitrate={bus.bitrate}"
                self.children[name] = VmCan(channel=channel, interface="vmsidecar-slcan")
            else:
                self.children[name] = VmCan(channel=bus.host_interface, interface="socketcan")
            self._can_children.append(self.children[name])

    @classmethod
    def client(cls) -> str:
        return "jumpstarter_driver_composite.client.CompositeClient"

    # ---- lease lifecycle -----------------------------------------------------------------
    def reset(self) -> None:
        """Session start: hand our spec to the runtime (idempotent); a tree handed out to a lease
        also claims the VM now, before the lease can do anything (lease_exit.serves_a_lease)."""
        super().reset()
        self._retry_stop.set()  # a retry of an earlier reset() holds the link this one replaces
        self._retry_stop = threading.Event()
        self.link = RuntimeLink(Path(self.socket), spec=self._spec, on_claim=self._on_claim)
        lease = serves_a_lease()
        if lease:
            self._supersede_the_last_lease_tree()
        if lease and self._lease_began is None:
            self._lease_began = lease_started()
        try:
            if lease:
                self.link.claim_now()  # pushes the spec first
            elif self._spec is not None:
                spec = self._spec
                self.link.run_sync(lambda c: c.put_spec(spec), timeout=30)
        except VmsidecarError as e:
            log.warning("could not %s yet (%s); will retry on first use", "claim the VM" if lease else
                        "push the spec to the runtime", e.message)
            if isinstance(e, RuntimeUnavailableError):
                self._push_spec_later(self.link, self._spec, claim=lease)
        except Exception as e:  # runtime not up yet, or its answer slower than the bound: the exporter keeps running
            log.warning("runtime not reachable at %s yet (%s); will retry on first use", self.socket, e)
            if isinstance(e, TimeoutError):  # a lease's tree must claim: CAN and forwards never ask
                self._push_spec_later(self.link, self._spec, claim=lease)

    def _supersede_the_last_lease_tree(self) -> None:
        """This tree serves the next lease: the tree of the last one (0.9.0 hands the next lease
        out before it closes the last one's tree) claims nothing from now on. A claim retry of its
        sent after this tree's claim would be carried out after it and recycle this lease's guest
        (the last lease's claim still waiting, the runtime's lock held past the claim's bound); an
        attempt of its under way is waited for briefly, so that it reaches the runtime first and
        this tree's claim recycles what it claims."""
        with _lease_trees_lock:
            last = _lease_trees.get(self.socket)
            _lease_trees[self.socket] = weakref.ref(self)
        tree = last() if last is not None else None
        if tree is None or tree is self:
            return
        tree.link.ended = True  # its calls still to come (a console's first use) claim nothing either
        tree._retry_stop.set()
        if tree._retry_gate.acquire(timeout=SUPERSEDE_WAIT_S):
            tree._retry_gate.release()

    def _push_spec_later(self, link: RuntimeLink, spec: VmSpec | None, *, claim: bool = False) -> None:
        """Keep offering the spec for a while (the lease's claim until it is taken or the lease ends) in
        the background: in a pod
        the exporter may start before the runtime serves, and a standalone exporter has no "first
        use" until someone connects — without this the guest would not boot and the pod would
        never be Ready. A claim's retry ends with this tree's lease (a claim after ``close`` would
        recycle the next lease's guest under it); a spec's goes on (0.9.0 closes the start-up tree at
        once, and the spec is what boots the pod's guest: idempotent, it claims nothing)."""
        if spec is None and not claim:
            return
        stop, gate = (self._retry_stop, self._retry_gate) if claim else (threading.Event(), threading.Lock())

        def attempt() -> bool:
            """One offer; True when it is over (taken, answered, or the tree closed)."""
            with gate:
                if stop.is_set():
                    return True
                try:
                    if claim:
                        link.claim_now()
                    elif spec is not None:
                        link.run_sync(lambda c: c.put_spec(spec), timeout=30)
                except (RuntimeUnavailableError, TimeoutError):
                    return False  # not serving yet, or busy past the bound (a recycle, a capture)
                except Exception as e:  # an answer: the first use reports it to the user
                    log.warning("the runtime did not take the %s (%s)", "claim" if claim else "spec", e)
                    return True
            log.info("%s the runtime at %s", "claimed" if claim else "spec handed to", link.socket)
            return True

        def retry() -> None:
            # a spec's offers end after a while; a claim's with this tree's lease (``stop``), however
            # long that is: a tree that never claimed is never recycled
            deadline = float("inf") if claim else time.monotonic() + SPEC_RETRY_S
            while time.monotonic() < deadline and link.claimed_generation is None:
                if stop.wait(SPEC_RETRY_EVERY_S) or attempt():
                    return

        threading.Thread(target=retry, name="vmsidecar-spec", daemon=True).start()

    def _on_claim(self) -> None:
        # the claim may have recycled the guest behind the CAN sockets: nothing a bus received
        # before it is this lease's, and from now on the guest there is
        for child in self._can_children:
            child.forget_before_claim()
        if self.recycle == "ExitAndReplace":
            request_exit_after_lease(log)

    def _shut_can_down(self) -> None:
        """End everything of this tree on its CAN buses: periodic sends, ``recv``, ``send``, and
        any reconnection (a shut-down bus refuses it)."""
        for child in self._can_children:  # upstream's Can never shuts its python-can bus down
            with contextlib.suppress(Exception):
                child.shut_bus_down()

    def _stop_retry(self) -> None:
        """Stop the background claim retry; wait for an attempt under way, so that a claim it
        made is seen (and recycled) by ``close``."""
        self._retry_stop.set()
        with self._retry_gate:
            pass

    def close(self) -> None:
        """Session end: for a tree that served a lease, recycle (InPlaceReuse) or stop the runtime (ExitAndReplace)."""
        if self._lease_began is not None:  # the lease ends with its session, before the recycle
            lease_ended(self._lease_began)
            self._lease_began = None
        self.link.ended = True  # a call of this tree still under way claims nothing from now on
        self._stop_retry()
        # before the recycle: once it has restored the next guest, a bus of this tree that
        # reconnected (a periodic send, a recv under way) would reach that guest
        self._shut_can_down()
        try:
            generation = self.link.claimed_generation
            if generation is None:
                return  # the start-up tree (or a lease whose runtime never answered)
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
        return (await self.link.call(lambda c: c.state())).model_dump(mode="json")

    @export
    async def wait_ready(self, timeout: float = 600.0) -> dict[str, Any]:
        """Wait until the guest is Ready (the readiness regex was seen)."""
        wait = seconds(timeout)
        return (await self.link.call(lambda c: c.wait_ready(wait))).model_dump(mode="json")
