"""Bare QEMU boot → marker under TCG, per ``-cpu`` model: what the TCG default CPU costs a guest.

    uv run python bench/tcg_cpu.py [--runs 5] [--guest tiny|debian] [--cpu MODEL]...

Each run boots the guest once per model, interleaved (``bench/snapshot.py``'s bare leg: a fresh
overlay, serial on stdout, until ``VMSIDECAR-READY``), and prints the medians and each model's
ratio to the first. Default models: the runtime's TCG default (``max``), upstream
``jumpstarter-driver-qemu``'s TCG CPU (``qemu64`` with the x86-64-v2 features), ``max`` with
XSAVE off (so no AVX: the guest cannot enable it) and plain ``qemu64``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

from snapshot import bare_boot, resolve_guest  # bench/ is no package

from vmsidecar_contract.arch import host_arch
from vmsidecar_runtime.accel import choose_accel
from vmsidecar_runtime.backend.common import TCG_CPU

UPSTREAM_TCG_CPU = "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt"  # jumpstarter_driver_qemu 0.9.0, x86_64


async def main(runs: int, name: str, models: list[str]) -> None:
    guest = resolve_guest(name)
    assert guest is not None
    accel = choose_accel("auto", host_arch())
    if accel.accel != "tcg":
        raise SystemExit(f"this host runs guests under {accel.accel}: the TCG CPU model does not apply")
    seconds: dict[str, list[float]] = {m: [] for m in models}
    with tempfile.TemporaryDirectory(prefix="bench-tcg-cpu-") as tmp:
        for i in range(runs):
            for n, model in enumerate(models):
                os.sync()  # no earlier boot's files being written back
                took = await bare_boot(guest, accel, Path(tmp) / f"{i}-{n}", cpu=model)
                seconds[model].append(took)
                print(f"run {i + 1}: -cpu {model}: {took:.2f} s", flush=True)
    first = statistics.median(seconds[models[0]])
    print(f"\n{guest.name} guest ({guest.memory}), bare boot → marker, medians of {runs}:")
    for model in models:
        med = statistics.median(seconds[model])
        print(f"  -cpu {model:<40} {med:6.2f} s  ({min(seconds[model]):.2f}-{max(seconds[model]):.2f})  "
              f"÷ {models[0]}: {med / first:.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--guest", choices=["tiny", "debian"], default="debian")
    p.add_argument("--cpu", action="append", help="a -cpu value (repeatable); default: the four above")
    args = p.parse_args()
    default = [TCG_CPU[host_arch()], UPSTREAM_TCG_CPU, "max,xsave=off", "qemu64"]
    asyncio.run(main(args.runs, args.guest, args.cpu or default))
