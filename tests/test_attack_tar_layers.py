"""Hostile containerDisk tar layers, and disk layers a tool labels as tar, carried out for real
(security.md row 8; reliability.md).

* A GNU sparse tar entry (``tar -S``: type ``S``, or the pax ``GNU.sparse.*`` forms) claims its size
  in its header: a 100-byte layer made the pull write 512 MiB of zeros to the cache before the size
  limit refused the disk, and an endless chain of sparse extension blocks (or a pax 1.0 map) was read
  whole into memory before the runtime saw the entry. Both are refused at the header, naming the fix.
* ``oras push REG/x:1 disk.qcow2`` (no ``:TYPE``) labels the disk a plain tar layer titled with its
  file name: such a layer whose bytes are no tar is read as that disk, with every check of a disk.
* An upper layer's whiteout of the disk (``disk/.wh.NAME``, ``disk/.wh..wh..opq``, ``.wh.disk``)
  hides the lower layers' disk, as it does in the image's file system.

Every pull here is of an OCI layout the test writes; no guest is booted.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import zstandard

from fixtures.registry import Crafter, make_qcow2
from vmsidecar_contract.errors import ImageError
from vmsidecar_runtime.image.limits import MIB, Limits
from vmsidecar_runtime.oci import pull

pytestmark = pytest.mark.timeout(240)

TITLE = "org.opencontainers.image.title"
TAR = "application/vnd.oci.image.layer.v1.tar"
TAR_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
#: oras push's artifactType when none is given
ORAS_ARTIFACT = "application/vnd.unknown.artifact.v1"
#: the size limit of the filling pulls, and the size their sparse entry claims
LIMIT, CLAIMED = 16 * MIB, 512 * MIB


# ---- building tar layers by hand --------------------------------------------------------------------


def _octal(n: int, width: int) -> bytes:
    return f"{n:0{width - 1}o}".encode() + b"\0"


def _gnu_sparse_header(name: str, real_size: int, *, extended: bool = False) -> bytes:
    """An old-GNU sparse header (type ``S``, what ``tar --format=gnu -S`` writes) with no stored data:
    its map is one empty region, so the whole ``real_size`` it claims is a hole (zeros)."""
    h = bytearray(512)
    h[0 : len(name)] = name.encode()
    for offset, value in ((100, _octal(0o644, 8)), (108, _octal(0, 8)), (116, _octal(0, 8)),
                          (124, _octal(0, 12)), (136, _octal(0, 12))):
        h[offset : offset + len(value)] = value
    h[156:157] = b"S"
    h[257:265] = b"ustar  \0"  # GNU's magic and version
    h[386:410] = _octal(0, 12) + _octal(0, 12)  # the first region of the map: offset 0, 0 bytes
    h[482] = 1 if extended else 0  # extension blocks of the map follow the header
    h[483:495] = _octal(real_size, 12)
    h[148:156] = b" " * 8
    h[148:156] = f"{sum(h):06o}".encode() + b"\0 "
    return bytes(h)


def _sparse_extension_block() -> bytes:
    """One extension block of an old-GNU sparse map: 21 regions, and "another block follows"."""
    block = bytearray(512)
    for i in range(21):
        block[i * 24 : i * 24 + 24] = _octal(1000 + i, 12) + _octal(512, 12)
    block[504] = 1
    return bytes(block)


def _pax_member(name: str, pax: dict[str, str], data: bytes = b"") -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.pax_headers = len(data), pax
    return info.tobuf(tarfile.PAX_FORMAT) + data + b"\0" * (-len(data) % 512)


def _end(tar: bytes) -> bytes:
    return tar + b"\0" * 1024


def _sparse_layer(form: str) -> bytes:
    """A tar layer whose ``disk/disk.raw`` is sparse in ``form`` and claims :data:`CLAIMED` bytes, all
    a hole: a few hundred bytes of tar that extract to half a gigabyte of zeros."""
    real = str(CLAIMED)
    if form == "gnu":  # tar --format=gnu --sparse
        return _end(_gnu_sparse_header("disk/disk.raw", CLAIMED))
    if form == "pax-0.1":  # tar --format=posix --sparse --sparse-version=0.1
        return _end(_pax_member("disk/disk.raw", {"GNU.sparse.map": "0,0", "GNU.sparse.size": real}))
    if form == "pax-1.0":  # tar --format=posix --sparse (GNU tar's default since 1.21)
        pax = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "disk/disk.raw",
               "GNU.sparse.realsize": real}
        return _end(_pax_member("disk/GNUSparseFile.0/disk.raw", pax, b"1\n0\n0\n".ljust(512, b"\0")))
    assert form == "pax-global"  # the same map in a global header, which applies to every entry after it
    with io.BytesIO() as buf:
        globals_ = {"GNU.sparse.map": "0,0", "GNU.sparse.size": real}
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, pax_headers=globals_) as t:
            t.addfile(tarfile.TarInfo("disk/disk.raw"), io.BytesIO(b""))
        return buf.getvalue()


def _tar(files: list[tuple[str, bytes]]) -> bytes:
    with io.BytesIO() as buf:
        with tarfile.open(fileobj=buf, mode="w") as t:
            for name, data in files:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        return buf.getvalue()


# ---- the pull in a process of its own: its peak memory, and the most any file it writes may take ------

#: the program run by :func:`_pull_in_a_child`; prints one verdict line, then its peak (VmHWM, KiB)
_PULL = """
import resource, signal, sys, tarfile
from vmsidecar_contract.errors import VmsidecarError
from vmsidecar_runtime.image.limits import Limits
from vmsidecar_runtime.oci import pull, unpack
ref, cache, without = sys.argv[1], sys.argv[2], sys.argv[5]
limit, file_size = int(sys.argv[3]), int(sys.argv[4])
if file_size:  # a write past it fails (EFBIG) instead of filling the disk: the test's measure
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
if without == "header-refusal":  # a sparse form the header check missed: the byte bound must hold alone
    unpack._BoundedTarInfo = tarfile.TarInfo
