"""A boot plan: the validated spec plus everything resolved on the host for one boot.

Backends (direct QEMU, libvirt) render the same plan; nothing host-specific lives in the spec.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from vmsidecar_contract.spec import VmSpec

#: the guest's serial console and its virtio console, as stream (and private socket) names
SERIAL = "ttyS0"
VIRTIO_CONSOLE = "hvc0"
#: the virtio-serial port name qemu-guest-agent looks for in the guest
GUEST_AGENT_PORT = "org.qemu.guest_agent.0"


def channel_stream(name: str) -> str:
    """The stream name of the virtio-serial channel ``name``."""
    return f"channel-{name}"


def can_stream(bus: str) -> str:
    """The stream name of the SLCAN bus ``bus``."""
    return f"can-{bus}"


@dataclass(frozen=True)
class Firmware:
    """UEFI firmware files for one boot: read-only code and a per-boot copy of the vars."""

    code: Path
    vars: Path


@dataclass(frozen=True)
class RamFile:
    """Guest RAM in a file: a templated snapshot's RAM (``snapshots.py``).

    The boot that captures maps it shared (``share``; a memfd, ``capture_ram.py``), so the capture
    writes only device state and copies the RAM into the snapshot. A restore maps the snapshot's
    file privately (copy-on-write): the guest's writes stay in its own pages and never reach the
    file, which every restore of the snapshot maps.
    """

    path: Path
    share: bool
    #: a descriptor QEMU inherits and ``path`` names (``/proc/self/fd/N``: a capture's memfd)
    fd: int | None = None


@dataclass(frozen=True)
class BootPlan:
    """What one boot needs; built by the runtime, consumed by a backend."""

    spec: VmSpec
    accel: str
    disk: Path
    disk_format: str
    run_dir: Path
    #: forward name -> host port actually bound
    ports: dict[str, int] = field(default_factory=dict)
    firmware: Firmware | None = None
    #: a memory snapshot to restore instead of booting (QEMU waits for it: ``-incoming defer``)
    incoming: Path | None = None
    #: guest RAM in a file (a templated snapshot's capture or restore); None: anonymous memory
    ram: RamFile | None = None
    #: the seal check of ``incoming`` and ``ram`` still under way while QEMU starts: None when it
    #: passed, else why not; the backend hands QEMU the stream only after None (``snapshots.py``,
    #: ``SnapshotStore.verify_deferred``)
    incoming_check: asyncio.Future[str | None] | None = None
    #: the files under ``disk`` (its backing chain) as the runtime made them, never read from
    #: ``disk``'s header, which its QEMU writes: the only ones QEMU may open under it (``confinement``)
    disk_chain: tuple[Path, ...] = ()

    @property
    def qmp_socket(self) -> Path:
        """QMP socket QEMU listens on (private to the runtime)."""
        return self.run_dir / "qmp.sock"

    def console_socket(self, name: str) -> Path:
        """Socket QEMU serves a console or channel on; the runtime re-serves it on the shared dir."""
        return self.run_dir / f"{name}.sock"

    def stream_pipe(self, name: str) -> Path:
        """``path=`` of the pipe chardev QEMU serves a virtio console port on (it opens ``.in`` and
        ``.out``; ``stream_pipes.py``)."""
        return self.run_dir / name

    @property
    def guest_agent_socket(self) -> Path:
        """Socket of the guest agent's port: private to the runtime (never in the shared dir, so a
        lease holder cannot reach the agent, which can set the clock, read files or run commands)."""
        return self.run_dir / "qga.sock"

    @property
    def gpio_socket(self) -> Path:
        """vhost-user socket the runtime's virtio-gpio device serves and QEMU connects to."""
        return self.run_dir / "gpio-vhost.sock"

    @property
    def stream_names(self) -> list[str]:
        """Every byte stream the guest has: consoles, virtio-serial channels and CAN buses."""
        return stream_names(self.spec)


def shared_with_another_qemu(spec: VmSpec) -> str | None:
    """What a second QEMU of this runtime would share with the guest's (a spare restore, or the next
    boot's QEMU while the last one exits), or None: the one vhost-user GPIO device, a native CAN bus."""
    if spec.gpio:
        return "GPIO lines: the runtime's one vhost-user GPIO device serves one QEMU"
    if any(bus.mode == "native" for bus in spec.can):
        return "a native CAN bus: both QEMUs would join the host's interface"
    return None


def stream_names(spec: VmSpec) -> list[str]:
    """Every byte stream a spec gives the guest, by name: ttyS0, hvc0, ``channel-*``, ``can-*``."""
    names = [SERIAL, *([VIRTIO_CONSOLE] if spec.virtio_console else [])]
    names += [channel_stream(c.name) for c in spec.channels]
    names += [can_stream(c.name) for c in spec.can if c.mode == "slcan"]
    return names
