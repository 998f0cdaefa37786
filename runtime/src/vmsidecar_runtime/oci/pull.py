"""Pull a disk from a registry, an OCI layout or a file into the digest-keyed cache."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vmsidecar_contract.arch import host_arch, normalize_arch
from vmsidecar_contract.errors import DigestMismatchError, ImageError, PlatformError
from vmsidecar_runtime.image.checks import verdict
from vmsidecar_runtime.image.limits import DEFAULT_LIMITS, Limits
from vmsidecar_runtime.image.sniff import DiskFormat
from vmsidecar_runtime.image.write import WrittenDisk

from .auth import RegistryConfig, normalize_host
from .cache import CacheEntry, DiskCache, stat_seal
from .mediatypes import DISK_SUFFIXES, TAR_BLOCK, answers_of, settle_layer_kind, title_format
from .reference import Reference, parse_reference
from .resolve import (
    DiskLayer,
    Resolved,
    Source,
    carried_annotations,
    config_arch_check,
    is_index,
    platform_label,
    resolve,
)
from .unpack import CHUNK, BlobReader, Whiteouts, unpack_blob

Progress = Callable[[int, int | None], None]


@dataclass(frozen=True)
class PulledDisk:
    """A disk in the cache, ready to be used as a read-only qcow2 backing file.

    ``path`` is read-only (0444) and decompressed; ``digest`` is the sha256 of its bytes;
    ``manifest_digest`` is the platform manifest holding the disk (``None`` for ``file:``);
    ``bytes_downloaded`` counts the blob bytes read by this call; ``cached`` says the disk was
    already in the cache (then ``bytes_downloaded`` is 0, or the size of a small image config
    that had to be read to check the architecture); ``annotations`` are the image's
    ``io.vmsidecar.*`` annotations (index, index entry, manifest: e.g. its readiness), none for ``file:``.
    """

    path: Path
    format: DiskFormat
    digest: str
    manifest_digest: str | None
    reference: str
    size: int
    bytes_downloaded: int
    cached: bool
    annotations: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-friendly form."""
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def resolve_arch(arch: str | None) -> str:
    """The uname name for ``arch`` (the host's when ``None``).

    :raise PlatformError: for an architecture vmsidecar does not support.
    """
    try:
        return normalize_arch(arch) if arch else host_arch()
    except ValueError as exc:
        raise PlatformError(str(exc)) from None


@contextlib.contextmanager
def reading(
    ref: Reference, *, plain_http: bool | None = None, credentials: tuple[str, str] | None = None,
    config: RegistryConfig | None = None,
) -> Iterator[Source]:
    """The :class:`.resolve.Source` for a registry or layout reference, closed after the block.
    Whatever reading its answers raised besides this project's errors (:data:`.mediatypes.MALFORMED`:
    JSON of the wrong shape, headers that do not parse) leaves as ``RegistryError`` ``bad_answer``
    naming ``ref``. ``config``: the registry configuration to use (else the process's).
    """
    source = _open_source(ref, plain_http=plain_http, credentials=credentials, config=config)
    try:
        with answers_of(str(ref)):
            yield source
    finally:
        source.close()


def _open_source(
    ref: Reference, *, plain_http: bool | None = None, credentials: tuple[str, str] | None = None,
    config: RegistryConfig | None = None,
) -> Source:
    # imported here: a file: pull (a warm start's cache hit) needs neither, and the registry's
    # requests and oras cost more to import than the whole rest of a warm start's pull
    if ref.kind == "layout":
        from .layout import LayoutSource

        return LayoutSource(ref)
    from .registry import RegistryClient, RegistrySource

    return RegistrySource(RegistryClient(ref, plain_http=plain_http, credentials=credentials, config=config))


