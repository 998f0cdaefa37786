"""From a top-level manifest or index to the layer that holds the disk.

Shared by registry and layout sources; nothing here does I/O except through a :class:`Source`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from vmsidecar_contract.arch import oci_arch
from vmsidecar_contract.errors import ImageError, PlatformError
from vmsidecar_runtime.image.digest import is_sha256_digest

from .mediatypes import (
    ANNOTATION_DISK_DIGEST,
    ANNOTATION_DISK_SIZE,
    ANNOTATION_DISKTYPE,
    ANNOTATION_TITLE,
    DOCKER_SCHEMA1,
    IMAGE_CONFIG_TYPES,
    INDEX_TYPES,
    JsonTooDeepError,
    LayerKind,
    classify_layer,
    load_document,
)

if TYPE_CHECKING:  # a type only: a file: or layout pull never loads the registry stack (requests, oras)
    from .registry import RawManifest

MAX_INDEX_DEPTH = 3
#: the annotations a pull carries to the runtime (readiness, docs/byo-guest.md); bounded, because
#: they are kept in the cache index and reported by the API
CARRIED_PREFIX = "io.vmsidecar."
MAX_CARRIED = 32
MAX_CARRIED_VALUE = 4096


class Source(Protocol):
    """Where manifests and blobs come from: a registry repository or an OCI layout."""

    where: str

    def top(self) -> RawManifest:
        """The manifest or index the reference names."""
        ...

    def manifest(self, descriptor: dict) -> RawManifest:
        """A manifest named by a descriptor, digest- and size-checked."""
        ...

    def open_blob(self, descriptor: dict) -> AbstractContextManager[Iterator[bytes]]:
        """The blob's bytes as chunks (verified by the caller)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


@dataclass(frozen=True)
class DiskLayer:
    """The layer to unpack, and what we expect to find in it."""

    descriptor: dict
    kind: LayerKind
    title: str | None
    disk_digest: str | None
    disk_size: int | None

    @property
    def digest(self) -> str:
        """The blob digest."""
        return str(self.descriptor["digest"])

    @property
    def size(self) -> int | None:
        """The blob size from the descriptor."""
        size = self.descriptor.get("size")
        return size if isinstance(size, int) else None


@dataclass(frozen=True)
class Resolved:
    """A platform manifest and the disk layer candidates in it (last layer first for tars)."""

    manifest: RawManifest
    doc: dict
    layers: list[DiskLayer]
    from_index: bool
    #: ``io.vmsidecar.*`` annotations of the index, the chosen index entry and the manifest
    #: (later ones win: the manifest is the image's own word)
    annotations: dict[str, str] = field(default_factory=dict)


def is_index(raw: RawManifest, doc: dict) -> bool:
    """Whether a manifest document is an index / manifest list."""
    media_type = doc.get("mediaType") or raw.media_type
    return media_type in INDEX_TYPES or ("manifests" in doc and "layers" not in doc)


def resolve(source: Source, top: RawManifest, arch: str) -> Resolved:
    """Walk from ``top`` through indexes (by platform) to a manifest with a disk layer.

    :raise PlatformError: no index entry for ``arch``; lists what is available.
    :raise ImageError: the manifest has no disk layer, several, or an unsupported one.
    """
    raw, doc, from_index = top, top.json(), False
    annotations = carried_annotations(doc)
    for _ in range(MAX_INDEX_DEPTH):
        if not is_index(raw, doc):
            break
        descriptor = select_platform(doc, arch, source.where)
        raw = source.manifest(descriptor)
        doc, from_index = raw.json(), True
        annotations |= carried_annotations(descriptor) | carried_annotations(doc)
    else:
        raise ImageError(
            f"{source.where} nests indexes more than {MAX_INDEX_DEPTH} deep; push a flat image index",
            code="bad_manifest",
        )
    media_type = doc.get("mediaType") or raw.media_type
    if media_type in DOCKER_SCHEMA1 or doc.get("schemaVersion") == 1:
        raise ImageError(
            f"{source.where} is a Docker schema 1 manifest, which vmsidecar does not read; "
            "push it again with a current tool (skopeo, podman, oras)",
            code="bad_manifest",
        )
    layers = find_disk_layers(doc, f"manifest {raw.digest} of {source.where}")
    return Resolved(manifest=raw, doc=doc, layers=layers, from_index=from_index,
                    annotations=dict(sorted(annotations.items())[:MAX_CARRIED]))


def carried_annotations(obj: dict) -> dict[str, str]:
    """The ``io.vmsidecar.*`` string annotations of a manifest, index or descriptor (bounded)."""
    notes = obj.get("annotations")
    if not isinstance(notes, dict):
        return {}
    found = {k: v for k, v in notes.items() if isinstance(k, str) and k.startswith(CARRIED_PREFIX)
             and isinstance(v, str) and len(v) <= MAX_CARRIED_VALUE}
    return dict(sorted(found.items())[:MAX_CARRIED])


def platform_label(descriptor: dict) -> str:
    """``linux/amd64`` (plus ``disktype=…`` when annotated) for messages."""
    p = descriptor.get("platform") or {}
    label = f"{p.get('os', '?')}/{p.get('architecture', '?')}"
    if p.get("variant"):
        label += f"/{p['variant']}"
    disktype = (descriptor.get("annotations") or {}).get(ANNOTATION_DISKTYPE)
    return f"{label} disktype={disktype}" if disktype else label