try:
    pull(ref, cache, arch="x86_64", limits=Limits(limit or None, limit or None))
    print("pulled")
except VmsidecarError as e:
    print("refused", e.code, e.message.replace("\\n", " "))
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


class ChildPull(NamedTuple):
    verdict: str  #: "pulled" or "refused CODE MESSAGE"
    peak_mib: int  #: the pulling process's peak memory


def _pull_in_a_child(
    ref: str, cache: Path, *, limit: int = 0, file_size: int = 0, without: str = ""
) -> ChildPull:
    """:func:`pull` of ``ref`` in a Python process of its own, sized by ``limit`` (0: the default), no
    file of which may grow past ``file_size`` bytes (0: unbounded)."""
    out = subprocess.run([sys.executable, "-c", _PULL, ref, str(cache), str(limit), str(file_size), without],
                         capture_output=True, text=True, timeout=180)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 2, out
    return ChildPull(lines[0], int(lines[1]) // 1024)


def _layout_ref(tmp_path: Path, layers: list[tuple[bytes, str, dict | None]], tag: str = "v1",
                artifact_type: str | None = None) -> str:
    c = Crafter(layout=tmp_path / "layout")
    descriptors = [c.blob(data, media_type, notes) for data, media_type, notes in layers]
    return c.tag(c.manifest(descriptors, artifact_type=artifact_type), tag)


SPARSE_FIX = ("ADD", "without -S/--sparse")


# ---- F1: a sparse entry fills the cache before the size limit sees it -------------------------------


@pytest.mark.parametrize("form", ["gnu", "pax-0.1", "pax-1.0", "pax-global"])
def test_a_sparse_disk_entry_is_refused_before_a_byte_of_it_is_written(tmp_path: Path, form: str) -> None:
    """The attack: a containerDisk whose /disk/disk.raw is a sparse tar entry that is all hole, claiming
    512 MiB in a layer of a few hundred bytes. The size limit (16 MiB here) counted the tar stream, and
    the hole never passes through it: the pull wrote 512 MiB of zeros to the cache's tmp/ and only then
    refused the disk. No file of the pull may now grow past twice the limit."""
    layer = _sparse_layer(form)
    assert len(layer) <= 10240  # tarfile pads an archive it writes to 10 KiB; GNU tar does too
    ref = _layout_ref(tmp_path, [(layer, TAR, None)])
    run = _pull_in_a_child(ref, tmp_path / "cache", limit=LIMIT, file_size=2 * LIMIT)
    assert run.verdict.startswith("refused unsupported_format"), run.verdict
    assert "sparse" in run.verdict and "disk/disk.raw" in run.verdict, run.verdict
    assert all(fix in run.verdict for fix in SPARSE_FIX), run.verdict
    assert not any((tmp_path / "cache").rglob("*.part")), "the refused pull left a temporary file"


def test_the_bytes_a_tar_entry_yields_are_bounded_by_the_limit_too(tmp_path: Path) -> None:
    """Defence in depth: with the header refusal taken away (a sparse form tarfile may learn later),
    what the entry yields is still counted against the limit as it is written."""
    ref = _layout_ref(tmp_path, [(_sparse_layer("gnu"), TAR, None)])
    run = _pull_in_a_child(ref, tmp_path / "cache", limit=LIMIT, file_size=2 * LIMIT,
                           without="header-refusal")
    assert run.verdict.startswith("refused disk_too_large"), run.verdict
    assert "/disk/disk.raw" in run.verdict and "16 MiB" in run.verdict, run.verdict


# ---- F2: tarfile reads a sparse entry's map whole before the runtime sees the entry -----------------


def _endless_map_layer(form: str) -> bytes:
    """A zstd tar layer whose first entry's sparse map runs on for ~100 MiB (a few KB compressed)."""
    compressor = zstandard.ZstdCompressor(level=19).compressobj()
    if form == "gnu-extension-blocks":  # 192k extension blocks of 21 regions each
        layer = bytearray(compressor.compress(_gnu_sparse_header("disk/disk.raw", 1 << 20, extended=True)))
        chunk, count = _sparse_extension_block() * 2048, 96
    else:  # pax 1.0: the map is the first lines of the entry's data, its length the first number
        pax = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "disk/disk.raw",
               "GNU.sparse.realsize": str(1 << 20)}
        info = tarfile.TarInfo("disk/GNUSparseFile.0/disk.raw")
        info.pax_headers = pax
        layer = bytearray(compressor.compress(info.tobuf(tarfile.PAX_FORMAT) + b"999999999999\n"))
        chunk, count = b"1000000000000000000\n" * (1 << 16), 128  # 8 million numbers
    for _ in range(count):
        layer += compressor.compress(chunk)
    layer += compressor.flush()
    return bytes(layer)