def pull(
    ref: str | Reference,
    cache_dir: Path,
    *,
    arch: str | None = None,
    plain_http: bool | None = None,
    progress: Progress | None = None,
    credentials: tuple[str, str] | None = None,
    limits: Limits = DEFAULT_LIMITS,
    on_download: Callable[[str], None] | None = None,
    registry_config: RegistryConfig | None = None,
) -> PulledDisk:
    """Resolve ``ref`` for ``arch`` and make its disk available, decompressed and verified, in the cache.

    Registry references cost one small manifest GET when the content is already cached (a
    pinned digest too: the registry must still authorise it); layouts cost none. Safe to call
    from several threads and processes at once.
    A new disk passes the same checks as a flashed one (:mod:`vmsidecar_runtime.image`,
    sized by ``limits``) before it enters the cache. ``on_download(manifest digest)`` is called
    (in this thread) when a registry image's disk is to be downloaded, not found in the cache.
    ``registry_config``: the registry configuration to pull with, else the process's (a lease's pull:
    :func:`.auth.lease_config`).

    :raise BadReferenceError: the reference cannot be parsed.
    :raise RegistryError: the registry is unreachable, refuses, or lacks the repository or tag.
    :raise PlatformError: nothing for ``arch``.
    :raise DigestMismatchError: a blob or the disk is not what its digest says (nothing is kept).
    :raise ImageError: no disk layer, several, unsupported compression/format, unsafe paths or disks
        (backing or data files), corrupt or too large disks (nothing is kept).
    :raise HostError: the cache cannot be written.
    """
    reference = parse_reference(ref)
    wanted = resolve_arch(arch)
    cache = DiskCache(Path(cache_dir))
    cache.clean_stale()
    if reference.kind == "file":
        return _pull_file(reference, cache, progress, limits)
    with reading(reference, plain_http=plain_http, credentials=credentials, config=registry_config) as source:
        return _pull_oci(source, reference, cache, wanted, progress, limits, on_download)


def _cached(entry: CacheEntry, cache: DiskCache, reference: Reference, downloaded: int = 0) -> PulledDisk:
    return PulledDisk(
        path=cache.disk_path(entry.disk, entry.format),
        format=entry.format,
        digest=entry.disk,
        manifest_digest=entry.manifest_digest,
        reference=str(reference),
        size=entry.size,
        bytes_downloaded=downloaded,
        cached=True,
        annotations=dict(entry.annotations or {}),
    )


def _ref_hit(cache: DiskCache, key: str) -> CacheEntry | None:
    """A ``ref:`` entry that knows the image's annotations (older entries are resolved again)."""
    hit = cache.lookup(key)
    return hit if hit is not None and hit.annotations is not None else None


def _pull_oci(
    source: Source, reference: Reference, cache: DiskCache, arch: str, progress: Progress | None, limits: Limits,
    on_download: Callable[[str], None] | None = None,
) -> PulledDisk:
    # A registry is always asked for the manifest, even for a digest the cache holds: the cache is
    # shared by everyone who may pull, and knowing a digest is not being allowed to read the image.
    # The GET (authenticated as the registry asks, bytes checked against the digest) is the proof
    # that this registry serves it to us under this repository; a layout is local, nothing to ask.
    # Every key is the origin's own: a manifest or blob digest another origin delivered proves
    # nothing here (a lease's registry may serve a manifest naming a private image's layer).
    origin = _origin(reference)
    if reference.kind == "layout" and reference.digest and (
            hit := _ref_hit(cache, f"ref:{origin}:{reference.digest}@{arch}")):
        return _cached(hit, cache, reference)
    top = source.top()
    top_key = f"ref:{origin}:{top.digest}@{arch}"
    if hit := _ref_hit(cache, top_key):
        return _cached(hit, cache, reference)
    resolved = resolve(source, top, arch)
    if hit := cache.lookup(f"ref:{origin}:{resolved.manifest.digest}@{arch}"):
        return _cached(_remember(cache, resolved, origin, top_key, arch, hit), cache, reference)
    if on_download is not None and reference.kind == "registry":
        on_download(resolved.manifest.digest)
    downloaded = config_arch_check(source, resolved, arch)
    whiteouts = Whiteouts()  # what the layers read so far (from the top) deleted under /disk
    for layer in resolved.layers:
        # the same bytes declared another way (compression, tar or disk, format) are another disk, and
        # a layer's disk may be deleted by a layer above it
        layer_key = f"layer:{origin}:{layer.digest}:{layer.kind.cache_tag}{whiteouts.cache_tag}"
        where = f"layer {layer.digest} of {source.where}"
        if hit := cache.lookup(layer_key):
            _check_annotations(hit.disk, hit.size, layer, where)  # as a download would: this manifest's word
            return _cached(_remember(cache, resolved, origin, top_key, arch, hit), cache, reference,
                           downloaded)
        with cache.lock(layer_key):
            if hit := cache.lookup(layer_key):
                _check_annotations(hit.disk, hit.size, layer, where)
                return _cached(_remember(cache, resolved, origin, top_key, arch, hit), cache, reference,
                               downloaded)
            try:
                disk, count = _fetch_layer(source, layer, cache, progress, limits, whiteouts)
            except ImageError as exc:
                if exc.code == "no_disk" and layer.kind.kind == "tar":
                    downloaded += getattr(exc, "bytes_read", 0)
                    continue  # a lower layer of a multi-layer containerDisk may hold it
                raise
            downloaded += count
            entry = CacheEntry(disk.digest, disk.format, disk.size, resolved.manifest.digest, arch)
            cache.record([layer_key], entry)  # a layer may be shared: annotations belong to manifests
            entry = _remember(cache, resolved, origin, top_key, arch, entry)
            return PulledDisk(
                path=cache.disk_path(disk.digest, disk.format),
                format=disk.format,
                digest=disk.digest,
                manifest_digest=resolved.manifest.digest,
                reference=str(reference),
                size=disk.size,
                bytes_downloaded=downloaded,
                cached=False,
                annotations=dict(entry.annotations or {}),
            )
    raise _no_disk_error(source, resolved, whiteouts)


