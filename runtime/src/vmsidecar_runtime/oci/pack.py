"""Build the blobs and manifests of the two forms we publish, from a disk file.

Both forms are reproducible: the same disk, arch and compression give the same digests (no
timestamps, fixed tar metadata, gzip mtime 0).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import zstandard
from pydantic import ValidationError

from vmsidecar_contract.arch import oci_arch
from vmsidecar_contract.errors import ImageError
from vmsidecar_contract.spec import READINESS_ANNOTATIONS, Readiness
from vmsidecar_runtime.image.checks import check_image
from vmsidecar_runtime.image.digest import sha256_digest
from vmsidecar_runtime.image.limits import Origin
from vmsidecar_runtime.image.sniff import (
    SNIFF_BYTES,
    Compression,
    DiskFormat,
    decide_format,
    sniff_compression,
    sniff_format,
)

from .mediatypes import (
    ANNOTATION_DISK_DIGEST,
    ANNOTATION_DISK_SIZE,
    ANNOTATION_TITLE,
    EMPTY_DIGEST,
    EMPTY_JSON,
    OCI_EMPTY,
    OCI_IMAGE_CONFIG,
    OCI_INDEX,
    OCI_LAYER_TAR_GZIP,
    OCI_MANIFEST,
    artifact_type,
    disk_media_type,
    title_format,
)

CHUNK = 1 << 20
#: KubeVirt's containerDisk convention: owned by qemu (107), read-only
CONTAINERDISK_UID = 107
CONTAINERDISK_MODE = 0o440

Form = Literal["artifact", "containerdisk"]
_SUFFIX = {"zstd": ".zst", "gzip": ".gz"}


@dataclass
class Blob:
    """One blob to publish: from a file (``path``) or in memory (``data``)."""

    media_type: str
    digest: str
    size: int
    path: Path | None = None
    data: bytes | None = None
    annotations: dict[str, str] = field(default_factory=dict)

    def descriptor(self) -> dict:
        """The OCI descriptor for this blob."""
        d: dict = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d


@dataclass
class Packed:
    """A platform manifest and everything it references."""

    manifest: bytes
    manifest_digest: str
    blobs: list[Blob]
    index_entry: dict
    disk_format: DiskFormat
    disk_digest: str
    disk_size: int


class _HashingWriter:
    """Counts and hashes bytes on their way into ``inner``."""

    def __init__(self, inner: BinaryIO | _HashingWriter | gzip.GzipFile) -> None:
        self.inner = inner
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        self.inner.write(data)
        return len(data)

    def flush(self) -> None:
        self.inner.flush()

    @property
    def digest(self) -> str:
        return sha256_digest(self.hash)


class _HashingReader:
    """Counts and hashes bytes read from ``inner``."""

    def __init__(self, inner: BinaryIO) -> None:
        self.inner = inner
        self.hash = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n)
        self.hash.update(data)
        self.size += len(data)
        return data

    @property
    def digest(self) -> str:
        return sha256_digest(self.hash)


def inspect_disk(disk: Path) -> tuple[DiskFormat, int]:
    """Format and size of a disk to publish, checked as a pull will check it.

    :raise ImageError: (``disk_not_found``) missing or not a regular file; (``compressed_input``)
        already compressed; and :func:`vmsidecar_runtime.image.checks.check_image`'s refusals
        (``unsafe_disk`` for a qcow2 with a backing or data file, ``bad_disk``, ``disk_too_large``).
    :raise HostError: when qemu-img is not installed.
    """
    try:
        if not disk.is_file():
            raise FileNotFoundError
        size = disk.stat().st_size
        with open(disk, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        raise ImageError(
            f"disk file {disk} does not exist or is not a regular file; check the path", code="disk_not_found"
        ) from None
    compression = sniff_compression(head)
    if compression:
        raise ImageError(
            f"disk file {disk} is {compression}-compressed; decompress it first, vmsidecar compresses on push",
            code="compressed_input",
        )
    # a file without the qcow2 magic is published as raw (the user named it as a disk), unless it is
    # another format QEMU would probe (vmdk, vhdx …): the pull would refuse that as raw
    origin = Origin(f"disk file {disk}", "push the result")
    fmt = decide_format(head, "qcow2" if sniff_format(head) == "qcow2" else None, origin, guess_raw=True)
    check_image(disk, fmt, origin)
    return fmt, size


def disk_file_name(disk: Path, fmt: DiskFormat) -> str:
    """The name recorded in the image: the file name when it ends in a disk suffix, else ``<stem>.<fmt>``."""
    named, _ = title_format(disk.name)
    if named is not None or disk.name.lower().endswith(".img"):
        return disk.name
    return f"{disk.stem or 'disk'}.{fmt}"


def platform_of(arch: str) -> dict[str, str]:
    """The OCI platform object for a uname or GOARCH architecture name."""
    return {"architecture": oci_arch(arch), "os": "linux"}


def _json(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=False).encode()


def readiness_annotations(
    pattern: str | None = None, console: str | None = None, timeout: float | None = None
) -> dict[str, str]:
    """The ``io.vmsidecar.readiness.*`` annotations for the given fields (None: not set; an empty
    pattern: Ready as soon as the guest runs), checked as a spec's readiness would be.

    :raise ImageError: (``bad_readiness``) a value a spec would refuse.
    """
    fields = {k: v for k, v in {"pattern": pattern, "console": console, "timeout": timeout}.items() if v is not None}
    try:
        Readiness.model_validate(fields)
    except ValidationError as e:
        problems = "; ".join(f"{err['loc'][0]}: {err['msg'].removeprefix('Value error, ')}" for err in e.errors())
        raise ImageError(f"invalid readiness for the image ({problems}); fix the --readiness-* option",
                         code="bad_readiness") from None
    return {READINESS_ANNOTATIONS[k]: f"{v:g}" if isinstance(v, float) else str(v) for k, v in fields.items()}


def _manifest(
    config: Blob, layer: Blob, arch: str, artifact: str | None = None, annotations: dict[str, str] | None = None
) -> tuple[bytes, str, dict[str, Any]]:
    """One-layer image manifest, its digest, and its entry for the platform index (``annotations``
    on both: the manifest is what a pull trusts, the entry is what tools listing an index show)."""
    body: dict[str, Any] = {"schemaVersion": 2, "mediaType": OCI_MANIFEST}
    if artifact:
        body["artifactType"] = artifact
    body |= {"config": config.descriptor(), "layers": [layer.descriptor()]}
    if annotations:
        body["annotations"] = dict(sorted(annotations.items()))
    manifest = _json(body)
    digest = sha256_digest(manifest)
    entry: dict[str, Any] = {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(manifest)}
    if artifact:
        entry["artifactType"] = artifact
    entry["platform"] = platform_of(arch)
    if annotations:
        entry["annotations"] = dict(sorted(annotations.items()))
    return manifest, digest, entry

def pack_artifact(
    disk: Path, workdir: Path, *, arch: str, compression: Compression | None = "zstd",
    annotations: dict[str, str] | None = None,
) -> Packed:
    """The artifact form: empty config, one (compressed) disk layer, ``artifactType`` set.

    The compressed layer is written to ``workdir``; an uncompressed layer is the disk itself.

    :raise ImageError: see :func:`inspect_disk`; ``unsupported_compression`` for an unknown
        ``compression``.
    """
    if compression not in (None, "zstd", "gzip"):
        raise ImageError(
            f"compression {compression!r} is not supported for pushing; use zstd, gzip or none",
            code="unsupported_compression",
        )
    fmt, _ = inspect_disk(disk)
    name = disk_file_name(disk, fmt)
    if compression is None:
        with open(disk, "rb") as src:
            reader = _HashingReader(src)
            while reader.read(CHUNK):
                pass
        layer_path, layer_digest, layer_size = disk, reader.digest, reader.size
        disk_digest, disk_size = reader.digest, reader.size
    else:
        layer_path = workdir / f"layer-{disk.name}{_SUFFIX[compression]}.part"
        disk_digest, disk_size, layer_digest, layer_size = compress_file(disk, layer_path, compression)
        name += _SUFFIX[compression]
    layer = Blob(
        media_type=disk_media_type(fmt, compression),
        digest=layer_digest,
        size=layer_size,
        path=layer_path,
        annotations={
            ANNOTATION_TITLE: name,
            ANNOTATION_DISK_DIGEST: disk_digest,
            ANNOTATION_DISK_SIZE: str(disk_size),
        },
    )
    config = Blob(media_type=OCI_EMPTY, digest=EMPTY_DIGEST, size=len(EMPTY_JSON), data=EMPTY_JSON)
    manifest, digest, entry = _manifest(config, layer, arch, artifact_type(fmt), annotations)
    return Packed(manifest, digest, [config, layer], entry, fmt, disk_digest, disk_size)


def compress_file(disk: Path, out: Path, compression: Compression) -> tuple[str, int, str, int]:
    """Compress ``disk`` into ``out``: the digest and size of the input, then of the output."""
    with open(disk, "rb") as src, open(out, "wb") as f:
        reader = _HashingReader(src)
        blob = _HashingWriter(f)
        writer: zstandard.ZstdCompressionWriter | gzip.GzipFile
        if compression == "zstd":
            cctx = zstandard.ZstdCompressor(level=3, threads=-1, write_checksum=True)
            writer = cctx.stream_writer(blob, closefd=False)  # type: ignore[arg-type]
        else:
            writer = gzip.GzipFile(fileobj=blob, mode="wb", mtime=0, compresslevel=6)
        while chunk := reader.read(CHUNK):
            writer.write(chunk)
        writer.close()
    return reader.digest, reader.size, blob.digest, blob.size


def pack_containerdisk(disk: Path, workdir: Path, *, arch: str, annotations: dict[str, str] | None = None) -> Packed:
    """The KubeVirt containerDisk form: an OCI image with ``/disk/<name>`` in one tar+gzip layer.

    :raise ImageError: see :func:`inspect_disk`.
    """
    fmt, size = inspect_disk(disk)
    name = disk_file_name(disk, fmt)
    layer_path = workdir / f"layer-{disk.name}.tar.gz.part"
    with open(disk, "rb") as src, open(layer_path, "wb") as f:
        blob = _HashingWriter(f)
        gz = gzip.GzipFile(fileobj=blob, mode="wb", mtime=0, compresslevel=6)
        tar_stream = _HashingWriter(gz)
        reader = _HashingReader(src)
        with tarfile.open(fileobj=tar_stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            tar.addfile(_tarinfo("disk", tarfile.DIRTYPE, 0o555, 0))
            tar.addfile(_tarinfo(f"disk/{name}", tarfile.REGTYPE, CONTAINERDISK_MODE, size), reader)
        gz.close()
    if reader.size != size:
        raise ImageError(
            f"disk file {disk} changed size while it was packed; retry when nothing writes to it"
        )
    arch_name = oci_arch(arch)
    layer = Blob(
        media_type=OCI_LAYER_TAR_GZIP,
        digest=blob.digest,
        size=blob.size,
        path=layer_path,
        annotations={ANNOTATION_DISK_DIGEST: reader.digest, ANNOTATION_DISK_SIZE: str(reader.size)},
    )
    config_bytes = _json(
        {
            "architecture": arch_name,
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [tar_stream.digest]},
            "history": [{"created_by": "vmsidecar-oci push --form containerdisk"}],
        }
    )
    config = Blob(
        media_type=OCI_IMAGE_CONFIG, digest=sha256_digest(config_bytes), size=len(config_bytes), data=config_bytes
    )
    manifest, digest, entry = _manifest(config, layer, arch, None, annotations)
    return Packed(manifest, digest, [config, layer], entry, fmt, reader.digest, reader.size)


def _tarinfo(name: str, kind: bytes, mode: int, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.uid = info.gid = CONTAINERDISK_UID
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def pack(
    disk: Path, workdir: Path, *, form: Form, arch: str, compression: Compression | None = "zstd",
    annotations: dict[str, str] | None = None,
) -> Packed:
    """Dispatch on ``form``; ``annotations`` go on the manifest and its index entry.

    :raise ImageError: an unknown form, or the packers' errors.
    """
    if form == "artifact":
        return pack_artifact(disk, workdir, arch=arch, compression=compression, annotations=annotations)
    if form == "containerdisk":
        return pack_containerdisk(disk, workdir, arch=arch, annotations=annotations)
    raise ImageError(f"unknown image form {form!r}; use artifact or containerdisk", code="unknown_form")


def merged_index(existing: dict | None, entry: dict) -> bytes:
    """An OCI index holding ``entry`` plus the entries of ``existing`` for other platforms."""
    manifests: list[dict] = []
    replaced = False
    key = _platform_key(entry)
    for d in (existing or {}).get("manifests") or []:
        if not isinstance(d, dict):
            continue
        if _platform_key(d) == key:
            if not replaced:
                manifests.append(entry)
                replaced = True
            continue
        manifests.append(d)
    if not replaced:
        manifests.append(entry)
    return _json({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests})


def _platform_key(d: dict) -> tuple[str, str] | None:
    p = d.get("platform") or {}
    if not p:
        return None
    try:
        arch = oci_arch(str(p.get("architecture", "")))
    except (ValueError, KeyError):
        arch = str(p.get("architecture"))
    return (str(p.get("os", "linux")), arch)
