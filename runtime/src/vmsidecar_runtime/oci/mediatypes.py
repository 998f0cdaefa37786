"""Media types and the classification of manifest layers.

Magic numbers and sniffing are :mod:`vmsidecar_runtime.image.sniff`, the disk checks
:mod:`vmsidecar_runtime.image.checks`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal

from vmsidecar_contract.errors import ImageError, RegistryError
from vmsidecar_runtime.image.sniff import Compression, DiskFormat

from .reference import has_control_character

log = logging.getLogger(__name__)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_SCHEMA1 = (
    "application/vnd.docker.distribution.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v1+prettyjws",
)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_MANIFEST_LIST)
ACCEPT = (OCI_INDEX, DOCKER_MANIFEST_LIST, OCI_MANIFEST, DOCKER_MANIFEST)

OCI_EMPTY = "application/vnd.oci.empty.v1+json"
EMPTY_JSON = b"{}"
EMPTY_DIGEST = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
OCI_IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_IMAGE_CONFIG = "application/vnd.docker.container.image.v1+json"
IMAGE_CONFIG_TYPES = (OCI_IMAGE_CONFIG, DOCKER_IMAGE_CONFIG)

OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"

DISKIMAGE_PREFIX = "application/vnd.diskimage."

#: a memory snapshot published by ``vmsidecar-oci snapshot push`` (OCI 1.1 artifact; docs/oci.md)
SNAPSHOT_ARTIFACT_TYPE = "application/vnd.vmsidecar.snapshot.v1"
#: one file of a snapshot's cache entry, as it is / zstd-compressed (the title names the file)
SNAPSHOT_FILE = "application/vnd.vmsidecar.snapshot.file.v1"
SNAPSHOT_FILE_ZSTD = "application/vnd.vmsidecar.snapshot.file.v1+zstd"

ANNOTATION_TITLE = "org.opencontainers.image.title"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
ANNOTATION_DISK_DIGEST = "io.vmsidecar.disk.digest"
ANNOTATION_DISK_SIZE = "io.vmsidecar.disk.size"
ANNOTATION_DISKTYPE = "disktype"

#: file name suffix -> compression, for titles and file: paths
COMPRESSION_SUFFIX: dict[str, Compression] = {".zst": "zstd", ".zstd": "zstd", ".gz": "gzip", ".xz": "xz"}
DISK_SUFFIXES: dict[str, DiskFormat | None] = {".qcow2": "qcow2", ".raw": "raw", ".img": None}

#: layer media type -> compression, for containerDisk (tar) layers
TAR_LAYER_TYPES: dict[str, Compression | None] = {
    OCI_LAYER_TAR: None,
    OCI_LAYER_TAR_GZIP: "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": None,
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar.zstd": "zstd",
}
#: generic blob types that carry a disk when the title says so (podman-machine-os uses zstd)
GENERIC_BLOB_TYPES: dict[str, Compression | Literal["auto"] | None] = {
    "application/zstd": "zstd",
    "application/gzip": "gzip",
    "application/x-gzip": "gzip",
    "application/x-xz": "xz",
    "application/octet-stream": "auto",
}

_DISKIMAGE_RE = re.compile(r"^application/vnd\.diskimage\.([a-z0-9.-]+)(?:\+([a-z0-9.-]+))?$")
_COMPRESSION_NAMES: dict[str, Compression] = {"zstd": "zstd", "gzip": "gzip", "xz": "xz"}
_TAR_COMPRESSION_RE = re.compile(
    r"^application/vnd\.(?:oci\.image\.layer\.v1\.tar|docker\.image\.rootfs\.diff\.tar)[+.]([a-z0-9]+)$"
)


#: the deepest nesting of a manifest, index, image config or index.json (real ones are 4-6 deep);
#: Python's parser recurses and raises RecursionError at ~1000, which would escape as a 500
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENS = frozenset(b"[{")


#: what reading a hostile registry's or layout's answers may raise besides this project's errors: JSON
#: of the wrong shape (a string where an object goes: AttributeError, TypeError, KeyError), numbers,
#: URLs and headers that do not parse (ValueError), nesting past the parser (RecursionError)
MALFORMED = (ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError, struct.error)


#: the fix :func:`malformed_answer` names for what a pull read
PULL_FIX = "push the image again, or use another registry"


def malformed_answer(where: str, error: BaseException, fix: str = PULL_FIX) -> RegistryError:
    """The refusal of what ``where``'s registry (or layout) answered, when it raised ``error`` (one of
    :data:`MALFORMED`) instead of one of this project's errors."""
    log.warning("the answer for %s is malformed", where, exc_info=error)
    return RegistryError(f"{where}: the registry's answer is malformed ({type(error).__name__}: {error}); "
                         f"it is broken or hostile: {fix}", code="bad_answer")