@pytest.mark.parametrize("form", ["gnu-extension-blocks", "pax-1.0-map"])
def test_a_sparse_map_is_refused_before_tarfile_reads_it(tmp_path: Path, form: str) -> None:
    """The attack: 8 KB of zstd holding a sparse header whose map never ends. tarfile collected the whole
    map into a list before handing the entry over (a type S chain: +400 MiB for 96 MiB of blocks)."""
    layer = _endless_map_layer(form)
    assert len(layer) < 64 * 1024
    ref = _layout_ref(tmp_path, [(layer, TAR_ZSTD, None)])
    run = _pull_in_a_child(ref, tmp_path / "cache")
    assert run.peak_mib < 256, f"the pull peaked at {run.peak_mib} MiB for a {len(layer)}-byte layer"
    assert run.verdict.startswith("refused unsupported_format") and "sparse" in run.verdict, run.verdict


def test_plain_tar_entries_with_pax_headers_still_unpack(tmp_path: Path, oci_qcow2: Path) -> None:
    """The refusal is of the GNU.sparse records only: a disk whose entry carries pax records (a long
    name, a modification time with a fraction, an owner name) is unpacked as before."""
    data = oci_qcow2.read_bytes()
    name = "disk/" + "a-long-name-" * 10 + ".qcow2"
    pax = {"mtime": "1700000000.25", "uname": "builder", "SCHILY.xattr.user.x": "y"}
    ref = _layout_ref(tmp_path, [(_end(_pax_member(name, pax, data)), TAR, None)])
    disk = pull(ref, tmp_path / "cache", arch="x86_64")
    assert disk.format == "qcow2" and disk.digest == "sha256:" + hashlib.sha256(data).hexdigest()


