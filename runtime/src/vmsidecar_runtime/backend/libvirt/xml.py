"""Boot plan -> libvirt domain XML. A pure function: no I/O besides finding the emulator path.

Built with ElementTree, never by string concatenation: every value from the spec is an
attribute or text node, escaped by the serializer.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path

from vmsidecar_contract.errors import HostError

from ...plan import SERIAL, VIRTIO_CONSOLE, BootPlan, channel_stream
from .. import netguard
from ..common import MACHINE, effective_cpu, emulator_path, listening_sockets, user_netdev

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
ET.register_namespace("qemu", QEMU_NS)

#: PCI slot of the user-mode NIC added through <qemu:commandline>: libvirt fills slots from the
#: bottom, so a high fixed address never clashes with the devices it places itself.
NIC_PCI_ADDR = "0x10"
NETDEV_ID = "vsnet0"


def unsupported(plan: BootPlan) -> str | None:
    """What in the spec the libvirt backend cannot render, or None."""
    spec = plan.spec
    if spec.can:
        return "CAN buses"
    if spec.gpio:
        return "GPIO lines"
    if spec.extra_args:
        return "extra_args"
    return None


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    el = ET.SubElement(parent, tag, attrs)
    if text is not None:
        el.text = text
    return el


def _unix_chardev(devices: ET.Element, tag: str, path: str) -> ET.Element:
    dev = _sub(devices, tag, type="unix")
    _sub(dev, "source", mode="bind", path=path)
    return dev


def _qemu_args(plan: BootPlan) -> list[str]:
    """Arguments libvirt 9.0 has no XML for: user networking with host port forwards, and the
    filter that sends the guest's frames through the runtime (``netguard``)."""
    if not plan.spec.network.enabled:
        return []
    return ["-netdev", user_netdev(plan, NETDEV_ID),
            "-device", f"virtio-net-pci,netdev={NETDEV_ID},id={NETDEV_ID}-dev,addr={NIC_PCI_ADDR}",
            *(netguard.qemu_args(plan, NETDEV_ID) if netguard.guarded(plan) else [])]


def render_domain(plan: BootPlan, name: str, *, emulator: str | None = None, piped_console: bool = False,
                  qemu_env: Mapping[str, str] | None = None) -> str:
    """The domain XML for one boot of ``plan``, named ``name``. ``piped_console``: the virtio
    console on the named pipes at ``plan.stream_pipe`` (``ConsoleFifos``), else on a socket.
    ``qemu_env``: variables for the emulator's environment (libvirt gives it none of the runtime's).

    :raise HostError: when the spec asks for something the libvirt backend cannot do.
    """
    spec = plan.spec
    missing = unsupported(plan)
    if missing:
        raise HostError(f"the libvirt backend does not support {missing} yet; use backend: qemu for this spec")
    root = ET.Element("domain", type="kvm" if plan.accel == "kvm" else "qemu")
    _sub(root, "name", name)
    _sub(root, "memory", str(spec.memory), unit="MiB")
    _sub(root, "vcpu", str(spec.cpus))

    os_el = _sub(root, "os")
    _sub(os_el, "type", "hvm", arch=spec.arch, machine=spec.machine or MACHINE[spec.arch])
    if plan.firmware is not None:
        _sub(os_el, "loader", str(plan.firmware.code), readonly="yes", type="pflash")
        _sub(os_el, "nvram", str(plan.firmware.vars))
    if spec.kernel:
        _sub(os_el, "kernel", str(spec.kernel))
        if spec.initrd:
            _sub(os_el, "initrd", str(spec.initrd))
        if spec.cmdline:
            _sub(os_el, "cmdline", spec.cmdline)

    features = _sub(root, "features")
    _sub(features, "acpi")  # the ACPI power button is how a graceful power-off reaches the guest
    model = effective_cpu(spec, plan.accel)
    if model == "host":
        _sub(root, "cpu", mode="host-passthrough")
    elif model == "max":
        _sub(root, "cpu", mode="maximum", check="none")  # libvirt's name for QEMU's -cpu max
    else:
        cpu = _sub(root, "cpu", mode="custom", match="exact", check="none")
        _sub(cpu, "model", model, fallback="forbid")

    # the runtime's state machine decides what a power-off or a crash means
    _sub(root, "on_poweroff", "destroy")
    _sub(root, "on_reboot", "restart")
    _sub(root, "on_crash", "destroy")

    devices = _sub(root, "devices")
    _sub(devices, "emulator", emulator or emulator_path(spec.arch))
    disk = _sub(devices, "disk", type="file", device="disk")
    _sub(disk, "driver", name="qemu", type=plan.disk_format)
    _sub(disk, "source", file=str(plan.disk))
    _sub(disk, "target", dev="vda", bus="virtio")
    _sub(disk, "boot", order="1")

    serial = _unix_chardev(devices, "serial", str(plan.console_socket(SERIAL)))
    _sub(serial, "target", port="0")
    if spec.virtio_console:
        if piped_console:
            console = _sub(devices, "console", type="pipe")
            _sub(console, "source", path=str(plan.stream_pipe(VIRTIO_CONSOLE)))
        else:
            console = _unix_chardev(devices, "console", str(plan.console_socket(VIRTIO_CONSOLE)))
        _sub(console, "target", type="virtio", port="0")
    for ch in spec.channels:
        channel = _unix_chardev(devices, "channel", str(plan.console_socket(channel_stream(ch.name))))
        _sub(channel, "target", type="virtio", name=ch.name)

    if spec.arch == "x86_64":
        _sub(devices, "controller", type="usb", model="none")
    _sub(devices, "memballoon", model="none")
    rng = _sub(devices, "rng", model="virtio")
    _sub(rng, "backend", "/dev/urandom", model="random")

    args = _qemu_args(plan)
    if args or qemu_env:
        cmdline = ET.SubElement(root, f"{{{QEMU_NS}}}commandline")
        for arg in args:
            ET.SubElement(cmdline, f"{{{QEMU_NS}}}arg", value=arg)
        for key, value in (qemu_env or {}).items():
            ET.SubElement(cmdline, f"{{{QEMU_NS}}}env", name=key, value=value)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode")


def bound_sockets(xml: str) -> list[Path]:
    """The Unix sockets the QEMU of domain ``xml`` listens on (``<source mode='bind'>``, and the
    ``server=on`` chardevs of its extra arguments): a confined QEMU may not remove a predecessor's
    (``libvirt_emulator``), so the runtime does before the domain starts."""
    root = ET.fromstring(xml)
    paths = [Path(source.get("path", "")) for source in root.iter("source") if source.get("mode") == "bind"]
    args = [arg.get("value", "") for arg in root.iter(f"{{{QEMU_NS}}}arg")]
    return [*paths, *listening_sockets(args)]
