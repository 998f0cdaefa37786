"""The libvirt domain XML renderer: pure, no daemon (libvirt-python not needed)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime.backend.libvirt.xml import NIC_PCI_ADDR, QEMU_NS, bound_sockets, render_domain
from vmsidecar_runtime.plan import BootPlan, Firmware

RUN = Path("/tmp/vmsidecar-test")


def _plan(accel: str = "tcg", ports: dict[str, int] | None = None, firmware: Firmware | None = None,
          **spec: Any) -> BootPlan:
    return BootPlan(load_spec({"image": "file:/x", **spec}), accel, Path("/state/overlay.qcow2"), "qcow2", RUN,
                    ports or {}, firmware)


def _render(plan: BootPlan) -> ET.Element:
    return ET.fromstring(render_domain(plan, "vmsidecar-t", emulator="/usr/bin/qemu-system-x86_64"))


def test_tcg_domain_basics() -> None:
    root = _render(_plan(cpus=2, memory="256M"))
    assert root.get("type") == "qemu"
    assert root.findtext("name") == "vmsidecar-t"
    assert (root.find("memory").get("unit"), root.findtext("memory")) == ("MiB", "256")  # type: ignore[union-attr]
    assert root.findtext("vcpu") == "2"
    os_type = root.find("os/type")
    assert os_type is not None and (os_type.get("arch"), os_type.get("machine"), os_type.text) == ("x86_64", "q35", "hvm")
    assert root.find("features/acpi") is not None  # the ACPI power button is the graceful off
    assert root.find("cpu").get("mode") == "maximum"  # type: ignore[union-attr]
    assert root.findtext("on_poweroff") == "destroy" and root.findtext("on_crash") == "destroy"
    assert root.findtext("devices/emulator") == "/usr/bin/qemu-system-x86_64"


def test_kvm_domain_uses_host_cpu() -> None:
    root = _render(_plan("kvm"))
    assert root.get("type") == "kvm"
    assert root.find("cpu").get("mode") == "host-passthrough"  # type: ignore[union-attr]


def test_a_named_cpu_model_is_a_custom_model_libvirt_may_not_replace() -> None:
    cpu = _render(_plan(cpu="Skylake-Client")).find("cpu")
    assert cpu is not None and cpu.get("mode") == "custom" and cpu.get("match") == "exact"
    model = cpu.find("model")
    assert model is not None and model.text == "Skylake-Client" and model.get("fallback") == "forbid"


def test_disk_is_the_plans_overlay() -> None:
    disks = _render(_plan()).findall("devices/disk")
    assert len(disks) == 1
    disk = disks[0]
    assert disk.find("source").get("file") == "/state/overlay.qcow2"  # type: ignore[union-attr]
    assert disk.find("driver").get("type") == "qcow2"  # type: ignore[union-attr]
    assert disk.find("target").get("bus") == "virtio"  # type: ignore[union-attr]
    assert disk.find("boot").get("order") == "1"  # type: ignore[union-attr]


def test_consoles_and_channels_are_unix_sockets_at_the_plans_paths() -> None:
    plan = _plan(channels=[{"name": "agent"}])
    root = _render(plan)
    serial = root.find("devices/serial")
    assert serial is not None and serial.get("type") == "unix"
    assert serial.find("source").attrib == {"mode": "bind", "path": str(plan.console_socket("ttyS0"))}  # type: ignore[union-attr]
    console = root.find("devices/console")
    assert console is not None and console.get("type") == "unix"
    assert console.find("source").get("path") == str(plan.console_socket("hvc0"))  # type: ignore[union-attr]
    assert console.find("target").get("type") == "virtio"  # type: ignore[union-attr]
    channel = root.find("devices/channel")
    assert channel is not None
    assert channel.find("source").get("path") == str(plan.console_socket("channel-agent"))  # type: ignore[union-attr]
    assert channel.find("target").attrib == {"type": "virtio", "name": "agent"}  # type: ignore[union-attr]


def test_under_the_private_daemon_the_virtio_console_is_on_named_pipes() -> None:
    # QEMU drops hvc0 output its chardev cannot take: pipes hold far more small writes than a socket
    plan = _plan()
    root = ET.fromstring(render_domain(plan, "t", emulator="/usr/bin/qemu-system-x86_64", piped_console=True))
    console = root.find("devices/console")
    assert console is not None and console.get("type") == "pipe"
    assert console.find("source").attrib == {"path": str(plan.stream_pipe("hvc0"))}  # type: ignore[union-attr]
    assert console.find("target").attrib == {"type": "virtio", "port": "0"}  # type: ignore[union-attr]
    assert root.find("devices/serial").get("type") == "unix"  # type: ignore[union-attr]  # QEMU holds the vCPU: no loss


def test_the_sockets_qemu_binds_are_every_bound_chardev_and_the_nic_guards() -> None:
    """What the runtime removes before a boot (a confined QEMU cannot remove an earlier boot's)."""
    plan = _plan(channels=[{"name": "agent"}])
    xml = render_domain(plan, "t", emulator="/usr/bin/qemu-system-x86_64", piped_console=True)
    assert set(bound_sockets(xml)) == {plan.console_socket("ttyS0"), plan.console_socket("channel-agent"),
                                       RUN / "net-out.sock", RUN / "net-in.sock", RUN / "net-back.sock"}


def test_the_emulators_environment_is_qemu_env() -> None:
    """libvirt gives its QEMU none of the runtime's variables: the confinement's rules ride here."""
    xml = render_domain(_plan(network={"enabled": False}), "t", emulator="/e", qemu_env={"A": "[1, \"x\"]"})
    [env] = ET.fromstring(xml).iter(f"{{{QEMU_NS}}}env")
    assert env.attrib == {"name": "A", "value": '[1, "x"]'}


def test_no_virtio_console_when_disabled() -> None:
    assert _render(_plan(virtio_console=False)).find("devices/console") is None


def test_port_forwards_ride_on_qemu_commandline_with_a_fixed_pci_slot() -> None:
    plan = _plan(ports={"ssh": 2222, "web": 8080},
                 network={"forwards": [{"name": "ssh", "guest_port": 22},
                                       {"name": "web", "guest_port": 80, "host_address": "0.0.0.0"}]})
    root = _render(plan)
    args = [a.get("value") for a in root.findall(f"{{{QEMU_NS}}}commandline/{{{QEMU_NS}}}arg")]
    assert args[0] == "-netdev"
    assert args[1] == "user,id=vsnet0,hostfwd=tcp:127.0.0.1:2222-:22,hostfwd=tcp:0.0.0.0:8080-:80"
    assert args[2] == "-device" and args[3].endswith(f"addr={NIC_PCI_ADDR}") and "netdev=vsnet0" in args[3]
    assert root.find("devices/interface") is None  # libvirt 9.0's user interface has no port forwards


def test_network_disabled_means_no_nic() -> None:
    root = _render(_plan(network={"enabled": False}))
    assert root.find(f"{{{QEMU_NS}}}commandline") is None and root.find("devices/interface") is None


def test_direct_kernel_boot_and_uefi() -> None:
    fw = Firmware(Path("/fw/CODE.fd"), Path("/state/VARS.fd"))
    root = _render(_plan(firmware=fw, kernel="/k/vmlinuz", initrd="/k/initrd", cmdline="console=ttyS0 x=<&>"))
    assert root.findtext("os/kernel") == "/k/vmlinuz" and root.findtext("os/initrd") == "/k/initrd"
    assert root.findtext("os/cmdline") == "console=ttyS0 x=<&>"  # escaped by the serializer, read back intact
    loader = root.find("os/loader")
    assert loader is not None and loader.text == "/fw/CODE.fd" and loader.get("type") == "pflash"
    assert root.findtext("os/nvram") == "/state/VARS.fd"


def test_hostile_values_stay_values() -> None:
    """A cmdline with quotes and markup cannot inject elements (ElementTree escapes it)."""
    root = _render(_plan(kernel="/k", cmdline="'/><devices><disk type='file'/></devices><x a='"))
    assert len(root.findall("devices/disk")) == 1 and root.find("x") is None


@pytest.mark.parametrize(("extra", "what"), [
    ({"can": [{"name": "can0"}]}, "CAN buses"),
    ({"gpio": [{"name": "button"}]}, "GPIO lines"),
])
def test_unsupported_features_are_refused_with_the_fix(extra: dict[str, Any], what: str) -> None:
    with pytest.raises(HostError, match=f"does not support {what}.*backend: qemu"):
        render_domain(_plan(**extra), "x", emulator="/bin/true")


def test_aarch64_defaults() -> None:
    root = ET.fromstring(render_domain(_plan(arch="aarch64", kernel="/k"), "a", emulator="/usr/bin/qemu-system-aarch64"))
    assert root.find("os/type").get("machine") == "virt"  # type: ignore[union-attr]
    assert root.findtext("cpu/model") == "cortex-a57"


def test_missing_libvirt_python_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from vmsidecar_runtime.backend import create_backend

    monkeypatch.setitem(sys.modules, "libvirt", None)  # import libvirt now raises ImportError
    with pytest.raises(HostError) as err:
        create_backend(_plan(backend="libvirt"), lambda event, data: None)
    msg = err.value.message
    assert "vmsidecar-runtime[libvirt]" in msg and "--all-extras" in msg and "libvirt-dev" in msg
