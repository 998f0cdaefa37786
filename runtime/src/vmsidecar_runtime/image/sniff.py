"""What a stream is, from its first bytes: compression magic, disk format, and the format to boot.

Sniffing is the first step of every path that accepts a guest disk (pull, flash, push); the
decompressed head is also where :func:`.write.write_disk` reads a qcow2 header before writing.
"""

from __future__ import annotations

from typing import BinaryIO, Literal

from vmsidecar_contract.errors import ImageError

from .limits import Origin

DiskFormat = Literal["qcow2", "raw"]
Compression = Literal["zstd", "gzip", "xz"]

QCOW2_MAGIC = b"QFI\xfb"
COMPRESSION_MAGIC: dict[Compression, bytes] = {
    "zstd": b"\x28\xb5\x2f\xfd",
    "gzip": b"\x1f\x8b",
    "xz": b"\xfd7zXZ\x00",
}
#: enough decompressed bytes to see every signature (the ext superblock magic is at 1080)
SNIFF_BYTES = 2048


def sniff_compression(head: bytes) -> Compression | None:
    """The compression of a stream from its first bytes (6 are enough), or ``None``."""
    for name, magic in COMPRESSION_MAGIC.items():
        if head.startswith(magic):
            return name
    return None


def sniff_format(head: bytes) -> DiskFormat | None:
    """``qcow2`` for the qcow2 magic, ``raw`` for a bootable disk's signature, else ``None``.

    Raw signatures: the MBR (or GPT's protective MBR) boot signature at 510, the ext2/3/4
    superblock magic at 1080. ``head`` should hold :data:`SNIFF_BYTES` bytes when the data does.
    """
    if head.startswith(QCOW2_MAGIC):
        return "qcow2"
    if len(head) >= 512 and head[510:512] == b"\x55\xaa":
        return "raw"
    if len(head) >= 1082 and head[1080:1082] == b"\x53\xef":
        return "raw"
    return None


def decide_format(head: bytes, declared: DiskFormat | None, origin: Origin, *, guess_raw: bool = False) -> DiskFormat:
    """The format to boot a disk as, from its first bytes and what its sender declared.

    Declared raw stays raw: probing a raw disk is QEMU's classic hole (a guest that writes a
    qcow2 header into its raw disk would make the host open a file of its choosing on the next
    boot). Declared qcow2 must carry the magic. Undeclared: qcow2 by magic, raw by signature; a
    disk with neither is raw only with ``guess_raw`` (a pull whose file or layer name says it is
    a disk image), else refused.

    :raise ImageError: (code ``bad_disk``) for a declared qcow2 without the magic, and for data
        that does not look like a disk without ``guess_raw``.
    """
    sniffed = sniff_format(head)
    if declared == "qcow2" and sniffed != "qcow2":
        raise ImageError(
            f"{origin.what} is declared qcow2 but does not start with the qcow2 magic; declare it raw, or "
            f"convert it with `qemu-img convert -O qcow2 IN OUT` and {origin.resend}",
            code="bad_disk",
        )
    if declared is not None:
        return declared
    if sniffed is not None:
        return sniffed
    if guess_raw:
        return "raw"
    raise ImageError(
        f"{origin.what} is not a disk image (no qcow2 header, no MBR/GPT boot signature, no ext4 "
        "superblock); send a qcow2 or raw disk image, optionally zstd/gzip/xz-compressed",
        code="bad_disk",
    )


def read_at_least(stream: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes: fewer only at the end of the stream (a read may return a short chunk)."""
    parts: list[bytes] = []
    have = 0
    while have < n:
        data = stream.read(n - have)
        if not data:
            break
        parts.append(data)
        have += len(data)
    return b"".join(parts)
