"""Accelerator choice: KVM only where it works, with the reason reported."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vmsidecar_contract.errors import HostError
from vmsidecar_runtime.accel import choose_accel


@pytest.fixture
def kvm_node(tmp_path: Path) -> Path:
    node = tmp_path / "kvm"
    node.write_bytes(b"")
    return node


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n")
    return f


def test_auto_uses_kvm_when_device_and_vmx(tmp_path: Path, kvm_node: Path) -> None:
    choice = choose_accel("auto", "x86_64", kvm=kvm_node, cpuinfo=_cpuinfo(tmp_path, "vmx"))
    assert choice.accel == "kvm"


def test_auto_refuses_paravirtual_kvm(tmp_path: Path, kvm_node: Path) -> None:
    choice = choose_accel("auto", "x86_64", kvm=kvm_node, cpuinfo=_cpuinfo(tmp_path, "hypervisor"))
    assert choice.accel == "tcg" and "neither vmx nor svm" in choice.reason


def test_auto_without_device(tmp_path: Path) -> None:
    choice = choose_accel("auto", "x86_64", kvm=tmp_path / "nope", cpuinfo=_cpuinfo(tmp_path, "svm"))
    assert choice.accel == "tcg" and "does not exist" in choice.reason


def test_foreign_arch_is_tcg(tmp_path: Path, kvm_node: Path) -> None:
    assert choose_accel("auto", "aarch64", kvm=kvm_node, cpuinfo=_cpuinfo(tmp_path, "vmx")).accel == "tcg"


def test_kvm_requested_but_missing_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(HostError, match=r"does not exist.*devices.kubevirt.io/kvm.*accel: auto\|tcg"):
        choose_accel("kvm", "x86_64", kvm=tmp_path / "nope", cpuinfo=_cpuinfo(tmp_path, "vmx"))


def test_this_host() -> None:
    """On this machine kind /dev/kvm is PVM: auto must say TCG and why (on a KVM host: kvm)."""
    choice = choose_accel("auto", "x86_64")
    flags = Path("/proc/cpuinfo").read_text()
    hardware = (" vmx" in flags or " svm" in flags) and os.access("/dev/kvm", os.R_OK | os.W_OK)
    assert choice.accel == ("kvm" if hardware else "tcg"), choice
