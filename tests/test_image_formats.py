"""The one image pipeline (sniff → decompress → write → check) on real qemu-img images, and the
flash and pull paths that use it: unsafe or oversized images are refused by both, with the same
sentence, and leave nothing behind. Fast: no guest is booted."""

from __future__ import annotations

import asyncio
import errno
import gzip
import hashlib
import io
import lzma
import os
import random
import struct
import subprocess
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zstandard

from fixtures.registry import Crafter, RunningRegistry, make_qcow2
from fixtures.waiting import wait_until_async
from vmsidecar_contract.errors import HostError, ImageError
from vmsidecar_runtime.disk import receive_image
from vmsidecar_runtime.image.checks import check_image
from vmsidecar_runtime.image.decompress import open_decompressed
from vmsidecar_runtime.image.digest import sha256_digest
from vmsidecar_runtime.image.limits import Limits, Origin
from vmsidecar_runtime.image.sniff import decide_format, sniff_compression, sniff_format
from vmsidecar_runtime.image.write import write_disk
from vmsidecar_runtime.oci import pull, push_artifact, write_layout

FLASH = Origin("the image", "flash the result")
TITLE = "org.opencontainers.image.title"
FLATTEN = "flatten it with `qemu-img convert -O qcow2 IN OUT`"


def qemu_img(*args: str) -> None:
    subprocess.run(["qemu-img", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real images made by qemu-img: a good one and every kind this module must refuse."""
    d = tmp_path_factory.mktemp("images")
    made = {
        "good": make_qcow2(d / "good.qcow2"),
        "backing": d / "backing.qcow2",  # the reproducer: a host file as the guest's disk
        "backing_v2": d / "backing-v2.qcow2",
        "data_file": d / "data-file.qcow2",
        "huge": d / "huge.qcow2",
        "corrupt": d / "corrupt.qcow2",
        "leaky": d / "leaky.qcow2",
    }
    qemu_img("create", "-q", "-f", "qcow2", "-F", "raw", "-b", "/etc/hostname", str(made["backing"]))
    qemu_img("create", "-q", "-f", "qcow2", "-o", "compat=0.10", "-F", "raw", "-b", "/etc/hostname",
             str(made["backing_v2"]))
    qemu_img("create", "-q", "-f", "qcow2", "-o", f"data_file={d / 'x.data'}", str(made["data_file"]), "1M")
    qemu_img("create", "-q", "-f", "qcow2", str(made["huge"]), "2T")  # sparse: 2 TiB in ~300 KiB
    data = bytearray(made["good"].read_bytes())
    data[0x28:0x30] = b"\x7f" + b"\xff" * 7  # the L1 table offset far past the end of the file
    made["corrupt"].write_bytes(bytes(data))
    made["leaky"].write_bytes(_with_leaked_cluster(made["good"].read_bytes()))
    return made


def _with_leaked_cluster(data: bytes) -> bytes:
    """Unlink the first data cluster from its L2 table: still refcounted, so qemu-img check rc 3."""
    out = bytearray(data)
    (l1_offset,) = struct.unpack_from(">Q", out, 40)
    l2_offset = struct.unpack_from(">Q", out, l1_offset)[0] & 0x00FFFFFFFFFFFE00
    struct.pack_into(">Q", out, l2_offset, 0)
    return bytes(out)


def _zstd_frames(data: bytes, parts: int = 1) -> bytes:
    step = -(-len(data) // parts)
    cctx = zstandard.ZstdCompressor(level=3, write_checksum=True)
    return b"".join(cctx.compress(data[i : i + step]) for i in range(0, len(data), step))


COMPRESS = {
    "zstd": lambda data: _zstd_frames(data),
    "gzip": lambda data: gzip.compress(data, mtime=0),
    "xz": lambda data: lzma.compress(data),
}


def _nothing_left(cache: Path) -> None:
    for sub in ("disks", "tmp"):
        d = cache / sub
        assert not d.exists() or list(d.iterdir()) == [], f"{sub}: {list(d.iterdir())}"


# ---- the helper for digests ---------------------------------------------------------------------


def test_sha256_digest_of_bytes_and_of_a_running_hash() -> None:
    h = hashlib.sha256()
    h.update(b"ab")
    h.update(b"c")
    assert sha256_digest(b"abc") == sha256_digest(h) == "sha256:" + hashlib.sha256(b"abc").hexdigest()
    with pytest.raises(ValueError, match="needs a sha256 hash object"):
        sha256_digest(hashlib.sha1(b"abc"))  # a sha1 must be refused, not mislabelled


# ---- sniffing and the format decision -----------------------------------------------------------


def test_sniffing(images: dict[str, Path]) -> None:
    good = images["good"].read_bytes()
    assert sniff_format(good[:2048]) == "qcow2"
    assert sniff_format(b"\0" * 510 + b"\x55\xaa") == "raw"  # MBR / protective MBR
    assert sniff_format(b"\0" * 1080 + b"\x53\xef") == "raw"  # ext2/3/4 superblock
    assert sniff_format(b"\x01" * 2048) is None
    for name, compress in COMPRESS.items():
        assert sniff_compression(compress(good)[:8]) == name
    assert sniff_compression(good[:8]) is None


def test_format_decision() -> None:
    qcow2_head = b"QFI\xfb" + b"\0" * 100
    # declared raw is never probed, and a raw disk with a qcow2 header is refused (issue 19:
    # qemu-img called without -f would follow its backing file; tests/test_attack_images.py)
    with pytest.raises(ImageError, match="declared raw but starts with the qcow2 signature") as exc:
        decide_format(qcow2_head, "raw", FLASH)
    assert exc.value.code == "unsafe_disk"
    with pytest.raises(ImageError, match="declared qcow2 but does not start with the qcow2 magic") as exc:
        decide_format(b"\0" * 2048, "qcow2", FLASH)
    assert exc.value.code == "bad_disk"
    with pytest.raises(ImageError, match="is not a disk image") as exc:
        decide_format(b"\x01" * 2048, None, FLASH)
    assert exc.value.code == "bad_disk"
    assert decide_format(b"\x01" * 2048, None, FLASH, guess_raw=True) == "raw"


# ---- checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "code", "needles"),
    [
        ("backing", "unsafe_disk", ["names a backing file (/etc/hostname)", FLATTEN, "and flash the result"]),
        ("backing_v2", "unsafe_disk", ["names a backing file (/etc/hostname)", FLATTEN]),
        ("data_file", "unsafe_disk", ["with an external data file (", "x.data)", "qemu-img convert -O qcow2"]),
        ("huge", "disk_too_large", ["has a virtual size of 2 TiB, more than the 64 GiB limit"]),
        ("corrupt", "bad_disk", ["is a corrupt qcow2 (", "re-download or rebuild the image"]),
    ],
)
def test_check_image_refuses(images: dict[str, Path], kind: str, code: str, needles: list[str]) -> None:
    with pytest.raises(ImageError) as exc:
        check_image(images[kind], "qcow2", FLASH)
    assert exc.value.code == code
    for needle in needles:
        assert needle in exc.value.message
    assert exc.value.message.startswith("the image ") and "; " in exc.value.message


def test_check_image_accepts_good_and_leaky(images: dict[str, Path], tmp_path: Path) -> None:
    check_image(images["good"], "qcow2", FLASH)
    check_image(images["leaky"], "qcow2", FLASH)  # rc 3: leaked clusters only, harmless
    empty = tmp_path / "empty.raw"
    empty.write_bytes(b"")
    with pytest.raises(ImageError, match=r"is empty \(0 bytes\)"):
        check_image(empty, "raw", FLASH)


def test_limits_are_parameters(images: dict[str, Path], tmp_path: Path) -> None:
    raw = tmp_path / "disk.raw"
    raw.write_bytes(b"\0" * 510 + b"\x55\xaa" + b"\0" * 4096)
    with pytest.raises(ImageError, match=r"has a virtual size of 4\.5 KiB, more than the 4 KiB limit") as exc:
        check_image(raw, "raw", FLASH, Limits(max_virtual_size=4096))
    assert exc.value.code == "disk_too_large"
    with pytest.raises(ImageError, match="more than the 8 MiB limit"):
        check_image(images["good"], "qcow2", FLASH, Limits(max_virtual_size=8 << 20))  # a 16 MiB disk


def test_write_disk_refuses_an_unsafe_header_before_writing(images: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    for kind in ("backing", "data_file", "huge"):
        with open(images[kind], "rb") as src, pytest.raises(ImageError):
            write_disk(src, out, declared=None, origin=FLASH)
        assert not out.exists()
    with pytest.raises(ImageError, match="is empty"):
        write_disk(io.BytesIO(b""), out, declared=None, origin=FLASH)
    written = write_disk(io.BytesIO(images["good"].read_bytes()), out, declared=None, origin=FLASH)
    assert (written.format, written.size) == ("qcow2", images["good"].stat().st_size)
    assert written.digest == sha256_digest(images["good"].read_bytes())


# ---- decompression -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMPRESS))
def test_decompression_round_trip_and_truncation(images: dict[str, Path], name: str) -> None:
    data = images["good"].read_bytes()
    packed = COMPRESS[name](data)
    used, stream = open_decompressed(io.BytesIO(packed), "auto", FLASH)
    assert used == name and stream.read() == data
    _, stream = open_decompressed(io.BytesIO(packed[: len(packed) // 2]), "auto", FLASH)
    with pytest.raises(ImageError) as exc:
        stream.read()
    assert exc.value.code == "bad_compression"
    assert f"could not be decompressed ({name}: the stream ended early (truncated))" in exc.value.message


def test_concatenated_streams_are_one_disk(images: dict[str, Path]) -> None:
    data = images["good"].read_bytes()
    half = len(data) // 2
    for packed in (_zstd_frames(data, parts=3), gzip.compress(data[:half]) + gzip.compress(data[half:]),
                   lzma.compress(data[:half]) + lzma.compress(data[half:])):
        _, stream = open_decompressed(io.BytesIO(packed), "auto", FLASH)
        assert stream.read() == data


def _skippable(payload: bytes, magic: int = 0x184D2A50) -> bytes:
    return magic.to_bytes(4, "little") + len(payload).to_bytes(4, "little") + payload


def _zstd_parts() -> list[tuple[bytes, bytes]]:
    """Frames of every shape one stream may hold, each with what it decodes to."""
    data = os.urandom(200_000) + bytes(1 << 20) + b"vm" * 100_000
    checked = zstandard.ZstdCompressor(level=3, write_checksum=True)
    bare = zstandard.ZstdCompressor(level=1, write_checksum=False, write_content_size=False)
    streamed = checked.compressobj()  # no content size: a window descriptor, blocks up to the last
    return [
        (_skippable(b"zstd:chunked's manifest sits in frames like this", 0x184D2A5F), b""),
        (checked.compress(data), data),
        (bare.compress(data[:5000]), data[:5000]),
        (checked.compress(b""), b""),
        (_skippable(b""), b""),
        (streamed.compress(data) + streamed.flush(), data),
        (zstandard.ZstdCompressor(level=19).compress(bytes(4 << 20)), bytes(4 << 20)),  # RLE blocks
    ]


def test_a_zstd_stream_cut_off_inside_a_frame_is_truncated_wherever_the_cut_is() -> None:
    """zstandard's stream_reader, which decodes the zstd layers into the caller's buffer, ends
    silently where its input ends; the reader follows the frames as they go by, so a stream cut off
    anywhere in a frame (header, block header, block, checksum, skippable frame) is an error, and one
    cut between two frames is the frames before the cut."""
    parts = _zstd_parts()
    stream = b"".join(packed for packed, _ in parts)
    ends, decoded, offset = {0: b""}, b"", 0
    for packed, plain in parts:
        offset, decoded = offset + len(packed), decoded + plain
        ends[offset] = decoded
    rng = random.Random(23)
    cuts = set(range(24)) | {end + d for end in ends for d in range(-20, 21)} | {rng.randrange(len(stream)) for _ in range(150)}
    for cut in sorted(c for c in cuts if 0 <= c <= len(stream)):
        _, reader = open_decompressed(io.BytesIO(stream[:cut]), "zstd", FLASH)
        if cut in ends:
            assert reader.read() == ends[cut], cut
            continue
        with pytest.raises(ImageError) as exc:
            reader.read()
        assert exc.value.code == "bad_compression", cut
        assert "(zstd: the stream ended early (truncated))" in exc.value.message, (cut, exc.value.message)


@pytest.mark.parametrize("tail", ["garbage", "reserved block"])
def test_bytes_after_the_last_zstd_frame_that_are_no_frame_are_refused(tail: str) -> None:
    frame = zstandard.ZstdCompressor(level=3).compress(b"x" * 1000)  # a 7-byte header, then the block's
    after = {"garbage": b"not zstd", "reserved block": frame[:7] + bytes([frame[7] | 0b110]) + frame[8:]}[tail]  # type bits
    _, reader = open_decompressed(io.BytesIO(frame + after), "zstd", FLASH)
    with pytest.raises(ImageError) as exc:
        reader.read()
    assert exc.value.code == "bad_compression"
    why = {"garbage": "the bytes 6e6f7420 are not a zstd magic number", "reserved block": "reserved type 3"}[tail]
    assert why in exc.value.message


def test_decompression_bomb_stops_at_the_limit() -> None:
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(256 << 20))  # 256 MiB of zeros in ~8 KiB
    assert len(bomb) < 64 << 10
    _, stream = open_decompressed(io.BytesIO(bomb), "auto", FLASH, Limits(max_disk_bytes=8 << 20))
    read = 0
    with pytest.raises(ImageError) as exc:
        while chunk := stream.read(1 << 20):
            assert len(chunk) <= 1 << 20  # memory stays bounded whatever the ratio
            read += len(chunk)
    assert read <= 8 << 20
    assert exc.value.code == "disk_too_large"
    assert "is larger than 8 MiB once decompressed" in exc.value.message


# ---- flash (receive_image, without a runtime) ---------------------------------------------------


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize("compression", [None, "zstd", "gzip", "xz"])
async def test_flash_refuses_a_backing_file_in_any_wrapping(
    images: dict[str, Path], tmp_path: Path, compression: str | None
) -> None:
    data = images["backing"].read_bytes()
    if compression:
        data = COMPRESS[compression](data)
    with pytest.raises(ImageError) as exc:
        await receive_image(_chunks(data, 4096), tmp_path / "flashed", expected_size=len(data))
    assert exc.value.code == "unsafe_disk"
    assert exc.value.message.startswith("the flashed image is a qcow2 overlay that names a backing file (/etc/hostname)")
    assert f"{FLATTEN} and flash the result" in exc.value.message
    assert list((tmp_path / "flashed").iterdir()) == []


async def test_flash_refuses_data_file_and_huge_and_bombs(images: dict[str, Path], tmp_path: Path) -> None:
    dest = tmp_path / "flashed"
    for kind, code in (("data_file", "unsafe_disk"), ("huge", "disk_too_large")):
        data = images[kind].read_bytes()
        with pytest.raises(ImageError) as exc:
            await receive_image(_chunks(data, 1 << 20), dest)
        assert exc.value.code == code
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * 510 + b"\x55\xaa" + bytes(64 << 20))
    with pytest.raises(ImageError, match="is larger than 4 MiB once decompressed") as exc:
        await receive_image(_chunks(bomb, 1 << 20), dest, limits=Limits(max_disk_bytes=4 << 20))
    assert exc.value.code == "disk_too_large"
    assert list(dest.iterdir()) == []


async def test_flash_in_tiny_chunks_still_sniffs_and_verifies(images: dict[str, Path], tmp_path: Path) -> None:
    data = images["good"].read_bytes()
    packed = COMPRESS["gzip"](data)
    received = await receive_image(_chunks(packed, 3), tmp_path / "flashed", expected_size=len(packed),
                                   expected_digest=sha256_digest(data))
    assert (received.format, received.compression, received.size) == ("qcow2", "gzip", len(data))
    assert received.path.read_bytes() == data


async def test_cancelled_flash_stops_the_worker_and_leaves_nothing(images: dict[str, Path], tmp_path: Path) -> None:
    dest = tmp_path / "flashed"
    stalled = asyncio.Event()

    async def stalling() -> AsyncIterator[bytes]:
        yield images["good"].read_bytes()[:65536]  # enough for the worker to create its temp file
        stalled.set()
        await asyncio.Event().wait()  # a sender that stops sending
        yield b""

    task = asyncio.create_task(receive_image(stalling(), dest))
    await asyncio.wait_for(stalled.wait(), 10)
    await wait_until_async(lambda: list(dest.glob(".incoming-*")), 5, "the worker to start writing")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the worker thread unwinds at its next read and removes what it wrote
    await wait_until_async(lambda: not list(dest.iterdir()), 5, "the worker to remove what it wrote",
                           detail=lambda: list(dest.iterdir()))


# ---- pull: file:, OCI layout, registry, containerDisk -------------------------------------------


def test_pull_file_refuses_unsafe_and_huge_disks(images: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    zst = tmp_path / "backing.qcow2.zst"
    zst.write_bytes(COMPRESS["zstd"](images["backing"].read_bytes()))
    for path, code, needle in (
        (images["backing"], "unsafe_disk", "names a backing file (/etc/hostname)"),
        (zst, "unsafe_disk", "names a backing file (/etc/hostname)"),
        (images["backing_v2"], "unsafe_disk", "names a backing file (/etc/hostname)"),
        (images["data_file"], "unsafe_disk", "with an external data file"),
        (images["huge"], "disk_too_large", "has a virtual size of 2 TiB"),
        (images["corrupt"], "bad_disk", "is a corrupt qcow2"),
    ):
        with pytest.raises(ImageError) as exc:
            pull(f"file:{path}", cache)
        assert exc.value.code == code, exc.value.message
        assert exc.value.message.startswith(f"file:{path} ") and needle in exc.value.message
        _nothing_left(cache)
        assert not (cache / "index.json").exists()


def test_pull_bomb_is_refused_with_nothing_left(tmp_path: Path) -> None:
    bomb = tmp_path / "zeros.raw.zst"
    bomb.write_bytes(zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20)))
    with pytest.raises(ImageError, match="is larger than 4 MiB once decompressed") as exc:
        pull(f"file:{bomb}", tmp_path / "cache", limits=Limits(max_disk_bytes=4 << 20))
    assert exc.value.code == "disk_too_large"
    _nothing_left(tmp_path / "cache")


def test_pull_file_whose_writeback_fails_is_refused_with_nothing_left(
    images: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk's fsync runs beside its checks, in another thread; an error there (EIO: a failing
    disk, which no test here can make for real: tmpfs and a full disk fail at the write) is the
    pull's, once. A second fsync may not report an error the kernel reported already, so the
    install's must not be what tells it."""
    real_fsync = os.fsync
    failed: list[int] = []

    def failing_fsync(fd: int) -> None:
        # the disk's first only (a temporary file of the cache): the install's would pass, as Linux's can
        if not failed and os.readlink(f"/proc/self/fd/{fd}").endswith(".part"):
            failed.append(fd)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    cache = tmp_path / "cache"
    with pytest.raises(HostError) as exc:
        pull(f"file:{images['good']}", cache)
    assert failed, "the pull never synced the disk"
    assert exc.value.code == "cache_write_failed", exc.value.message
    # the cause and its fix: space would not help a disk that fails its writes
    assert "Input/output error" in exc.value.message and "working disk" in exc.value.message, exc.value.message
    assert "free space" not in exc.value.message, exc.value.message
    _nothing_left(cache)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert pull(f"file:{images['good']}", cache).cached is False  # nothing was recorded either


def test_pull_layout_artifact_and_containerdisk_refuse_a_backing_file(
    images: dict[str, Path], tmp_path: Path
) -> None:
    evil = images["backing"].read_bytes()
    c = Crafter(layout=tmp_path / "layout")
    layer = c.blob(COMPRESS["zstd"](evil), "application/vnd.diskimage.qcow2+zstd", {TITLE: "evil.qcow2.zst"})
    ref = c.tag(c.manifest([layer]), "artifact")
    with pytest.raises(ImageError) as exc:
        pull(ref, tmp_path / "cache")
    assert exc.value.code == "unsafe_disk"
    assert f"{FLATTEN} and push the result" in exc.value.message
    _nothing_left(tmp_path / "cache")

    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        info = tarfile.TarInfo("disk/evil.qcow2")
        info.size = len(evil)
        t.addfile(info, io.BytesIO(evil))
    layer = c.blob(gzip.compress(tar.getvalue()), "application/vnd.oci.image.layer.v1.tar+gzip")
    ref = c.tag(c.manifest([layer]), "containerdisk")
    with pytest.raises(ImageError) as exc:
        pull(ref, tmp_path / "cache")
    assert exc.value.code == "unsafe_disk"
    assert exc.value.message.startswith("/disk/evil.qcow2 in layer ")
    assert "names a backing file (/etc/hostname)" in exc.value.message
    _nothing_left(tmp_path / "cache")


def test_pull_registry_artifact_refuses_a_data_file(
    images: dict[str, Path], registry: RunningRegistry, tmp_path: Path
) -> None:
    c = Crafter(registry=registry, repo="evil/data-file")
    layer = c.blob(images["data_file"].read_bytes(), "application/vnd.diskimage.qcow2", {TITLE: "d.qcow2"})
    ref = c.tag(c.manifest([layer]), "1")
    with pytest.raises(ImageError) as exc:
        pull(ref, tmp_path / "cache")
    assert exc.value.code == "unsafe_disk" and "with an external data file" in exc.value.message
    _nothing_left(tmp_path / "cache")


def test_push_refuses_what_pull_would_refuse(
    images: dict[str, Path], registry: RunningRegistry, tmp_path: Path
) -> None:
    for kind, code in (("data_file", "unsafe_disk"), ("huge", "disk_too_large"), ("corrupt", "bad_disk")):
        with pytest.raises(ImageError) as exc:
            write_layout(images[kind], tmp_path / "layout")
        assert exc.value.code == code and exc.value.message.startswith("disk file ")
    with pytest.raises(ImageError, match="names a backing file") as exc:
        push_artifact(images["backing"], f"{registry.host}/evil/push:1")
    assert f"{FLATTEN} and push the result" in exc.value.message
