"""Guest disks: read-only bases, per-boot qcow2 overlays, and flashing a new base safely.

A flashed image is written to a temp file, decompressed on the fly, verified (length, digest,
``qemu-img check``, a boot signature for raw images) and only then renamed into place. Until
that rename nothing changes: a truncated or garbage stream leaves the previous disk as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import lzma
import os
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiofiles
import zstandard

from .errors import HostError, ImageError
from .procs import spawn

QCOW2_MAGIC = b"QFI\xfb"
_COMPRESSION_MAGIC = {b"\x28\xb5\x2f\xfd": "zstd", b"\x1f\x8b": "gzip", b"\xfd7zXZ\x00": "xz"}


@dataclass(frozen=True)
class DiskImage:
    """A read-only base disk the VM can boot from."""

    path: Path
    format: str  # "qcow2" | "raw"
    digest: str  # "sha256:…" of the uncompressed content
    source: str  # the reference or "flash"


async def run_tool(*argv: str) -> tuple[int, str, str]:
    """Run a helper program (list exec) and return (rc, stdout, stderr).

    :raise HostError: when the program is not installed.
    """
    try:
        proc = await spawn(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except FileNotFoundError:
        raise HostError(f"{argv[0]} is not installed; install qemu-utils") from None
    out, err = await proc.communicate()
    await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def check_image(path: Path, fmt: str, label: str | None = None) -> None:
    """Refuse an image QEMU could not boot from (corrupt qcow2, empty file).

    :raise ImageError: naming what is wrong and what to do.
    """
    label = label or f"disk image {path.name}"
    if path.stat().st_size == 0:
        raise ImageError(f"{label} is empty; provide a qcow2 or raw disk with content")
    if fmt == "qcow2":
        rc, out, err = await run_tool("qemu-img", "check", "-f", "qcow2", "--output=json", str(path))
        # rc 3 = only leaked clusters, harmless for a read-only base
        if rc not in (0, 3):
            detail = (err or out).strip().splitlines()
            raise ImageError(
                f"{label} is a corrupt qcow2 ({detail[-1] if detail else f'qemu-img check rc {rc}'}); "
                "re-download or rebuild the image"
            )


async def create_overlay(base: DiskImage, overlay: Path) -> None:
    """Create a fresh qcow2 overlay over ``base`` (the base is only ever read).

    :raise HostError: when qemu-img fails (disk full, permissions).
    """
    with contextlib.suppress(FileNotFoundError):
        overlay.unlink()
    rc, _, err = await run_tool(
        "qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base.path), "-F", base.format, str(overlay)
    )
    if rc != 0:
        raise HostError(f"cannot create the disk overlay {overlay} ({err.strip()}); free space or fix permissions")


def detect_format(head: bytes) -> str | None:
    """``qcow2`` or ``raw`` when the first bytes look like a bootable disk, else None."""
    if head.startswith(QCOW2_MAGIC):
        return "qcow2"
    if len(head) >= 512 and head[510:512] == b"\x55\xaa":  # MBR or protective MBR of GPT
        return "raw"
    if len(head) >= 1082 and head[1080:1082] == b"\x53\xef":  # ext2/3/4 superblock magic
        return "raw"
    return None


def _decompressor(head: bytes) -> tuple[str | None, object | None]:
    for magic, name in _COMPRESSION_MAGIC.items():
        if head.startswith(magic):
            if name == "zstd":
                return name, zstandard.ZstdDecompressor().decompressobj()
            if name == "gzip":
                return name, gzip.zlib.decompressobj(31)  # type: ignore[attr-defined]
            return name, lzma.LZMADecompressor()
    return None, None


@dataclass(frozen=True)
class ReceivedImage:
    """A verified image in a temp file, ready to be renamed into place."""

    path: Path
    format: str
    digest: str
    size: int
    compression: str | None


async def _sniffed(chunks: AsyncIterable[bytes], need: int = 2048) -> AsyncIterator[bytes]:
    """Re-chunk so that the first chunk holds at least ``need`` bytes (for magic detection)."""
    head = b""
    async for chunk in chunks:
        if head is not None and len(head) < need:
            head += chunk
            if len(head) >= need:
                yield head
                head = None  # type: ignore[assignment]
            continue
        yield chunk
    if head:
        yield head


async def receive_image(
    chunks: AsyncIterable[bytes],
    dest_dir: Path,
    *,
    expected_size: int | None = None,
    expected_digest: str | None = None,
    format_hint: str | None = None,
) -> ReceivedImage:
    """Stream an image into ``dest_dir``, decompressing, hashing and verifying it.

    ``expected_size`` is the length of the stream as sent (e.g. Content-Length); ``expected_digest``
    the sha256 of the uncompressed image.

    :raise ImageError: for a truncated, garbage, corrupt or mismatching image (nothing is kept).
    :raise HostError: when the disk is full.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest_dir / f".incoming-{os.getpid()}-{id(chunks):x}"
    sha = hashlib.sha256()
    received = written = 0
    compression: str | None = None
    decomp: object | None = None
    fmt: str | None = None
    try:
        async with aiofiles.open(tmp, "wb") as out:
            first = True
            async for chunk in _sniffed(chunks):
                received += len(chunk)
                if first:
                    compression, decomp = _decompressor(chunk)
                    first = False
                data = decomp.decompress(chunk) if decomp is not None else chunk  # type: ignore[attr-defined]
                if fmt is None and data:
                    fmt = format_hint or detect_format(data[:2048])
                    if fmt is None:
                        raise ImageError(
                            "the flashed data is not a disk image (no qcow2 header, no MBR/GPT boot signature, "
                            "no ext4 superblock); send a qcow2 or raw disk image, optionally zstd/gzip/xz-compressed"
                        )
                sha.update(data)
                written += len(data)
                await out.write(data)
        if expected_size is not None and received != expected_size:
            raise ImageError(
                f"the image stream was truncated ({received} of {expected_size} bytes arrived); "
                "flash again and check the source"
            )
        if decomp is not None and compression in ("zstd", "xz") and not getattr(decomp, "eof", True):
            raise ImageError(f"the {compression} stream ended early (truncated image); flash again and check the source")
        if decomp is not None and compression == "gzip" and not decomp.eof:  # type: ignore[attr-defined]
            raise ImageError("the gzip stream ended early (truncated image); flash again and check the source")
        if written == 0 or fmt is None:
            raise ImageError("the flashed image is empty; send a qcow2 or raw disk image")
        digest = f"sha256:{sha.hexdigest()}"
        if expected_digest and expected_digest != digest:
            raise ImageError(
                f"the flashed image has digest {digest} but {expected_digest} was expected; "
                "the data was corrupted on the way or the digest is wrong"
            )
        await check_image(tmp, fmt, "the flashed image")
        return ReceivedImage(tmp, fmt, digest, written, compression)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(e, ConnectionError):
            raise ImageError(
                f"the image stream was cut off after {received} bytes (the sender disconnected); the previous disk "
                "is kept; flash again"
            ) from e
        if e.errno == 28:
            raise HostError(f"no space left in {dest_dir} while flashing; free space or use a larger volume") from e
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def install_image(received: ReceivedImage, dest_dir: Path) -> DiskImage:
    """Make a received image a read-only base: rename it to its digest name, mode 0444."""
    final = dest_dir / f"{received.digest.replace(':', '-')}.{received.format}"
    os.chmod(received.path, 0o444)
    os.replace(received.path, final)
    return DiskImage(final, received.format, received.digest, "flash")


async def image_info(path: Path) -> dict[str, object]:
    """``qemu-img info`` as a dict."""
    rc, out, err = await run_tool("qemu-img", "info", "--output=json", str(path))
    if rc != 0:
        raise ImageError(f"cannot read disk image {path.name} ({err.strip()}); check the file")
    return json.loads(out)
