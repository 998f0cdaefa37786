"""Choose the accelerator: KVM only where it really works, TCG otherwise, and say why."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vmsidecar_contract.arch import host_arch
from vmsidecar_contract.errors import HostError

KVM_DEVICE = Path("/dev/kvm")
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class AccelChoice:
    """The accelerator used for a boot and the reason it was chosen."""

    accel: str  # "kvm" | "tcg"
    reason: str


def _kvm_problem(arch: str, kvm: Path, cpuinfo: Path) -> str | None:
    """Why KVM cannot run this guest here, or None when it can."""
    if arch != host_arch():
        return f"guest arch {arch} differs from host arch {host_arch()}"
    if not kvm.exists():
        return f"{kvm} does not exist (no KVM on this host, or not passed into the container)"
    if not os.access(kvm, os.R_OK | os.W_OK):
        return f"{kvm} is not readable and writable by this user (add the user to group kvm)"
    if arch == "x86_64":
        try:
            flags = next(
                (line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("flags")),
                [],
            )
        except OSError:
            flags = []
        if "vmx" not in flags and "svm" not in flags:
            # PVM / paravirtual /dev/kvm (nested cloud VMs) exposes the device without VT-x or
            # AMD-V; ordinary guests hang under it, so it does not count as working KVM.
            return f"{kvm} exists but the CPU flags show neither vmx nor svm (paravirtual KVM cannot run ordinary guests)"
    return None


def choose_accel(requested: str, arch: str, *, kvm: Path = KVM_DEVICE, cpuinfo: Path = CPUINFO) -> AccelChoice:
    """Resolve ``auto|kvm|tcg`` for a guest architecture.

    :raise HostError: when ``kvm`` is requested but cannot work here.
    """
    if requested == "tcg":
        return AccelChoice("tcg", "tcg requested by the spec")
    problem = _kvm_problem(arch, kvm, cpuinfo)
    if requested == "kvm":
        if problem:
            raise HostError(
                f"accel kvm was requested but {problem}; pass /dev/kvm with a working hardware "
                "virtualization (e.g. --device /dev/kvm or the devices.kubevirt.io/kvm resource) or set accel: auto|tcg"
            )
        return AccelChoice("kvm", "kvm requested by the spec")
    if problem:
        return AccelChoice("tcg", f"auto: TCG because {problem}")
    return AccelChoice("kvm", f"auto: {kvm} is usable and the CPU supports hardware virtualization")