def _origin(reference: Reference) -> str:
    """Who delivers the bytes behind a cache key: a registry's repository, or a layout directory."""
    if reference.kind == "layout":
        assert reference.path is not None
        return f"layout:{os.path.realpath(reference.path)}"
    assert reference.registry and reference.repository
    return f"{normalize_host(reference.registry)}/{reference.repository}"


def _remember(cache: DiskCache, resolved: Resolved, origin: str, top_key: str, arch: str,
              found: CacheEntry) -> CacheEntry:
    """Record the disk under the manifest's key (with the manifest's own annotations) and under
    the top object's key (with those of the whole chain: index, its entry, manifest); returns the
    top's entry. The same manifest may be named by indexes that annotate it differently."""
    manifest_key = f"ref:{origin}:{resolved.manifest.digest}@{arch}"
    base = (found.disk, found.format, found.size, resolved.manifest.digest, arch)
    entry = CacheEntry(*base, resolved.annotations)
    if manifest_key != top_key:
        cache.record([manifest_key], CacheEntry(*base, carried_annotations(resolved.doc)))
    cache.record([top_key], entry)
    return entry


def _no_disk_error(source: Source, resolved: Resolved, whiteouts: Whiteouts) -> ImageError:
    deleted = ""
    if whiteouts.hid:
        deleted = (f" (a layer has {', '.join(whiteouts.hid)}, deleted by a whiteout in a layer above it: "
                   f"{', '.join(whiteouts.marks)})")
    return ImageError(
        f"containerDisk {source.where} has no .qcow2, .raw or .img file under /disk in any of its "
        f"{len(resolved.layers)} layer(s){deleted}; build the image with the disk at /disk/<name>.qcow2"
        + (", and no later step deleting it" if deleted else ""),
        code="no_disk",
    )


@dataclass(frozen=True)
class _Fetched:
    digest: str
    format: DiskFormat
    size: int


def _fetch_layer(
    source: Source, layer: DiskLayer, cache: DiskCache, progress: Progress | None, limits: Limits,
    whiteouts: Whiteouts,
) -> tuple[_Fetched, int]:
    where = f"layer {layer.digest} of {source.where}"
    tmp = cache.tmp_path()
    reader: BlobReader | None = None
    try:
        with source.open_blob(layer.descriptor) as chunks:
            reader = BlobReader(chunks, digest=layer.digest, size=layer.size, where=where, progress=progress)
            kind = settle_layer_kind(layer.kind, reader.peek(TAR_BLOCK))
            unpacked = unpack_blob(
                reader,
                tmp,
                kind=kind.kind,
                compression=kind.compression,
                format_hint=kind.format,
                title=layer.title,
                limits=limits,
                whiteouts=whiteouts,
            )
        _check_annotations(unpacked.digest, unpacked.size, layer, where)
        _install(cache, tmp, unpacked, limits)
    except ImageError as exc:
        tmp.unlink(missing_ok=True)
        exc.bytes_read = reader.count if reader else 0  # type: ignore[attr-defined]
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _Fetched(unpacked.digest, unpacked.format, unpacked.size), reader.count


def _install(cache: DiskCache, tmp: Path, unpacked: WrittenDisk, limits: Limits) -> None:
    """Install a disk ``unpack_blob`` wrote and checked, recording that it passed the boot checks:
    the runtime does not run qemu-img on the same bytes again before booting them."""
    path = cache.install(tmp, unpacked.digest, unpacked.format)
    cache.record_checks(path, verdict(unpacked.format, limits))


def _check_annotations(digest: str, size: int, layer: DiskLayer, where: str) -> None:
    if layer.disk_digest and digest != layer.disk_digest:
        raise DigestMismatchError(
            f"the disk in {where} has digest {digest} but the layer's io.vmsidecar.disk.digest names "
            f"{layer.disk_digest}; the image was built wrongly or altered, so push it again"
        )
    if layer.disk_size is not None and size != layer.disk_size:
        raise DigestMismatchError(
            f"the disk in {where} is {size} bytes but the layer's io.vmsidecar.disk.size says "
            f"{layer.disk_size}; push the image again"
        )


