"""Push a disk to a registry as an artifact or a containerDisk, under a per-arch image index."""

from __future__ import annotations

import tempfile
from pathlib import Path

from vmsidecar_contract.errors import BadReferenceError
from vmsidecar_runtime.image.sniff import Compression

from .mediatypes import OCI_INDEX, OCI_MANIFEST, answers_of, load_document
from .pack import Form, inspect_disk, merged_index, pack
from .pull import resolve_arch
from .reference import parse_reference
from .registry import RawManifest, RegistryClient
from .resolve import is_index


def push(
    disk: Path,
    ref: str,
    *,
    form: Form = "artifact",
    arch: str = "x86_64",
    plain_http: bool | None = None,
    compression: Compression | None = "zstd",
    credentials: tuple[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> str:
    """Push ``disk`` to ``ref`` (``REGISTRY/REPO:TAG``) and return the platform manifest digest.

    The tag then names an OCI image index; an index already under the tag keeps its entries for
    other architectures (the entry for ``arch`` is replaced). Blobs the registry already has
    are not uploaded again. ``annotations`` (e.g. :func:`.pack.readiness_annotations`) go on the
    manifest and its index entry.

    :raise BadReferenceError: ``ref`` is not a registry tag reference.
    :raise RegistryError: the registry is unreachable or refuses the push.
    :raise ImageError: the disk cannot be packed (missing, compressed, unsafe qcow2).
    :raise PlatformError: unsupported ``arch``.
    """
    reference = parse_reference(ref)
    if reference.kind != "registry":
        raise BadReferenceError(
            f"cannot push to {ref!r}, which is not a registry reference; push to REGISTRY/REPO:TAG, "
            "or write a layout with vmsidecar-oci layout"
        )
    if reference.digest:
        raise BadReferenceError(
            f"cannot push to {ref!r}, which pins a digest; push to REGISTRY/REPO:TAG without @sha256:…"
        )
    arch = resolve_arch(arch)
    tag = reference.tag or "latest"
    # the disk before the network: what is wrong with it is said at once, not after the registry's
    # retries (pack checks it again: a qemu-img call, against the minutes a push takes)
    inspect_disk(Path(disk))
    client = RegistryClient(reference, plain_http=plain_http, credentials=credentials)
    try:
        return _push(client, Path(disk), tag, form=form, arch=arch, compression=compression,
                     annotations=annotations)
    finally:
        client.close()


def _push(
    client: RegistryClient, disk: Path, tag: str, *, form: Form, arch: str, compression: Compression | None,
    annotations: dict[str, str] | None = None,
) -> str:
    client.get_manifest_or_none(tag)  # fail fast (unreachable, unauthorized) before packing
    with tempfile.TemporaryDirectory(prefix="vmsidecar-push-") as tmp:
        packed = pack(disk, Path(tmp), form=form, arch=arch, compression=compression, annotations=annotations)
        for blob in packed.blobs:
            if blob.data is not None:
                client.push_blob_bytes(blob.data, blob.media_type, Path(tmp))
            else:
                assert blob.path is not None
                client.push_blob_file(blob.path, blob.digest, blob.size, blob.media_type)
    client.put_manifest(packed.manifest_digest, packed.manifest, OCI_MANIFEST)
    existing = client.get_manifest_or_none(tag)
    with answers_of(f"{client.ref.name}:{tag}", TAG_FIX):
        index = merged_index(index_doc(existing), packed.index_entry)
    client.put_manifest(tag, index, OCI_INDEX)
    return packed.manifest_digest


#: the fix for a tag whose index a push cannot read, to merge its entry into
TAG_FIX = "delete the tag in the registry, or push to another tag"


def index_doc(raw: RawManifest | None) -> dict | None:
    """The index ``raw`` is, to be merged into (``None``: no tag, or a manifest one may replace).

    :raise ValueError: not UTF-8 JSON, or nested too deep.
    :raise TypeError: JSON that is no object.
    """
    if raw is None:
        return None
    doc = load_document(raw.data)
    if not isinstance(doc, dict):
        raise TypeError(f"a JSON {type(doc).__name__} where a manifest or index goes")
    return doc if is_index(raw, doc) else None


def push_artifact(
    disk: Path,
    ref: str,
    *,
    arch: str = "x86_64",
    plain_http: bool | None = None,
    compression: Compression | None = "zstd",
    credentials: tuple[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> str:
    """Push ``disk`` as a disk artifact (one ``application/vnd.diskimage.*`` layer); see :func:`push`.

    :raise BadReferenceError: ``ref`` is not a registry tag reference.
    :raise RegistryError: the registry is unreachable or refuses the push.
    :raise ImageError: the disk cannot be packed.
    """
    return push(
        disk,
        ref,
        form="artifact",
        arch=arch,
        plain_http=plain_http,
        compression=compression,
        credentials=credentials,
        annotations=annotations,
    )


def push_containerdisk(
    disk: Path,
    ref: str,
    *,
    arch: str = "x86_64",
    plain_http: bool | None = None,
    credentials: tuple[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> str:
    """Push ``disk`` as a KubeVirt containerDisk (``/disk/<name>`` in a tar+gzip layer); see :func:`push`.

    :raise BadReferenceError: ``ref`` is not a registry tag reference.
    :raise RegistryError: the registry is unreachable or refuses the push.
    :raise ImageError: the disk cannot be packed.
    """
    return push(disk, ref, form="containerdisk", arch=arch, plain_http=plain_http, credentials=credentials,
                annotations=annotations)
