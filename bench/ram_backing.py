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
import subprocess
import tempfile
import time
from pathlib import Path

from cold_timeline import UPTIME
from snapshot import Guest, bare_argv, resolve_guest  # bench/ is no package

from vmsidecar_contract.arch import host_arch
from vmsidecar_runtime.accel import AccelChoice, choose_accel
from vmsidecar_runtime.backend.qemu_argv import RAM_ALIGN, RAM_ID

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
THP = Path("/sys/kernel/mm/transparent_hugepage")


def _faults_and_cpu(pid: int) -> tuple[int, float]:
    """A process's minor page faults and CPU seconds (user + system) so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[7]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


async def boot(guest: Guest, accel: AccelChoice, work: Path, memfd: bool) -> dict[str, float]:
    """One boot to the marker: wall seconds, the guest's uptime, QEMU's CPU seconds and minor faults."""
    work.mkdir(parents=True)
    overlay = work / "overlay.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(guest.disk), "-F", "qcow2",
                    str(overlay)], check=True)
    argv = bare_argv(guest, accel, overlay)
    fds: tuple[int, ...] = ()
    if memfd:
        fd = os.memfd_create("bench-ram", os.MFD_CLOEXEC)
        fds = (fd,)
        argv += ["-object", f"memory-backend-file,id={RAM_ID},mem-path=/proc/self/fd/{fd},share=on,"
                 f"size={guest.memory},align={RAM_ALIGN}", "-machine", f"memory-backend={RAM_ID}"]
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                stderr=subprocess.DEVNULL, pass_fds=fds)
    for fd in fds:
        os.close(fd)  # QEMU has its own
    assert proc.stdout is not None
    seen = b""
    try:
        async with asyncio.timeout(guest.timeout):
            while (found := UPTIME.search(seen)) is None:
                chunk = await proc.stdout.read(4096)
                if not chunk:
                    raise RuntimeError("QEMU ended before its marker")
                seen = seen[-4096:] + chunk
        wall = time.monotonic() - started
        faults, cpu = _faults_and_cpu(proc.pid)
        return {"wall": wall, "uptime": float(found.group(1)), "cpu": cpu, "faults": faults}
    finally:
        proc.kill()
        await proc.wait()


async def main(runs: int, name: str) -> None:
    guest = resolve_guest(name)
    assert guest is not None
    accel = choose_accel("auto", host_arch())
    print(f"{guest.name} ({guest.memory}), accel {accel.accel}; shmem_enabled: "
          f"{(THP / 'shmem_enabled').read_text().strip()}; enabled: {(THP / 'enabled').read_text().strip()}")
    forms = {"anonymous": False, "memfd": True}
    samples: dict[str, list[dict[str, float]]] = {form: [] for form in forms}
    with tempfile.TemporaryDirectory(prefix="bench-ram-backing-") as tmp:
        for i in range(runs):
            order = list(forms) if i % 2 == 0 else list(reversed(forms))
            for form in order:
                os.sync()  # no earlier boot's files being written back
                got = await boot(guest, accel, Path(tmp) / f"{i}-{form}", forms[form])
                samples[form].append(got)
                print(f"run {i + 1}: {form:<9} wall {got['wall']:.2f} s, uptime {got['uptime']:.2f} s, "
                      f"CPU {got['cpu']:.2f} s, minor faults {got['faults']:.0f}", flush=True)
    print(f"\nmedians of {runs}:")
    for form, rows in samples.items():
        med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        print(f"  {form:<9} wall {med['wall']:.2f} s, uptime {med['uptime']:.2f} s, CPU {med['cpu']:.2f} s, "
              f"minor faults {med['faults']:.0f}")
    pairs = [m["uptime"] / a["uptime"] for a, m in zip(samples["anonymous"], samples["memfd"], strict=True)]
    print(f"  memfd ÷ anonymous, the guest's uptime, median of the runs' own ratios: {statistics.median(pairs):.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--guest", choices=["tiny", "debian"], default="tiny")
    args = p.parse_args()
    asyncio.run(main(args.runs, args.guest))
