"""Spec -> QEMU argv (pure function)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmsidecar_contract.errors import HostError, SpecError
from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime.backend.qemu_argv import build_argv
from vmsidecar_runtime.plan import BootPlan, Firmware


def _plan(spec: dict, accel: str = "tcg", **kw: object) -> BootPlan:
    return BootPlan(load_spec(spec), accel, Path("/s/overlay.qcow2"), "qcow2", Path("/r"), **kw)  # type: ignore[arg-type]


def _opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_defaults_boot_paused_on_overlay_with_both_consoles() -> None:
    argv = build_argv(_plan({}))
    assert argv[0] == "qemu-system-x86_64"
    assert "-S" in argv and "-no-shutdown" in argv
    assert _opt(argv, "-accel") == ["tcg,tb-size=64"] and _opt(argv, "-cpu") == ["max"]
    assert "driver=file,filename=/s/overlay.qcow2,node-name=disk0-file" in _opt(argv, "-blockdev")
    chardevs = _opt(argv, "-chardev")
    assert any("path=/r/ttyS0.sock" in c for c in chardevs)
    # the virtio console on a pipe chardev (QEMU drops its output when a socket is full: stream_pipes.py)
    assert "pipe,id=hvc0,path=/r/hvc0" in chardevs
    assert "virtconsole,chardev=hvc0,name=console.0" in _opt(argv, "-device")
    # seccomp with every optional deny: no exec, fork, setuid or scheduling changes from QEMU
    assert _opt(argv, "-sandbox") == ["on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]


def test_kvm_uses_host_cpu() -> None:
    argv = build_argv(_plan({"cpus": 4, "memory": "2G"}, accel="kvm"))
    assert _opt(argv, "-cpu") == ["host"] and _opt(argv, "-smp") == ["4"] and _opt(argv, "-m") == ["2048M"]


def test_a_named_cpu_model_is_one_argv_item_and_host_needs_kvm() -> None:
    assert _opt(build_argv(_plan({"cpu": "Skylake-Client-v4"})), "-cpu") == ["Skylake-Client-v4"]
    assert _opt(build_argv(_plan({"cpu": "qemu64"}, accel="kvm")), "-cpu") == ["qemu64"]  # portable under KVM
    assert _opt(build_argv(_plan({"cpu": "host"}, accel="kvm")), "-cpu") == ["host"]
    with pytest.raises(HostError, match="cpu: host passes the host's CPU through, which needs KVM"):
        build_argv(_plan({"cpu": "host"}))
    for bad in ("max,+vmx", "max -device foo", "-cpu", "", "a" * 65, "max\n"):
        with pytest.raises(SpecError, match="cpu"):
            load_spec({"cpu": bad})


def test_forwards_use_the_resolved_ports() -> None:
    spec = {"network": {"forwards": [{"name": "ssh", "guest_port": 22}, {"name": "web", "guest_port": 80}]}}
    argv = build_argv(_plan(spec, ports={"ssh": 40001, "web": 40002}))
    assert _opt(argv, "-netdev") == ["user,id=net0,hostfwd=tcp:127.0.0.1:40001-:22,hostfwd=tcp:127.0.0.1:40002-:80"]


def test_no_network_and_no_virtio_console() -> None:
    argv = build_argv(_plan({"network": {"enabled": False}, "virtio_console": False}))
    assert _opt(argv, "-nic") == ["none"]
    assert not [d for d in _opt(argv, "-device") if d.startswith("virtconsole")]


def test_every_boot_has_the_guest_agent_port_on_a_private_socket() -> None:
    for spec in ({}, {"virtio_console": False, "network": {"enabled": False}}, {"channels": [{"name": "a"}]}):
        argv = build_argv(_plan(spec))
        devices = _opt(argv, "-device")
        assert devices.count("virtio-serial-pci,id=vser0,max_ports=48") == 1, spec
        assert "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0,id=qga0-port" in devices, spec
        # in the runtime's private run dir (/r), never the shared dir the lease holder reaches
        assert "socket,id=qga0,path=/r/qga.sock,server=on,wait=off" in _opt(argv, "-chardev"), spec


def test_a_restore_runs_the_argv_of_the_capture_plus_incoming() -> None:
    spec = {"channels": [{"name": "a"}], "can": [{"name": "can0"}]}
    booted = build_argv(_plan(spec))
    restored = build_argv(_plan(spec, incoming=Path("/c/memory")))
    i = restored.index("-incoming")
    assert restored[i: i + 2] == ["-incoming", "defer"] and restored[:i] + restored[i + 2:] == booted


def test_the_most_ports_a_spec_may_ask_for_fit_next_to_the_agent() -> None:
    spec = {"channels": [{"name": f"c{i}"} for i in range(30)], "can": [{"name": f"can{i}"} for i in range(16)]}
    devices = _opt(build_argv(_plan(spec)), "-device")
    ports = [d for d in devices if d.startswith(("virtconsole", "virtserialport"))]
    assert len(ports) == 48 and "virtio-serial-pci,id=vser0,max_ports=48" in devices


def test_uefi_direct_kernel_channels_and_can() -> None:
    spec = {"firmware": "uefi", "kernel": "/k", "initrd": "/i", "cmdline": "console=ttyS0",
            "channels": [{"name": "agent"}], "can": [{"name": "can0"}]}
    argv = build_argv(_plan(spec, firmware=Firmware(Path("/fw/code"), Path("/s/vars"))))
    assert "if=pflash,format=raw,unit=0,readonly=on,file=/fw/code" in _opt(argv, "-drive")
    assert _opt(argv, "-kernel") == ["/k"] and _opt(argv, "-append") == ["console=ttyS0"]
    devices = _opt(argv, "-device")
    assert "virtserialport,chardev=channel_agent,name=agent" in devices
    assert "virtconsole,chardev=can_can0,name=can.can0.500000" in devices
    chardevs = _opt(argv, "-chardev")  # a bus on a pipe (never dropped while the runtime lags), a channel on a socket
    assert "pipe,id=can_can0,path=/r/can-can0" in chardevs
    assert "socket,id=channel_agent,path=/r/channel-agent.sock,server=on,wait=off" in chardevs


def test_extra_args_are_separate_items_never_a_shell_string() -> None:
    argv = build_argv(_plan({"extra_args": ["-device", "virtio-balloon-pci"]}))
    assert argv[-2:] == ["-device", "virtio-balloon-pci"]
