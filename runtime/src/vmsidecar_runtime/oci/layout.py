"""OCI image layout directories: read them as a :class:`.resolve.Source`, and write them.

oras-py can only fill a layout from a registry; writing one from local files needs nothing
but ``oci-layout``, ``index.json`` and ``blobs/sha256/<hex>``, so it is done here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vmsidecar_contract.errors import DigestMismatchError, HostError, ImageError
from vmsidecar_runtime.image.digest import is_sha256_digest, sha256_digest
from vmsidecar_runtime.image.sniff import Compression

from .mediatypes import ANNOTATION_REF_NAME, INDEX_TYPES, OCI_INDEX, load_document
from .pack import Form, Packed, merged_index, pack
from .reference import Reference
from .registry import RawManifest

LAYOUT_VERSION = b'{"imageLayoutVersion":"1.0.0"}'
MAX_MANIFEST = 4 << 20
CHUNK = 1 << 20


class LayoutSource:
    """Read an ``oci-layout:DIR[:TAG|@DIGEST]`` reference."""

    def __init__(self, ref: Reference) -> None:
        assert ref.kind == "layout" and ref.path is not None
        self.ref = ref
        self.root = ref.path
        self.where = str(ref)
        if not (self.root / "oci-layout").is_file() or not (self.root / "index.json").is_file():
            raise ImageError(
                f"{self.root} is not an OCI image layout (no oci-layout or index.json file); check the "
                "directory, or write one with vmsidecar-oci layout",
                code="layout_not_found",
            )

    def _index(self) -> dict:
        try:
            doc = load_document((self.root / "index.json").read_bytes())
        except (OSError, ValueError) as exc:
            raise ImageError(
                f"{self.root}/index.json cannot be read as JSON ({exc}); write the layout again",
                code="bad_manifest",
            ) from exc
        return doc if isinstance(doc, dict) else {}

    def top(self) -> RawManifest:
        """The manifest or index the reference's tag (or digest) names in ``index.json``.

        :raise ImageError: (``tag_not_found``) no such tag; lists the tags that exist.
        """
        entries = [d for d in self._index().get("manifests") or [] if isinstance(d, dict)]
        if self.ref.digest:
            chosen = [d for d in entries if d.get("digest") == self.ref.digest]
            if not chosen:  # a digest may name any blob in the layout, e.g. a platform manifest
                chosen = [{"digest": self.ref.digest, "mediaType": ""}]
        else:
            tag = self.ref.tag
            if tag is None and len(entries) == 1:
                chosen = entries
            else:
                chosen = [d for d in entries if _ref_name(d) == (tag or "latest")]
        if not chosen:
            tags = sorted({name for d in entries if (name := _ref_name(d))})
            raise ImageError(
                f"tag {self.ref.tag or 'latest'} not found in OCI layout {self.root} "
                f"(tags there: {', '.join(tags) or 'none'}); use oci-layout:{self.root}:TAG with one of them",
                code="tag_not_found",
            )
        return self.manifest(chosen[0])

    def manifest(self, descriptor: dict) -> RawManifest:
        """Read and verify a manifest blob.

        :raise DigestMismatchError: the blob does not match the descriptor.
        """
        data = self._read_small(descriptor)
        media_type = str(descriptor.get("mediaType") or "")
        if not media_type:
            with contextlib.suppress(ValueError, AttributeError):
                media_type = str(load_document(data).get("mediaType") or "")
        return RawManifest(data=data, media_type=media_type, digest=sha256_digest(data))

    def _read_small(self, descriptor: dict) -> bytes:
        path = self.blob_path(str(descriptor.get("digest")))
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_MANIFEST + 1)
        except FileNotFoundError:
            raise ImageError(
                f"blob {descriptor.get('digest')} is missing from OCI layout {self.root}; write the layout again",
                code="blob_not_found",
            ) from None
        digest = sha256_digest(data)
        if digest != descriptor.get("digest") or (
            isinstance(descriptor.get("size"), int) and descriptor["size"] != len(data)
        ):
            raise DigestMismatchError(
                f"blob {descriptor.get('digest')} in OCI layout {self.root} hashes to {digest} "
                f"({len(data)} bytes); the layout was altered, so write it again"
            )
        return data

    def blob_path(self, digest: str) -> Path:
        """``blobs/sha256/<hex>`` for a valid sha256 digest.

        :raise ImageError: (``bad_manifest``) for anything that is not a sha256 digest.
        """
        if not is_sha256_digest(digest):
            raise ImageError(
                f"OCI layout {self.root} names the invalid digest {digest!r}; write the layout again",
                code="bad_manifest",
            )
        return self.root / "blobs" / "sha256" / digest[7:]

    @contextlib.contextmanager
    def open_blob(self, descriptor: dict) -> Iterator[Iterator[bytes]]:
        """The blob's bytes as chunks (verified by the reader).

        :raise ImageError: (``blob_not_found``) the blob file is missing.
        """
        path = self.blob_path(str(descriptor.get("digest")))
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below, after the consumer is done
        except FileNotFoundError:
            raise ImageError(
                f"blob {descriptor.get('digest')} is missing from OCI layout {self.root}; write the layout again",
                code="blob_not_found",
            ) from None
        with f:
            yield iter(lambda: f.read(CHUNK), b"")

    def close(self) -> None:
        """Nothing to release."""


def write_layout(
    disk: Path,
    layout_dir: Path,
    *,
    tag: str = "latest",
    form: Form = "artifact",
    arch: str = "x86_64",
    compression: Compression | None = "zstd",
    annotations: dict[str, str] | None = None,
) -> str:
    """Write ``disk`` into an OCI image layout as ``TAG`` (an index with one entry per arch).

    An existing layout is updated: the tag's index keeps the entries of other architectures.
    Returns the digest of the platform manifest. ``annotations`` go on the manifest and its entry.

    :raise ImageError: the disk cannot be packed, or ``layout_dir`` is not a layout.
    :raise HostError: ``layout_dir`` cannot be made or written.
    """
    layout_dir = Path(layout_dir)
    blobs = layout_dir / "blobs" / "sha256"
    try:
        blobs.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where the directory goes, no room, no permission
        raise HostError(f"cannot write an OCI layout into {layout_dir} ({e.strerror}); name a directory you can "
                        "write (it is made when it does not exist)") from None
    if not (layout_dir / "oci-layout").exists():
        _write_atomic(layout_dir / "oci-layout", LAYOUT_VERSION)
    index_path = layout_dir / "index.json"
    top: dict = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}
    if index_path.exists():
        try:
            top = load_document(index_path.read_bytes())
        except ValueError as exc:
            raise ImageError(
                f"{index_path} is not valid JSON ({exc}); remove the directory or pick another one",
                code="bad_manifest",
            ) from exc
    with tempfile.TemporaryDirectory(dir=layout_dir, prefix=".tmp-") as tmp:
        packed = pack(Path(disk), Path(tmp), form=form, arch=arch, compression=compression, annotations=annotations)
        _store_blobs(blobs, packed, Path(tmp))
    existing = _tag_index(layout_dir, top, tag)
    index_bytes = merged_index(existing, packed.index_entry)
    index_digest = sha256_digest(index_bytes)
    _write_atomic(blobs / index_digest[7:], index_bytes)
    entry = {
        "mediaType": OCI_INDEX,
        "digest": index_digest,
        "size": len(index_bytes),
        "annotations": {ANNOTATION_REF_NAME: tag},
    }
    others = [
        d for d in top.get("manifests") or [] if (d.get("annotations") or {}).get(ANNOTATION_REF_NAME) != tag
    ]
    top = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [*others, entry]}
    _write_atomic(index_path, json.dumps(top, separators=(",", ":")).encode())
    return packed.manifest_digest


def _store_blobs(blobs: Path, packed: Packed, tmpdir: Path) -> None:
    _write_atomic(blobs / packed.manifest_digest[7:], packed.manifest)
    for blob in packed.blobs:
        dest = blobs / blob.digest[7:]
        if blob.data is not None:
            _write_atomic(dest, blob.data)
        elif dest.exists() or blob.path is None:
            continue
        elif blob.path.is_relative_to(tmpdir):  # compressed by pack(): move it
            os.chmod(blob.path, 0o644)
            os.replace(blob.path, dest)
        else:  # the uncompressed disk itself: copy it
            tmp = dest.with_name(f".tmp-{secrets.token_hex(6)}")
            with open(blob.path, "rb") as src, open(tmp, "wb") as out:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
            os.chmod(tmp, 0o644)
            os.replace(tmp, dest)


def _tag_index(layout_dir: Path, top: dict, tag: str) -> dict | None:
    for d in top.get("manifests") or []:
        if (d.get("annotations") or {}).get(ANNOTATION_REF_NAME) != tag:
            continue
        if d.get("mediaType") not in INDEX_TYPES:
            return None  # a single manifest under this tag: replaced by our index
        with contextlib.suppress(OSError, ValueError):
            doc = load_document((layout_dir / "blobs" / "sha256" / str(d.get("digest", ""))[7:]).read_bytes())
            return doc if isinstance(doc, dict) else None
    return None


def _ref_name(descriptor: dict) -> str | None:
    name = (descriptor.get("annotations") or {}).get(ANNOTATION_REF_NAME)
    return str(name) if name is not None else None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{secrets.token_hex(6)}")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
