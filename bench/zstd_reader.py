"""A snapshot's RAM layer through the runtime's zstd reader, against zstandard's own readers.

    uv run python bench/zstd_reader.py [--runs 3] [--ram-mib 1024] [--data-mib 190]

A registry warm start decompresses the snapshot's RAM layer: a templated snapshot's RAM file is the
guest's whole RAM, mostly zero pages (a Debian guest: 1 GiB, ~190 MB written). The layer is made
here the way ``vmsidecar-oci snapshot push`` makes it (zstd level 3, all cores, checksum) from
``--data-mib`` of this host's shared libraries in 2 MiB extents spread over ``--ram-mib`` of zeros,
then read, each run:

1. as the fetch reads it: ``open_decompressed`` (zstandard's ``stream_reader`` into the caller's
   buffer, the frames followed on the way so that a frame cut off is an error) in 1 MiB reads, each
   checked for zeros (until 2026-11-30: 1 KiB slices into ``decompressobj``, 0.94-1.03 s here);
2. zstandard's ``decompressobj`` fed 1 MiB slices, the output dropped;
3. zstandard's ``stream_reader`` into one reused 1 MiB buffer, alone (it ends silently on a
   truncated frame).

Prints each run and the medians.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import zstandard

from vmsidecar_runtime.image.decompress import open_decompressed
from vmsidecar_runtime.image.limits import MIB, Origin
from vmsidecar_runtime.oci.snapshot_fetch import CHUNK, _all_zero

EXTENT = 2 * MIB


def ram_layer(ram_mib: int, data_mib: int) -> bytes:
    """A RAM file of ``ram_mib`` with ``data_mib`` of real bytes in spread extents, compressed."""
    data = bytearray()
    for lib in sorted(Path("/usr/lib").rglob("*.so*")):
        if len(data) >= data_mib * MIB:
            break
        if lib.is_file() and not lib.is_symlink():
            data += lib.read_bytes()
    ram = bytearray(ram_mib * MIB)
    extents = range(0, min(len(data), data_mib * MIB), EXTENT)
    step = len(ram) // max(1, len(extents))
    for n, offset in enumerate(extents):
        piece = data[offset:offset + EXTENT]
        ram[n * step:n * step + len(piece)] = piece
    return zstandard.ZstdCompressor(level=3, threads=-1, write_checksum=True).compress(ram)


def as_fetched(layer: bytes) -> int:
    _, stream = open_decompressed(io.BytesIO(layer), "zstd", Origin("the bench's layer", "-"))
    zero = 0
    while data := stream.read(CHUNK):
        zero += _all_zero(data)
    return zero


def decompressobj_mib_slices(layer: bytes) -> int:
    frame, view = zstandard.ZstdDecompressor().decompressobj(), memoryview(layer)
    return sum(len(frame.decompress(view[i:i + MIB])) for i in range(0, len(layer), MIB))


def stream_reader_into_one_buffer(layer: bytes) -> int:
    reader, buffer, total = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(layer)), bytearray(CHUNK), 0
    while n := reader.readinto(buffer):
        total += n
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ram-mib", type=int, default=1024)
    p.add_argument("--data-mib", type=int, default=190)
    args = p.parse_args()
    layer = ram_layer(args.ram_mib, args.data_mib)
    print(f"RAM {args.ram_mib} MiB with {args.data_mib} MiB written: layer {len(layer) / MIB:.1f} MiB")
    readers: dict[str, Callable[[bytes], int]] = {
        "as the fetch reads it (+ zero check)": as_fetched,
        "decompressobj, 1 MiB slices": decompressobj_mib_slices,
        "stream_reader into one buffer": stream_reader_into_one_buffer,
    }
    seconds: dict[str, list[float]] = {name: [] for name in readers}
    for run in range(args.runs):
        for name, read in readers.items():
            started = time.perf_counter()
            read(layer)
            seconds[name].append(time.perf_counter() - started)
            print(f"run {run + 1}: {name:<38} {seconds[name][-1]:.2f} s", flush=True)
    print(f"\nmedians of {args.runs}:")
    for name, values in seconds.items():
        print(f"  {name:<38} {statistics.median(values):.2f} s")


if __name__ == "__main__":
    main()
