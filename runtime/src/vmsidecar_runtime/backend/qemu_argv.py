"""Spec -> QEMU argv. A pure function: no I/O, testable without QEMU.

The argv is a list handed to exec, never a shell string; every value in it comes from the
validated spec or from paths and ports the runtime resolved itself.
"""

from __future__ import annotations

from pathlib import Path

from vmsidecar_contract.spec import VmSpec

from ..plan import GUEST_AGENT_PORT, SERIAL, VIRTIO_CONSOLE, BootPlan, can_stream, channel_stream
from ..stream_pipes import BUS_PIPE_BYTES
from . import netguard
from .common import MACHINE, accel_option, effective_cpu, qemu_binary, user_netdev

#: id of the user-mode NIC's netdev
NETDEV_ID = "net0"

#: chardev id of the guest agent's port
GUEST_AGENT_CHARDEV = "qga0"
#: device id of the guest agent's port (QMP's VSERPORT_CHANGE names it when the guest opens it)
GUEST_AGENT_PORT_ID = "qga0-port"
#: memory-backend id of guest RAM in a file (a templated snapshot)
RAM_ID = "ram0"
#: the guest disk's qcow2 node (a capture that goes on in place puts a new overlay on top of it)
DISK_NODE = "disk0"
#: virtio-serial ports: hvc0, up to 30 channels, up to 16 SLCAN buses, the guest agent
VIRTIO_SERIAL_PORTS = 48

#: where guest RAM in a file is mapped: a shmem (memfd) page can be a transparent huge page only in a
#: mapping aligned to the PMD size (2 MiB on x86_64, and on aarch64 with 4 KiB pages), which QEMU
#: does not give a file otherwise. On a node whose ``transparent_hugepage/shmem_enabled`` is
#: ``advise`` the capturing boot then runs on huge pages, as anonymous RAM does (Debian's TCG boot
#: 30.3 s on 4 KiB pages, 28.4 s on huge pages, 28.1 s anonymous: docs/performance.md); ``never``
#: (Debian's default) leaves it as it was.
RAM_ALIGN = "2M"

#: QEMU's seccomp filter with every optional deny set (libvirt's own default is the same)
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


def _chardev(plan: BootPlan, ident: str, stream: str) -> list[str]:
    return ["-chardev", f"socket,id={ident},path={plan.console_socket(stream)},server=on,wait=off"]


def _base(plan: BootPlan) -> list[str]:
    spec = plan.spec
    machine = spec.machine or MACHINE[spec.arch]
    argv = [
        qemu_binary(spec.arch),
        "-name", "vmsidecar,debug-threads=on",
        "-nodefaults", "-no-user-config", "-display", "none",
        "-machine", machine,
        "-accel", accel_option(plan.accel),
        "-cpu", effective_cpu(spec, plan.accel),
        "-smp", str(spec.cpus),
        "-m", f"{spec.memory}M",
        # Paused until the runtime has attached to every console: no boot byte is lost.
        "-S",
        # A guest power-off leaves QEMU up in state "shutdown" so the runtime sees SHUTDOWN and quits it.
        "-no-shutdown",
        # seccomp: a guest that escapes into QEMU still cannot exec, fork, setuid or change
        # scheduling/affinity; the snapshot path needs none of these (migration goes over an fd).
        "-sandbox", SANDBOX,
        *(["-incoming", "defer"] if plan.incoming else []),
        "-chardev", f"socket,id=qmp,path={plan.qmp_socket},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
    ]
    return [*argv, *_memory(plan)]


def _memory(plan: BootPlan) -> list[str]:
    spec = plan.spec
    if plan.ram is not None:
        # a templated snapshot (snapshots.py): the capturing boot's RAM is the file (share=on), a
        # restore maps it copy-on-write (share=off) and loads only the device state (x-ignore-shared)
        assert not spec.gpio, "vhost-user GPIO needs RAM shared with its backend: never templated"
        return ram_file_argv(plan.ram.path, spec.memory, share=plan.ram.share)
    if spec.gpio:
        # vhost-user devices need guest RAM the backend process can map.
        return ["-object", f"memory-backend-memfd,id=mem0,size={spec.memory}M,share=on",
                "-machine", "memory-backend=mem0"]
    return []


def ram_file_argv(path: Path | str, memory_mib: int, *, share: bool) -> list[str]:
    """Guest RAM in the file ``path``: shared (a capturing boot's) or mapped copy-on-write (a restore's)."""
    return ["-object", f"memory-backend-file,id={RAM_ID},mem-path={path},share={'on' if share else 'off'},"
            f"size={memory_mib}M,align={RAM_ALIGN}", "-machine", f"memory-backend={RAM_ID}"]


