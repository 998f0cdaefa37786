"""UEFI firmware: find the distribution's code/vars files, give each boot its own vars copy."""

from __future__ import annotations

import shutil
from pathlib import Path

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import VmSpec

from .plan import Firmware

# (code, vars) pairs in order of preference; Debian names first, then Fedora/upstream ones.
CANDIDATES: dict[str, list[tuple[str, str]]] = {
    "x86_64": [
        ("/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"),
        ("/usr/share/OVMF/OVMF_CODE.fd", "/usr/share/OVMF/OVMF_VARS.fd"),
        ("/usr/share/edk2/ovmf/OVMF_CODE.fd", "/usr/share/edk2/ovmf/OVMF_VARS.fd"),
    ],
    "aarch64": [
        ("/usr/share/AAVMF/AAVMF_CODE.fd", "/usr/share/AAVMF/AAVMF_VARS.fd"),
        ("/usr/share/edk2/aarch64/QEMU_EFI-pflash.raw", "/usr/share/edk2/aarch64/vars-template-pflash.raw"),
    ],
}
PACKAGE = {"x86_64": "ovmf", "aarch64": "qemu-efi-aarch64"}


def prepare_firmware(spec: VmSpec, state_dir: Path, *, fresh: bool = True) -> Firmware | None:
    """Firmware for a UEFI boot (None for BIOS).

    ``fresh``: the vars are a new copy of the distribution's template (never written itself), so
    no variable of an earlier boot survives (a disk booting the removable-media path needs none). A
    launch that continues a running boot (a snapshot hand-over) wants ``fresh=False``: the copy the
    firmware in the guest's RAM has been writing to.

    :raise HostError: when no UEFI firmware is installed.
    """
    if spec.firmware != "uefi":
        return None
    for code, vars_template in CANDIDATES[spec.arch]:
        if Path(code).exists() and Path(vars_template).exists():
            vars_copy = state_dir / "firmware" / Path(vars_template).name
            if fresh or not vars_copy.exists():
                vars_copy.parent.mkdir(parents=True, exist_ok=True)
                vars_copy.unlink(missing_ok=True)  # a new file: a QEMU still exiting keeps the old one
                shutil.copyfile(vars_template, vars_copy)
                vars_copy.chmod(0o600)
            return Firmware(Path(code), vars_copy)
    raise HostError(
        f"no UEFI firmware for {spec.arch} is installed; install {PACKAGE[spec.arch]} or set firmware: bios"
    )
