"""What both backends render the same way, written once: machine and CPU per architecture, the
emulator binary (and the message when it is missing), the user-mode network with its host port
forwards. Pure, apart from looking the emulator up on ``PATH`` and the TCG cache size override.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import PortForward, VmSpec

from ..plan import BootPlan

#: the machine type when the spec names none
MACHINE = {"x86_64": "q35", "aarch64": "virt"}
#: the CPU model under TCG (KVM passes the host CPU through); "max" enables everything TCG can emulate
TCG_CPU = {"x86_64": "max", "aarch64": "cortex-a57"}
#: TCG's translation-block cache (MiB). QEMU 7.2 reserves 1 GiB for system emulation and pages
#: it in as the guest's code fills it: the bound caps what a busy, long-running guest can add to
#: QEMU's RSS. The tiny guest fills far less (bench/footprint.py: same RSS and boot time with 64
#: and with QEMU's default). VMSIDECAR_TCG_TB_SIZE overrides it (0: QEMU's default).
TCG_TB_SIZE_MIB = 64
#: the Debian package that ships each architecture's emulator
EMULATOR_PACKAGE = {"x86_64": "qemu-system-x86", "aarch64": "qemu-system-arm"}


def effective_cpu(spec: VmSpec, accel: str) -> str:
    """The QEMU CPU model of a boot: the spec's ``cpu``, else ``host`` under KVM and
    :data:`TCG_CPU` under TCG (snapshots carry it in their key: ``-cpu host`` state does not move
    between different host CPUs, a named model does).

    :raise HostError: ``cpu: host`` under TCG (QEMU has no host CPU to pass through without KVM).
    """
    if spec.cpu is None:
        return "host" if accel == "kvm" else TCG_CPU[spec.arch]
    if spec.cpu == "host" and accel != "kvm":
        raise HostError(
            "cpu: host passes the host's CPU through, which needs KVM, and this boot runs under TCG; set cpu "
            f"to a named model (e.g. {TCG_CPU[spec.arch]}), or give the runtime a usable /dev/kvm"
        )
    return spec.cpu


def accel_option(accel: str) -> str:
    """The ``-accel`` value: KVM as is; TCG with its translation cache bounded."""
    if accel != "tcg":
        return accel
    size = int(os.environ.get("VMSIDECAR_TCG_TB_SIZE", TCG_TB_SIZE_MIB))
    return f"tcg,tb-size={size}" if size > 0 else "tcg"


def qemu_binary(arch: str) -> str:
    """The QEMU system emulator name for a guest architecture."""
    return f"qemu-system-{arch}"


def emulator_path(arch: str) -> str:
    """The absolute path of the emulator for ``arch``.

    :raise HostError: naming the package to install when it is not on ``PATH``.
    """
    binary = qemu_binary(arch)
    path = shutil.which(binary)
    if path is None:
        raise HostError(
            f"{binary} is not installed, so {arch} guests cannot run; install it "
            f"(apt-get install {EMULATOR_PACKAGE[arch]}) or use the vmsidecar runtime image"
        )
    return path


def user_netdev(plan: BootPlan, ident: str) -> str:
    """The ``-netdev`` value of the guest's user-mode NIC ``ident``, with every port forward of
    the spec bound to the host port the runtime resolved for it (``plan.ports``; a spare restore's
    plan has none: they are added when a recycle adopts it). What the guest sends passes the
    runtime's guard first (``netguard.qemu_args``)."""
    netdev = f"user,id={ident}"
    for fwd in plan.spec.network.forwards:
        if fwd.name in plan.ports:
            netdev += f",hostfwd={hostfwd_rule(fwd, plan.ports[fwd.name])}"
    return netdev


def hostfwd_rule(forward: PortForward, port: int) -> str:
    """Slirp's rule for ``forward`` on host port ``port`` (``-netdev user,hostfwd=``, HMP ``hostfwd_add``)."""
    return f"tcp:{forward.host_address}:{port}-:{forward.guest_port}"


def listening_sockets(argv: list[str]) -> list[Path]:
    """The paths of the Unix sockets QEMU listens on (``-chardev socket,...,path=P,server=on``)."""
    sockets = []
    for flag, value in itertools.pairwise(argv):
        options = dict(part.partition("=")[::2] for part in value.split(",")[1:])
        if flag == "-chardev" and value.startswith("socket,") and options.get("server") == "on" and "path" in options:
            sockets.append(Path(options["path"]))
    return sockets