def _find_file(reference: Reference) -> Path:
    assert reference.path is not None
    path = reference.path
    if path.is_dir():
        disk_dir = path / "disk" if (path / "disk").is_dir() else path
        found = sorted(
            p for p in disk_dir.iterdir() if p.is_file() and p.name.lower().endswith(tuple(DISK_SUFFIXES))
        )
        if len(found) != 1:
            raise ImageError(
                f"directory {path} holds {len(found)} disk files under {disk_dir.name}/ instead of one; "
                "name the disk file itself with file:PATH",
                code="file_not_found" if not found else "several_disks",
            )
        return found[0]
    if not path.is_file():
        # a relative path is the runtime's working directory's, not the spec file's: say which file that is
        where = "" if path.is_absolute() else f" ({path.absolute()}: relative to the runtime's working directory)"
        raise ImageError(
            f"disk file {path}{where} does not exist; check the path in file:{path}",
            code="file_not_found",
        )
    return path


def _pull_file(reference: Reference, cache: DiskCache, progress: Progress | None, limits: Limits) -> PulledDisk:
    path = _find_file(reference).resolve()
    st = path.stat()
    # the stat seal (inode, size, mtime, ctime): a file rewritten in place can keep its inode, size and
    # mtime (rsync --inplace --times, touch -r), never its ctime
    seal = stat_seal(st)
    key = f"file:{path}:{st.st_dev}:" + ":".join(str(v) for v in seal.values())
    if hit := cache.lookup(key):
        return _cached(hit, cache, reference)
    with cache.lock(key):
        if hit := cache.lookup(key):
            return _cached(hit, cache, reference)
        tmp = cache.tmp_path()
        try:
            with open(path, "rb") as f:
                reader = BlobReader(
                    iter(lambda: f.read(CHUNK), b""),
                    digest=None,
                    size=None,
                    where=f"file:{path}",
                    progress=progress,
                )
                unpacked = unpack_blob(
                    reader,
                    tmp,
                    kind="disk",
                    compression="auto",
                    format_hint=title_format(path.name)[0],
                    resend=f"point file: at the result instead of {path.name}",
                    limits=limits,
                )
            if stat_seal(os.stat(path)) != seal:
                raise ImageError(
                    f"disk file {path} changed while it was read; pull again once nothing writes to it",
                    code="file_changed",
                )
            _install(cache, tmp, unpacked, limits)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    entry = CacheEntry(unpacked.digest, unpacked.format, unpacked.size, None, None)
    cache.record([key], entry)
    return PulledDisk(
        path=cache.disk_path(unpacked.digest, unpacked.format),
        format=unpacked.format,
        digest=unpacked.digest,
        manifest_digest=None,
        reference=str(reference),
        size=unpacked.size,
        bytes_downloaded=reader.count,
        cached=False,
    )


def inspect(
    ref: str | Reference,
    *,
    arch: str | None = None,
    plain_http: bool | None = None,
    credentials: tuple[str, str] | None = None,
) -> dict:
    """What ``ref`` resolves to for ``arch``, without downloading any disk.

    Returns ``reference``, ``digest`` and ``mediaType`` of the top object, its ``platforms``
    (for an index), and the resolved ``manifest`` (digest and document) and ``disk`` layer, or
    ``error`` (``{"error": code, "message": …}``) when nothing matches ``arch``.

    :raise ImageError: as :func:`pull`, for everything but the disk bytes.
    """
    reference = parse_reference(ref)
    wanted = resolve_arch(arch)
    if reference.kind == "file":
        path = _find_file(reference)
        return {"reference": str(reference), "kind": "file", "path": str(path), "size": path.stat().st_size}
    with reading(reference, plain_http=plain_http, credentials=credentials) as source:
        return _inspect(source, reference, wanted)


def _inspect(source: Source, reference: Reference, wanted: str) -> dict:
    top = source.top()
    doc = top.json()
    result: dict = {
        "reference": str(reference),
        "kind": reference.kind,
        "digest": top.digest,
        "mediaType": doc.get("mediaType") or top.media_type,
    }
    if is_index(top, doc):
        result["platforms"] = [
            {"platform": platform_label(d), "digest": d.get("digest")} for d in doc.get("manifests") or []
        ]
    try:
        resolved = resolve(source, top, wanted)
    except PlatformError as exc:  # still show what is there
        result["error"] = exc.to_dict()
        return result
    result["manifest"] = {"digest": resolved.manifest.digest, "document": resolved.doc}
    result["annotations"] = resolved.annotations
    result["disk"] = resolved.layers[0].descriptor
    return result