def select_platform(index: dict, arch: str, where: str) -> dict:
    """Pick the index entry for ``arch`` (GOARCH or uname spellings), preferring ``disktype: qemu``.

    :raise PlatformError: no entry matches; the message lists the available platforms.
    """
    wanted = oci_arch(arch)
    entries = [d for d in index.get("manifests") or [] if isinstance(d, dict) and d.get("digest")]
    ranked: list[tuple[int, int, dict]] = []
    for position, d in enumerate(entries):
        annotations = d.get("annotations") or {}
        if annotations.get("vnd.docker.reference.type") == "attestation-manifest":
            continue
        platform = d.get("platform")
        disktype = annotations.get(ANNOTATION_DISKTYPE)
        if not platform:
            rank = 3
        else:
            try:
                their = oci_arch(str(platform.get("architecture", "")))
            except (ValueError, KeyError):
                continue
            if their != wanted or platform.get("os", "linux") not in ("linux", ""):
                continue
            rank = 0 if disktype == "qemu" else 1 if disktype is None else 2
        ranked.append((rank, position, d))
    if not ranked:
        available = ", ".join(platform_label(d) for d in entries) or "none"
        raise PlatformError(
            f"{where} has no image for linux/{wanted} (available: {available}); pull with an --arch "
            f"from that list or push a linux/{wanted} image to the same tag"
        )
    return min(ranked, key=lambda t: (t[0], t[1]))[2]


def find_disk_layers(doc: dict, where: str) -> list[DiskLayer]:
    """The disk layer of an artifact, or the tar layers of a containerDisk (last first).

    :raise ImageError: ``no_disk`` when there is none, ``several_disks`` for two disk layers,
        plus :func:`.mediatypes.classify_layer`'s errors.
    """
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise ImageError(f"{where} has no layers list; push a valid OCI image manifest", code="bad_manifest")
    disks: list[DiskLayer] = []
    tars: list[DiskLayer] = []
    for d in layers:
        if not isinstance(d, dict) or not isinstance(d.get("digest"), str):
            raise ImageError(
                f"{where} has a layer without a digest; push the image again", code="bad_manifest"
            )
        kind = classify_layer(d, where)
        if kind is None:
            continue
        if not is_sha256_digest(d["digest"]):
            raise ImageError(
                f"{where} has the layer {d['digest'][:80]!r}, which is not a sha256 digest in lowercase hex, the one "
                "algorithm vmsidecar verifies (what podman, skopeo, oras and docker write); push the image again "
                "with sha256 digests",
                code="bad_manifest",
            )
        size = d.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            # the blob reader holds a layer to its size: without one, a stream that decompresses to
            # nothing (zstd's skippable frames) would be read for as long as it goes on
            raise ImageError(
                f"{where} has the layer {d['digest'][:80]} with a size of {size!r:.40}, where an OCI descriptor "
                "carries its blob's size in bytes; push the image again with an OCI tool",
                code="bad_manifest",
            )
        annotations = d.get("annotations") or {}
        size_text = annotations.get(ANNOTATION_DISK_SIZE)
        layer = DiskLayer(
            descriptor=d,
            kind=kind,
            title=annotations.get(ANNOTATION_TITLE),
            disk_digest=annotations.get(ANNOTATION_DISK_DIGEST),
            disk_size=int(size_text) if isinstance(size_text, str) and size_text.isdigit() else None,
        )
        (disks if kind.kind == "disk" else tars).append(layer)
    if len(disks) > 1:
        names = ", ".join(layer.title or layer.digest for layer in disks)
        raise ImageError(
            f"{where} has {len(disks)} disk layers ({names}) and vmsidecar cannot tell which one to boot; "
            "push an image with exactly one disk layer",
            code="several_disks",
        )
    if disks:
        return disks
    if tars:
        return list(reversed(tars))
    types = ", ".join(sorted({str(d.get("mediaType")) for d in layers})) or "no layers"
    raise ImageError(
        f"{where} has no disk layer ({types}); push the disk as application/vnd.diskimage.qcow2[+zstd] "
        "or as a containerDisk with /disk/<name>.qcow2",
        code="no_disk",
    )


def config_arch_check(source: Source, resolved: Resolved, arch: str) -> int:
    """For a single-arch image manifest (no index), check the config's architecture.

    Returns the config bytes read (0 when there was nothing to check).

    :raise PlatformError: the image is for another architecture.
    """
    config = resolved.doc.get("config") or {}
    if resolved.from_index or config.get("mediaType") not in IMAGE_CONFIG_TYPES:
        return 0
    size = config.get("size")
    if not isinstance(size, int) or size > (1 << 20):
        return 0
    from .unpack import BlobReader

    with source.open_blob(config) as chunks:
        reader = BlobReader(chunks, digest=config.get("digest"), size=size, where=f"config of {source.where}")
        data = reader.read()
        reader.drain()
        reader.verify()
    try:
        their = load_document(data or b"{}").get("architecture")
    except JsonTooDeepError as exc:  # not a sloppy config: a document built to exhaust the parser
        raise ImageError(
            f"the image config of {source.where} is {exc}; push the image again with a plain config",
            code="bad_manifest",
        ) from exc
    except (ValueError, AttributeError):
        return len(data or b"")
    if their:
        try:
            matches = oci_arch(str(their)) == oci_arch(arch)
        except (ValueError, KeyError):
            matches = False
        if not matches:
            raise PlatformError(
                f"{source.where} is a single-arch image for {their}, not {oci_arch(arch)} "
                f"(available: linux/{their}); pull with --arch {their} or push an image for {oci_arch(arch)}"
            )
    return len(data or b"")