# ---- F4: oras push without :TYPE labels a disk as a plain tar layer ---------------------------------


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(data)


@pytest.mark.parametrize(("title", "encode"), [("disk.qcow2", None), ("disk.qcow2.zst", _zstd),
                                               ("fedora.img", None)])
def test_an_oras_default_push_of_a_disk_pulls_as_that_disk(
    tmp_path: Path, oci_qcow2: Path, title: str, encode: Callable[[bytes], bytes] | None
) -> None:
    """``oras push REG/vm:1 disk.qcow2`` with no ``:TYPE`` stores the file as it is, as an
    application/vnd.oci.image.layer.v1.tar layer titled with its name; the pull read it as a tar and
    refused it as one ("bad checksum"). Now: the disk, byte for byte, as if pushed with its type."""
    data = oci_qcow2.read_bytes()
    ref = _layout_ref(tmp_path, [((encode or bytes)(data), TAR, {TITLE: title})], artifact_type=ORAS_ARTIFACT)
    disk = pull(ref, tmp_path / "cache", arch="x86_64")
    assert disk.format == "qcow2" and disk.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert disk.path.read_bytes() == data
    info = subprocess.run(["qemu-img", "info", "-f", "qcow2", "--output=json", str(disk.path)],
                          capture_output=True, text=True, check=True)
    assert '"virtual-size": 16777216' in info.stdout


def test_an_oras_default_push_gets_every_check_of_a_disk(tmp_path: Path) -> None:
    """Read as a disk, such a layer passes the checks every disk passes: a qcow2 naming a host file as
    its backing file is unsafe, a disk past the limit too large, a raw disk that is a qcow2 in disguise
    unsafe."""
    backing = tmp_path / "backing.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", "/etc/hostname",
                    str(backing)], check=True)
    big = tmp_path / "big.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(big), "64M"], check=True)
    cases = {"disk.qcow2": (backing, "unsafe_disk"), "disk.raw": (backing, "unsafe_disk"),
             "big.qcow2": (big, "disk_too_large")}
    for i, (title, (path, code)) in enumerate(cases.items()):
        ref = _layout_ref(tmp_path / str(i), [(path.read_bytes(), TAR, {TITLE: title})],
                          artifact_type=ORAS_ARTIFACT)
        with pytest.raises(ImageError) as refused:
            pull(ref, tmp_path / "cache", arch="x86_64", limits=Limits(LIMIT, LIMIT))
        assert refused.value.code == code, (title, refused.value)
        assert "layer sha256:" in refused.value.message
    assert not any((tmp_path / "cache").rglob("*.part"))


