"""Bare QEMU boot → marker with the guest's RAM anonymous (as a bare boot) or in a memfd (as the
runtime's capturing boot): what the templated snapshot's RAM file costs a cold boot.

    uv run python bench/ram_backing.py [--runs 7] [--guest tiny|debian]

Each run boots the guest once per backing, in turn first (``bench/cold_timeline.py``'s bare boot:
a fresh overlay, serial on stdout, until ``VMSIDECAR-READY``), and prints per boot the wall time,
the guest's own uptime in its marker, QEMU's CPU time and minor page faults (``/proc``, at the
marker); then the medians. The memfd boot gets the runtime's own options (``memory-backend-file``
on the memfd, ``share=on,align=2M``): its pages are huge only where the host's
``transparent_hugepage/shmem_enabled`` allows (printed), where anonymous RAM gets them through
``madvise``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

from cold_timeline import BareBoot, bare
from snapshot import Guest, resolve_guest  # bench/ is no package

from vmsidecar_contract.arch import host_arch
from vmsidecar_contract.spec import parse_size_mib
from vmsidecar_runtime.accel import AccelChoice, choose_accel
from vmsidecar_runtime.backend.qemu_argv import ram_file_argv
from vmsidecar_runtime.procs import inherited_path

THP = Path("/sys/kernel/mm/transparent_hugepage")


async def boot(guest: Guest, accel: AccelChoice, work: Path, memfd: bool) -> BareBoot:
    """One bare boot to the marker, its RAM in a new memfd (``memfd``) or anonymous."""
    if not memfd:
        return await bare(guest, accel, work)
    fd = os.memfd_create("bench-ram", os.MFD_CLOEXEC)
    try:
        ram = ram_file_argv(inherited_path(fd), parse_size_mib(guest.memory), share=True)
        return await bare(guest, accel, work, ram, pass_fds=(fd,))
    finally:
        os.close(fd)


async def main(runs: int, name: str) -> None:
    guest = resolve_guest(name)
    assert guest is not None
    accel = choose_accel("auto", host_arch())
    print(f"{guest.name} ({guest.memory}), accel {accel.accel}; shmem_enabled: "
          f"{(THP / 'shmem_enabled').read_text().strip()}; enabled: {(THP / 'enabled').read_text().strip()}")
    forms = {"anonymous": False, "memfd": True}
    samples: dict[str, list[BareBoot]] = {form: [] for form in forms}
    with tempfile.TemporaryDirectory(prefix="bench-ram-backing-") as tmp:
        for i in range(runs):
            order = list(forms) if i % 2 == 0 else list(reversed(forms))
            for form in order:
                os.sync()  # no earlier boot's files being written back
                got = await boot(guest, accel, Path(tmp) / f"{i}-{form}", forms[form])
                samples[form].append(got)
                print(f"run {i + 1}: {form:<9} wall {got.seconds:.2f} s, uptime {got.uptime:.2f} s, "
                      f"CPU {got.cpu:.2f} s, minor faults {got.minor_faults}", flush=True)
    print(f"\nmedians of {runs}:")
    for form, rows in samples.items():
        med = [statistics.median(column) for column in zip(*rows, strict=True)]
        print(f"  {form:<9} wall {med[0]:.2f} s, uptime {med[1]:.2f} s, CPU {med[2]:.2f} s, minor faults {med[3]:.0f}")
    pairs = [m.uptime / a.uptime for a, m in zip(samples["anonymous"], samples["memfd"], strict=True)]
    print(f"  memfd ÷ anonymous, the guest's uptime, median of the runs' own ratios: {statistics.median(pairs):.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--guest", choices=["tiny", "debian"], default="tiny")
    args = p.parse_args()
    asyncio.run(main(args.runs, args.guest))