@contextlib.contextmanager
def answers_of(where: str, fix: str = PULL_FIX) -> Iterator[None]:
    """The block reads ``where``'s answers: what it raises of :data:`MALFORMED` leaves as
    :func:`malformed_answer`."""
    try:
        yield
    except MALFORMED as e:
        raise malformed_answer(where, e, fix) from None


class JsonTooDeepError(ValueError):
    """A document nested deeper than :data:`MAX_JSON_DEPTH` (a ``ValueError``, like invalid JSON)."""


def load_document(data: bytes | str) -> Any:
    """``json.loads`` for documents a registry, a layout or an image author wrote.

    The nesting is measured first, without recursion (strings removed, then brackets counted),
    so ``[[[…]]]`` 100000 deep is refused in milliseconds instead of exhausting the parser's stack.
    The parser is given the text the guard measured: bytes are UTF-8 (OCI's JSON is), never the
    UTF-16 or UTF-32 that ``json.loads`` detects in bytes, where a ``"`` of the guard's is half of
    another character and the brackets it then skips are real.

    :raise JsonTooDeepError: nested more than :data:`MAX_JSON_DEPTH` levels.
    :raise ValueError: not UTF-8 JSON (``UnicodeDecodeError``, ``json.JSONDecodeError``).
    """
    text = data if isinstance(data, str) else data.decode("utf-8-sig")  # a BOM, as json.loads allows
    brackets = _JSON_STRING.sub(b"", text.encode()).translate(None, _NOT_BRACKETS)
    depth = max(accumulate(1 if b in _OPENS else -1 for b in brackets), default=0)
    if depth > MAX_JSON_DEPTH:
        raise JsonTooDeepError(f"nested more than {MAX_JSON_DEPTH} levels deep")
    return json.loads(text)


def disk_media_type(fmt: DiskFormat, compression: Compression | None) -> str:
    """``application/vnd.diskimage.qcow2+zstd`` and friends."""
    return f"{DISKIMAGE_PREFIX}{fmt}" + (f"+{compression}" if compression else "")


def artifact_type(fmt: DiskFormat) -> str:
    """The manifest ``artifactType`` for a disk format."""
    return f"{DISKIMAGE_PREFIX}{fmt}"


@dataclass(frozen=True)
class LayerKind:
    """What a layer descriptor holds, from its media type and title.

    ``kind`` is ``disk`` (the blob is the disk, maybe compressed) or ``tar`` (a containerDisk
    layer); ``compression`` is ``auto`` when it must be sniffed from the bytes. ``disk_title``: a
    plain tar layer titled like a disk file, which may be that disk (:func:`settle_layer_kind`).
    """

    kind: Literal["disk", "tar"]
    compression: Compression | Literal["auto"] | None
    format: DiskFormat | None
    disk_title: str | None = None

    @property
    def cache_tag(self) -> str:
        """How the layer is read, for its cache key: the same bytes read another way are another disk."""
        tag = f"{self.kind}:{self.compression or 'none'}:{self.format or 'auto'}"
        return tag + ":or-titled-disk" if self.disk_title else tag


#: where a tar header holds its magic (``ustar`` in POSIX and GNU tars), within its first block
TAR_MAGIC_OFFSET, TAR_BLOCK = 257, 512


def settle_layer_kind(kind: LayerKind, head: bytes) -> LayerKind:
    """The kind of a layer once its first bytes are known (:data:`TAR_BLOCK` of them, or the whole
    blob when shorter).

    ``oras push REG/vm:1 disk.qcow2`` without ``:TYPE`` stores the file as it is, as a plain
    ``application/vnd.oci.image.layer.v1.tar`` layer titled with its name (oras's documented
    default). Such a layer (``disk_title``) whose bytes are not a tar is the disk its title names,
    read like any disk layer: its compression from the title's suffix, else sniffed; its format
    from the title, checked against the bytes.
    """
    if kind.disk_title is None or head[TAR_MAGIC_OFFSET:TAR_MAGIC_OFFSET + 5] == b"ustar":
        return kind
    fmt, compression = title_format(kind.disk_title)
    return LayerKind("disk", compression or "auto", fmt)


