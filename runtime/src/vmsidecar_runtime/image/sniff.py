"""What a stream is, from its first bytes: compression magic, disk format, and the format to boot.

Sniffing is the first step of every path that accepts a guest disk (pull, flash, push); the
decompressed head is also where :func:`.write.write_disk` reads a qcow2 header before writing.
"""

from __future__ import annotations

import re
from typing import Literal, Protocol

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
#: enough decompressed bytes to see every signature (the ext superblock magic is at 1080); also
#: what QEMU's format probes read (``BLOCK_PROBE_BUF_SIZE``)
SNIFF_BYTES = 2048

#: signatures at offset 0 of the formats qemu-img and QEMU recognise by probing (QEMU 7.2's
#: ``bdrv_probe`` drivers), most of which can name other host files (backing files, extents,
#: data files); the VDI and VMDK text checks are in :func:`sniff_probed_format`
PROBED_MAGIC: dict[str, tuple[bytes, ...]] = {
    "qcow2": (QCOW2_MAGIC,),  # version 1 is qcow
    "qed": (b"QED\0",),
    "vmdk": (b"KDMV", b"COWD"),
    "vhdx": (b"vhdxfile",),
    "vpc": (b"conectix",),
    "luks": (b"LUKS\xba\xbe",),
    "parallels": (b"WithoutFreeSpace", b"WithouFreSpacExt"),
    "bochs": (b"Bochs Virtual HD Image",),
    "cloop": (b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$IMAGE\n",),
}
_VDI_SIGNATURE = b"\x7f\x10\xda\xbe"  # 0xbeda107f little-endian, at offset 64
_VMDK_VERSION = re.compile(rb"version=[123]\r?\n")


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


def sniff_probed_format(head: bytes) -> str | None:
    """The format QEMU's probing would give ``head`` other than raw (``vmdk``, ``qcow2`` …), or ``None``.

    The same tests as QEMU's probe functions, on the same 2048 bytes: offset-0 magics, the VDI
    signature at 64, and a VMDK text descriptor (comment and blank lines, then ``version=N``).
    DMG is probed by file name only (``.dmg``), which the runtime never gives a disk.
    """
    for fmt, magics in PROBED_MAGIC.items():
        if head.startswith(magics):
            return "qcow" if fmt == "qcow2" and head[4:8] == b"\0\0\0\1" else fmt
    if head[64:68] == _VDI_SIGNATURE:
        return "vdi"
    return "vmdk" if _is_vmdk_descriptor(head[:SNIFF_BYTES]) else None


def _is_vmdk_descriptor(head: bytes) -> bool:
    """QEMU's ``vmdk_probe`` for a text descriptor: ``#`` lines and blank lines, then ``version=1|2|3``."""
    pos = 0
    while pos < len(head):
        if head[pos : pos + 1] == b"#":
            end = head.find(b"\n", pos)
            pos = len(head) if end < 0 else end + 1
            continue
        if head[pos : pos + 1] == b" ":
            while head[pos : pos + 1] == b" ":
                pos += 1
            if head[pos : pos + 1] == b"\r":
                pos += 1
            if head[pos : pos + 1] != b"\n":
                return False
            pos += 1
            continue
        return _VMDK_VERSION.match(head, pos) is not None
    return False


def decide_format(head: bytes, declared: DiskFormat | None, origin: Origin, *, guess_raw: bool = False) -> DiskFormat:
    """The format to boot a disk as, from its first bytes and what its sender declared.

    Declared raw is booted as raw, never probed: probing a raw disk is QEMU's classic hole (a
    guest that writes a qcow2 header into its raw disk would make the host open a file of its
    choosing on the next boot). For the same reason a disk that would be raw (declared, guessed,
    or sniffed by its MBR signature) but starts like another format QEMU probes for is refused:
    one ``qemu-img`` or QEMU call anywhere that omits the format would open the backing, extent
    or data file that image names on the host (a dump handed ``/etc/passwd`` back). Declared
    qcow2 must carry the magic. Undeclared: qcow2 by magic, raw by signature; a disk with
    neither is raw only with ``guess_raw`` (a pull whose file or layer name says it is a disk
    image), else refused.

    :raise ImageError: (code ``bad_disk``) for a declared qcow2 without the magic, and for data
        that does not look like a disk without ``guess_raw``; (code ``unsafe_disk``) for a raw
        disk that is another format in disguise.
    """
    sniffed = sniff_format(head)
    if declared == "qcow2" and sniffed != "qcow2":
        raise ImageError(
            f"{origin.what} is declared qcow2 but does not start with the qcow2 magic; declare it raw, or "
            f"convert it with `qemu-img convert -O qcow2 IN OUT` and {origin.resend}",
            code="bad_disk",
        )
    fmt = declared or sniffed or ("raw" if guess_raw else None)
    if fmt == "raw":
        refuse_disguised_raw(head, declared, origin)
        return fmt
    if fmt is not None:
        return fmt
    raise ImageError(
        f"{origin.what} is not a disk image (no qcow2 header, no MBR/GPT boot signature, no ext4 "
        "superblock); send a qcow2 or raw disk image, optionally zstd/gzip/xz-compressed",
        code="bad_disk",
    )


def refuse_disguised_raw(head: bytes, declared: DiskFormat | None, origin: Origin) -> None:
    """Refuse a disk kept as raw whose first bytes are another probed format's.

    :raise ImageError: (code ``unsafe_disk``) naming the format and the conversion.
    """
    probed = sniff_probed_format(head)
    if probed is None:
        return
    how = "declared raw" if declared == "raw" else "taken as raw (it has no declared format)"
    alternative = "; or declare it qcow2 if it is one without a backing or data file" if probed == "qcow2" else ""
    raise ImageError(
        f"{origin.what} is {how} but starts with the {probed} signature: qemu-img or QEMU would open it as "
        f"{probed}, following any backing, extent or data file it names on the host; convert it to a plain disk "
        f"with `qemu-img convert -f {probed} -O qcow2 IN OUT` and {origin.resend}{alternative}",
        code="unsafe_disk",
    )


class ByteSource(Protocol):
    """What the image code reads from: ``read(n)`` gives up to ``n`` bytes, ``b""`` at the end (a
    file, a tar member, a registry blob, a flash's upload, a decompressor)."""

    def read(self, size: int = -1, /) -> bytes: ...


def read_at_least(stream: ByteSource, n: int) -> bytes:
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