def _boot(plan: BootPlan) -> list[str]:
    spec = plan.spec
    argv: list[str] = []
    if plan.firmware is not None:
        argv += [
            "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={plan.firmware.code}",
            "-drive", f"if=pflash,format=raw,unit=1,file={plan.firmware.vars}",
        ]
    if spec.kernel:
        argv += ["-kernel", str(spec.kernel)]
        if spec.initrd:
            argv += ["-initrd", str(spec.initrd)]
        if spec.cmdline:
            argv += ["-append", spec.cmdline]
    argv += [
        "-blockdev", f"driver=file,filename={plan.disk},node-name={DISK_NODE}-file",
        "-blockdev", f"driver={plan.disk_format},file={DISK_NODE}-file,node-name={DISK_NODE}",
        # A write the state volume has no room for pauses the guest (BLOCK_IO_ERROR, nospace: the
        # runtime says "the state volume is full") instead of failing it inside the guest; other
        # host I/O errors reach the guest as disk errors, as on real hardware.
        "-device", f"virtio-blk-pci,drive={DISK_NODE},id={DISK_NODE}-dev,bootindex=1,werror=enospc,rerror=report",
    ]
    return argv


def _console_ports(spec: VmSpec) -> list[tuple[str, str]]:
    """(stream, port name) of every virtio *console* port: ttys in the guest."""
    ports = [(VIRTIO_CONSOLE, "console.0")] if spec.virtio_console else []
    # CAN buses ride on virtio consoles, so slcand can attach a line discipline. The port name
    # tells the guest the bus (= interface name) and bitrate: can.<bus>.<bitrate>.
    return ports + [(can_stream(c.name), f"can.{c.name}.{c.bitrate}") for c in spec.can if c.mode == "slcan"]


def piped_streams(spec: VmSpec) -> dict[str, int | None]:
    """The streams QEMU serves through pipes, not sockets: its virtio consoles, whose output QEMU
    drops when the chardev is full (``stream_pipes.py``); each with the size of its output pipe
    (a CAN bus's holds ~40,000 frames, the console's the kernel's default 64 KiB of text)."""
    return {stream: BUS_PIPE_BYTES if stream != VIRTIO_CONSOLE else None for stream, _ in _console_ports(spec)}


def _streams(plan: BootPlan) -> list[str]:
    spec = plan.spec
    argv = [*_chardev(plan, "ser0", SERIAL), "-serial", "chardev:ser0"]
    # Always present, whatever the spec: the guest agent's port needs it, and a snapshot restores
    # only into the argv it was captured with.
    argv += ["-device", f"virtio-serial-pci,id=vser0,max_ports={VIRTIO_SERIAL_PORTS}"]
    for stream, port_name in _console_ports(spec):
        ident = stream.replace("-", "_")
        argv += ["-chardev", f"pipe,id={ident},path={plan.stream_pipe(stream)}",
                 "-device", f"virtconsole,chardev={ident},name={port_name}"]
    for c in spec.channels:  # QEMU holds a virtserialport's guest while its socket is full: no loss
        stream = channel_stream(c.name)
        ident = stream.replace("-", "_")
        argv += [*_chardev(plan, ident, stream), "-device", f"virtserialport,chardev={ident},name={c.name}"]
    return argv


def _guest_agent(plan: BootPlan) -> list[str]:
    # The runtime talks to qemu-guest-agent (if the guest runs one) to set the clock after a
    # restore. Its socket is in the private run dir, never the shared one: the lease holder must
    # not reach an agent that can set the clock, read files or run commands as root.
    return ["-chardev", f"socket,id={GUEST_AGENT_CHARDEV},path={plan.guest_agent_socket},server=on,wait=off",
            "-device", f"virtserialport,chardev={GUEST_AGENT_CHARDEV},name={GUEST_AGENT_PORT},id={GUEST_AGENT_PORT_ID}"]


def _network(plan: BootPlan) -> list[str]:
    if not plan.spec.network.enabled:
        return ["-nic", "none"]
    return ["-netdev", user_netdev(plan, NETDEV_ID), "-device", f"virtio-net-pci,netdev={NETDEV_ID},id={NETDEV_ID}-dev",
            *(netguard.qemu_args(plan, NETDEV_ID) if netguard.guarded(plan) else [])]


def _can_native(plan: BootPlan) -> list[str]:
    argv: list[str] = []
    for i, bus in enumerate(c for c in plan.spec.can if c.mode == "native"):
        # Never name a can-bus "canbus0": QEMU then misparses "canbus0=" device properties.
        bus_id = f"vcb-{bus.name}"
        argv += [
            "-object", f"can-bus,id={bus_id}",
            "-object", f"can-host-socketcan,id=vch{i},if={bus.host_interface},canbus={bus_id}",
            "-device", f"kvaser_pci,canbus={bus_id}",
        ]
    return argv


def _gpio(plan: BootPlan) -> list[str]:
    if not plan.spec.gpio:
        return []
    return ["-chardev", f"socket,id=vgpio,path={plan.gpio_socket}",
            "-device", "vhost-user-gpio-pci,chardev=vgpio,id=gpio0"]


def _generation_id(plan: BootPlan) -> list[str]:
    # A new random VM generation ID at every QEMU start: a guest restored from a memory snapshot
    # sees it change and Linux reseeds its RNG, so two restores never share randomness.
    return ["-device", "vmgenid"] if plan.spec.arch == "x86_64" else []


def build_argv(plan: BootPlan) -> list[str]:
    """The full QEMU argv for a boot plan."""
    return [
        *_base(plan),
        *_boot(plan),
        *_streams(plan),
        *_guest_agent(plan),
        *_network(plan),
        *_can_native(plan),
        *_gpio(plan),
        "-device", "virtio-rng-pci",
        *_generation_id(plan),
        *plan.spec.extra_args,
    ]
