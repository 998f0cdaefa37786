"""``vmsidecar-oci snapshot push``: publish the memory snapshot of a spec from a local cache.

The snapshot is the one a runtime with this spec captured into the cache (same key: same image,
QEMU, machine, CPU model, accelerator, spec and readiness). It is checked against its seal before
anything is uploaded; its files go up as the layers of an OCI 1.1 artifact whose ``subject`` is
the disk image's manifest (:mod:`.snapshot_artifact`). Blobs go through oras-py
(:meth:`.registry.RegistryClient.push_blob_file`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmsidecar_contract.errors import BadReferenceError, ImageError
from vmsidecar_contract.spec import VmSpec

from ..accel import choose_accel
from ..disk import DiskImage
from ..image.digest import sha256_digest
from ..snapshot_identity import PREFIX, identify
from ..snapshots import SnapshotStore
from .cache import hash_file
from .mediatypes import (
    ANNOTATION_TITLE,
    EMPTY_DIGEST,
    EMPTY_JSON,
    OCI_EMPTY,
    OCI_INDEX,
    OCI_MANIFEST,
    SNAPSHOT_ARTIFACT_TYPE,
    SNAPSHOT_FILE,
    SNAPSHOT_FILE_ZSTD,
    answers_of,
)
from .pack import compress_file
from .pull import pull, reading
from .push import TAG_FIX, index_doc
from .reference import parse_reference
from .registry import RegistryClient
from .snapshot_artifact import COMPRESS_FROM, META_FILE, referrers_tag

#: how long a push waits for a capture of its snapshot under way in a runtime on the same cache (a
#: cold boot that is to capture holds its staging from its start: a Debian boot under TCG is ~30 s)
CAPTURE_WAIT_S = 300.0


@dataclass(frozen=True)
class PushedSnapshot:
    """What was published: the artifact, the image manifest it refers to, and the key."""

    reference: str
    digest: str
    subject: str
    key: str
    #: bytes uploaded (compressed) and bytes of the cache entry
    pushed_bytes: int
    entry_bytes: int
    #: whether the referrers tag schema index was written (the registry has no referrers API)
    tag_schema: bool


def push_snapshot(ref: str, cache: Path, spec: VmSpec, *, plain_http: bool | None = None,
                  waiting: Callable[[], None] | None = None) -> PushedSnapshot:
    """Publish the snapshot of ``spec`` in ``cache`` to ``ref`` (``REGISTRY/REPO[:TAG]``); a capture
    of it under way in a runtime on ``cache`` is waited for (``waiting`` is called then).

    :raise BadReferenceError: ``ref`` is not a registry repository (or pins a digest).
    :raise ImageError: the spec has no OCI image, the cache has no (intact) snapshot for it.
    :raise RegistryError: the registry is unreachable or refuses the push.
    """
    reference = parse_reference(ref)
    if reference.kind != "registry" or reference.digest:
        raise BadReferenceError(f"cannot push a snapshot to {ref!r}; push to REGISTRY/REPO or REGISTRY/REPO:TAG")
    if not spec.image:
        raise ImageError("the spec has no image; a snapshot artifact refers to the image's manifest, so set image",
                         code="no_image")
    pulled = pull(spec.image, cache, arch=spec.arch)  # cached: one manifest GET, which also proves access
    if pulled.manifest_digest is None:
        raise ImageError(
            f"the spec's image {spec.image} is a file, with no OCI manifest for a snapshot artifact to refer to; "
            "push the disk to a registry (vmsidecar-oci push) and use that reference as the spec's image",
            code="not_registry_image")
    base = DiskImage(pulled.path, pulled.format, pulled.digest, spec.image, pulled.annotations, pulled.manifest_digest)
    identity = identify(spec, base, choose_accel(spec.accel, spec.arch).accel)
    store = SnapshotStore(cache)
    snap = store.wait_for(identity.key, CAPTURE_WAIT_S, waiting)
    if snap is None:
        raise ImageError(
            f"{cache} holds no snapshot of this spec (key {identity.key}); run the runtime with this spec and "
            "this cache until the guest is Ready (it captures one then), then push again", code="no_snapshot")
    broken = store.verify(snap, base)
    meta = snap.meta()
    if broken is not None or meta is None:
        raise ImageError(f"the snapshot {snap.path} fails its seal check ({broken}); delete it and capture it again",
                         code="bad_snapshot")
    subject = _subject(spec.image, pulled.manifest_digest)
    client = RegistryClient(reference, plain_http=plain_http)
    try:
        client.get_manifest_or_none(referrers_tag(subject["digest"]))  # fail fast before compressing
        with tempfile.TemporaryDirectory(prefix="vmsidecar-snapshot-push-") as tmp:
            layers, pushed = _upload_files(client, snap.path, [*sorted(meta.files), META_FILE], Path(tmp))
            client.push_blob_bytes(EMPTY_JSON, OCI_EMPTY, Path(tmp))
        manifest = json.dumps({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": SNAPSHOT_ARTIFACT_TYPE,
            "config": {"mediaType": OCI_EMPTY, "digest": EMPTY_DIGEST, "size": len(EMPTY_JSON)},
            "layers": layers,
            "subject": subject,
            "annotations": identity.annotations(),
        }, separators=(",", ":")).encode()
        response = client.put_manifest_response(sha256_digest(manifest), manifest, OCI_MANIFEST)
        digest = sha256_digest(manifest)
        if reference.tag:
            client.put_manifest(reference.tag, manifest, OCI_MANIFEST)
        # OCI 1.1: a registry that indexed the subject itself says so; otherwise the client keeps the
        # referrers tag schema's index up to date (distribution 2.8 has no referrers API)
        tag_schema = "OCI-Subject" not in response.headers
        if tag_schema:
            entry = {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(manifest),
                     "artifactType": SNAPSHOT_ARTIFACT_TYPE, "annotations": identity.annotations()}
            _add_referrer(client, subject["digest"], entry)
    finally:
        client.close()
    return PushedSnapshot(f"{reference.name}@{digest}", digest, subject["digest"], identity.key, pushed,
                          snap.size, tag_schema)


def _subject(image: str, manifest_digest: str) -> dict[str, Any]:
    """The descriptor of the image's manifest (digest, size, media type as served)."""
    with reading(parse_reference(image)) as source:
        raw = source.manifest({"digest": manifest_digest})
        media_type = raw.json().get("mediaType") or raw.media_type or OCI_MANIFEST
    return {"mediaType": media_type, "digest": raw.digest, "size": len(raw.data)}