def classify_layer(descriptor: dict, where: str) -> LayerKind | None:
    """Classify one layer descriptor; ``None`` for layers that are not a disk (SBOMs, empty …).

    :raise ImageError: (code ``unsupported_compression``/``unsupported_format``) for a disk layer
        compressed or formatted in a way vmsidecar cannot read; (code ``unsafe_path``) for a
        title that is not a plain file name.
    """
    media_type = str(descriptor.get("mediaType", ""))
    title = (descriptor.get("annotations") or {}).get(ANNOTATION_TITLE)
    match = _DISKIMAGE_RE.match(media_type)
    if match:
        fmt_name, suffix = match.groups()
        if fmt_name not in ("qcow2", "raw"):
            raise ImageError(
                f"{where} has a {fmt_name} disk layer ({media_type}), which vmsidecar cannot boot; "
                "convert it with qemu-img convert -O qcow2 and push it again",
                code="unsupported_format",
            )
        if title is not None:
            check_title(title, where)
        return LayerKind("disk", _compression(suffix, media_type, where), fmt_name)  # type: ignore[arg-type]
    # oras push's default type for a file: a plain tar layer titled with a disk's name may be that disk
    titled_disk = isinstance(title, str) and _plain_name(title) and _has_disk_suffix(title)
    if media_type == OCI_LAYER_TAR and titled_disk:
        return LayerKind("tar", None, None, disk_title=title)
    if media_type in TAR_LAYER_TYPES:
        return LayerKind("tar", TAR_LAYER_TYPES[media_type], None)
    tar_match = _TAR_COMPRESSION_RE.match(media_type)
    if tar_match:
        _compression(tar_match.group(1), media_type, where)
    if media_type in GENERIC_BLOB_TYPES and title is not None:
        check_title(title, where)
        fmt, title_compression = title_format(title)
        if fmt is not None or _has_disk_suffix(title):
            compression = GENERIC_BLOB_TYPES[media_type]
            if compression == "auto":
                compression = title_compression or "auto"
            return LayerKind("disk", compression, fmt)
    return None


def _compression(suffix: str | None, media_type: str, where: str) -> Compression | None:
    if suffix is None:
        return None
    try:
        return _COMPRESSION_NAMES[suffix]
    except KeyError:
        raise ImageError(
            f"{where} has a layer compressed with {suffix} ({media_type}), which vmsidecar cannot "
            "decompress; push it again compressed with zstd or gzip (or uncompressed)",
            code="unsupported_compression",
        ) from None


def _has_disk_suffix(name: str) -> bool:
    stem = _strip_compression(name.lower())[0]
    return any(stem.endswith(s) for s in DISK_SUFFIXES)


def _strip_compression(name: str) -> tuple[str, Compression | None]:
    for suffix, compression in COMPRESSION_SUFFIX.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], compression
    return name, None


def title_format(name: str) -> tuple[DiskFormat | None, Compression | None]:
    """Disk format and compression implied by a file name (``x.qcow2.zst`` → qcow2, zstd)."""
    stem, compression = _strip_compression(name.lower())
    for suffix, fmt in DISK_SUFFIXES.items():
        if stem.endswith(suffix):
            return fmt, compression
    return None, compression


#: the longest file name (bytes) Linux file systems take: a layer title is one
NAME_MAX = 255


def check_title(title: str, where: str) -> None:
    """Accept only a plain file name as a layer title.

    :raise ImageError: (code ``unsafe_path``) for ``..``, absolute paths or separators.
    """
    if not _plain_name(title):
        raise ImageError(
            f"{where} has a disk layer titled {title!r}, which is not a plain file name and could "
            "escape the cache; push it again with a title like disk.qcow2",
            code="unsafe_path",
        )


def _plain_name(title: str) -> bool:
    """Whether a title is a plain file name: not empty, no separator, control character (a newline or
    an escape would reach messages and log lines) or leading dot, and one a file system takes (at
    most NAME_MAX, 255 bytes: a longer one failed as the host's fault, "File name too long")."""
    return 0 < len(title.encode(errors="surrogatepass")) <= NAME_MAX and not (
        "/" in title or "\\" in title or title.startswith(".") or has_control_character(title))