def test_a_real_tar_layer_titled_like_a_disk_is_still_a_containerdisk(
    tmp_path: Path, oci_qcow2: Path
) -> None:
    """The counterpart: a plain tar layer titled disk.qcow2 whose bytes are a tar is unpacked as one."""
    data = oci_qcow2.read_bytes()
    tar = _tar([("disk/inner.qcow2", data)])
    ref = _layout_ref(tmp_path, [(tar, TAR, {TITLE: "disk.qcow2"})])
    disk = pull(ref, tmp_path / "cache", arch="x86_64")
    assert disk.format == "qcow2" and disk.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    # and a tar of no disk with such a title is a containerDisk without a disk, not a disk of tar bytes
    ref = _layout_ref(tmp_path / "empty", [(_tar([("etc/hostname", b"x\n")]), TAR, {TITLE: "disk.qcow2"})])
    with pytest.raises(ImageError) as refused:
        pull(ref, tmp_path / "cache", arch="x86_64")
    assert refused.value.code == "no_disk", refused.value


# ---- F5: whiteouts in upper layers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_disks(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    d = tmp_path_factory.mktemp("whiteout-disks")
    old, new = make_qcow2(d / "old.qcow2", pattern=0x01), make_qcow2(d / "new.qcow2", pattern=0x02)
    return old.read_bytes(), new.read_bytes()


@pytest.mark.parametrize("whiteout", ["disk/.wh.old.qcow2", "disk/.wh..wh..opq", ".wh.disk",
                                      "./disk/.wh.old.qcow2"])
def test_a_disk_deleted_by_an_upper_layer_is_not_booted(
    tmp_path: Path, two_disks: tuple[bytes, bytes], whiteout: str
) -> None:
    """The attack (or the mistake): a containerDisk whose upper layer deletes the disk of the layer
    below. The image's file system has no disk; the runtime booted the deleted one, also when the lower
    layer was already in the cache from another image."""
    old, _ = two_disks
    lower = _tar([("disk/old.qcow2", old)])
    upper = _tar([(whiteout, b"")])
    cache = tmp_path / "cache"
    alone = pull(_layout_ref(tmp_path / "alone", [(lower, TAR, None)]), cache, arch="x86_64")  # cached now
    assert alone.digest == "sha256:" + hashlib.sha256(old).hexdigest()
    ref = _layout_ref(tmp_path / "deleted", [(lower, TAR, None), (upper, TAR, None)])
    with pytest.raises(ImageError) as refused:
        pull(ref, cache, arch="x86_64")
    assert refused.value.code == "no_disk", refused.value
    assert "whiteout" in refused.value.message and "old.qcow2" in refused.value.message, refused.value


def test_whiteouts_hide_only_what_they_name(tmp_path: Path, two_disks: tuple[bytes, bytes]) -> None:
    """A whiteout of another name hides nothing; a whiteout of one of two lower disks leaves the other
    (and the lower layer alone, from the same cache, still has two); a disk in a layer above the whiteout
    is the image's disk."""
    old, new = two_disks
    digest = {k: "sha256:" + hashlib.sha256(v).hexdigest() for k, v in (("old", old), ("new", new))}
    cache = tmp_path / "cache"
    lower = _tar([("disk/old.qcow2", old)])
    other = _tar([("disk/.wh.other.qcow2", b"")])
    ref = _layout_ref(tmp_path / "other", [(lower, TAR, None), (other, TAR, None)])
    assert pull(ref, cache, arch="x86_64").digest == digest["old"]

    both = _tar([("disk/old.qcow2", old), ("disk/new.qcow2", new)])
    one = _tar([("disk/.wh.old.qcow2", b"")])
    ref = _layout_ref(tmp_path / "one-of-two", [(both, TAR, None), (one, TAR, None)])
    assert pull(ref, cache, arch="x86_64").digest == digest["new"]
    with pytest.raises(ImageError) as refused:
        pull(_layout_ref(tmp_path / "two", [(both, TAR, None)]), cache, arch="x86_64")
    assert refused.value.code == "several_disks", refused.value

    layers = [(lower, TAR, None), (_tar([("disk/.wh..wh..opq", b"")]), TAR, None),
              (_tar([("disk/new.qcow2", new)]), TAR, None)]
    assert pull(_layout_ref(tmp_path / "above", layers), cache, arch="x86_64").digest == digest["new"]