def _upload_files(client: RegistryClient, entry: Path, names: list[str], tmp: Path) -> tuple[list[dict], int]:
    """Upload each file (compressed from :data:`COMPRESS_FROM` bytes); their layer descriptors."""
    layers, pushed = [], 0
    for name in names:
        path = entry / name
        if name != META_FILE and path.stat().st_size >= COMPRESS_FROM:
            blob = tmp / f"{name}.zst"
            _, _, digest, size = compress_file(path, blob, "zstd")
            media_type = SNAPSHOT_FILE_ZSTD
        else:
            blob, media_type = path, SNAPSHOT_FILE
            digest, size = hash_file(path), path.stat().st_size
        client.push_blob_file(blob, digest, size, media_type)
        if blob != path:
            blob.unlink()  # the next file's compressed copy need not sit beside this one
        layers.append({"mediaType": media_type, "digest": digest, "size": size,
                       "annotations": {ANNOTATION_TITLE: name}})
        pushed += size
    return layers, pushed


def _add_referrer(client: RegistryClient, subject: str, entry: dict) -> None:
    """Write the referrers tag schema's index of ``subject`` with ``entry`` (its other entries kept,
    but those it supersedes: itself, and a snapshot of the same key pushed before, so that pushing
    each capture again does not grow the index for good)."""
    tag = referrers_tag(subject)
    existing = client.get_manifest_or_none(tag)
    with answers_of(f"{client.ref.name}:{tag}", TAG_FIX):
        doc = index_doc(existing) or {}
        manifests = [d for d in doc.get("manifests") or []
                     if isinstance(d, dict) and d.get("digest") != entry["digest"] and not _same_key(d, entry)]
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [*manifests, entry]}
    client.put_manifest(tag, json.dumps(index, separators=(",", ":")).encode(), OCI_INDEX)


def _same_key(listed: dict, entry: dict) -> bool:
    """Whether ``listed`` is a snapshot artifact of ``entry``'s key."""
    key = PREFIX + "key"
    mine, theirs = entry.get("annotations", {}).get(key), listed.get("annotations")
    return (mine is not None and listed.get("artifactType") == entry.get("artifactType") == SNAPSHOT_ARTIFACT_TYPE
            and isinstance(theirs, dict) and theirs.get(key) == mine)
