"""Capture copy benchmark: what a templated capture does with the guest's RAM, without a guest.

    uv run python bench/capture_copy.py [--runs 7] [--size-mb 256] [--data-mb 144]
    PYTHONPATH=OLD/runtime/src uv run python bench/capture_copy.py   # an older checkout's code

A memfd of ``--size-mb`` with ``--data-mb`` written, in two layouts: ``blocks`` (1 MiB runs, as a
booted tiny guest's RAM is: ~15 extents) and ``scattered`` (single pages at random: 16,000
extents, the worst case). For each, medians of ``--runs``:

- ``copy+seal → file``: ``copy_ram`` into a new file in ``--dir`` (default: the temporary
  directory; point it at the cache's volume) (what the capture did in the pause before 2026-11-27, and what the store does after Ready);
- ``pause → memfd``: what the pause of a capture whose guest goes on does with its RAM: now
  ``FrozenRam.freeze`` (a copy into a memfd whose pages were allocated while the guest booted,
  ``FrozenRam.mirror``, untimed here; then sealed read-only, hashed after Ready); in the night of
  2026-11-27 ``seal_into`` (copy and seal into a new memfd); before that nothing (the file's copy);
- ``re-hash``: ``hash_ram`` of the file (a restore's seal check).

The file's figures depend on the disk's writeback: a run right after a large write is slower.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from vmsidecar_runtime import capture_ram
from vmsidecar_runtime.capture_ram import CaptureRam, copy_ram
from vmsidecar_runtime.snapshots import hash_ram

MIB = 1 << 20


def _ram(layout: str, size: int, data: int) -> CaptureRam:
    ram = CaptureRam(f"bench-{layout}")
    assert ram.fd is not None
    os.ftruncate(ram.fd, size)
    if layout == "blocks":
        block = os.urandom(MIB)
        step = size // (data // MIB)
        for i in range(data // MIB):
            os.pwrite(ram.fd, block, i * step - i * step % MIB)
    else:
        rng = random.Random(1)
        page = os.urandom(4096)
        for p in rng.sample(range(size // 4096), data // 4096):
            os.pwrite(ram.fd, page, p * 4096)
    return ram


def _pause(ram: CaptureRam) -> float | None:
    """Seconds the pause spends on the RAM, by whichever way the code under test has."""
    frozen_ram = getattr(capture_ram, "FrozenRam", None)
    seal_into = getattr(capture_ram, "seal_into", None)
    if frozen_ram is not None:
        frozen = frozen_ram("bench-frozen", ram)
        frozen.mirror()  # while the guest boots
        started = time.monotonic()
        frozen.freeze()
        seconds = time.monotonic() - started
        frozen.close()
        return seconds
    if seal_into is not None:
        copy = CaptureRam("bench-frozen")
        started = time.monotonic()
        seal_into(ram, copy)
        seconds = time.monotonic() - started
        copy.close()
        return seconds
    return None


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s" if values else "—"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--data-mb", type=int, default=144)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the files are written")
    args = p.parse_args()
    print(f"code: {capture_ram.__file__}")
    print(f"{'layout':<10} {'copy+seal → file':>18} {'pause → memfd':>18} {'re-hash':>10}")
    with tempfile.TemporaryDirectory(prefix="bench-capture-", dir=args.dir) as tmp:
        for layout in ("blocks", "scattered"):
            ram = _ram(layout, args.size_mb * MIB, args.data_mb * MIB)
            to_file: list[float] = []
            to_memfd: list[float] = []
            rehash: list[float] = []
            for run in range(args.runs):
                dest = Path(tmp) / f"ram-{layout}-{run}"
                started = time.monotonic()
                copy_ram(ram, dest)
                to_file.append(time.monotonic() - started)
                started = time.monotonic()
                hash_ram(dest)
                rehash.append(time.monotonic() - started)
                dest.unlink()
                if (pause := _pause(ram)) is not None:
                    to_memfd.append(pause)
            ram.close()
            print(f"{layout:<10} {_median(to_file):>18} {_median(to_memfd):>18} {_median(rehash):>10}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
