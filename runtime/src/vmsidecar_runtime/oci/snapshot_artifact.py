"""The shape of a snapshot artifact, written once for the push and the fetch (docs/oci.md).

An OCI 1.1 image manifest: ``artifactType`` :data:`.mediatypes.SNAPSHOT_ARTIFACT_TYPE`, the empty
config, one layer per file of the snapshot's cache entry (titled with the file's name; large
files zstd-compressed), ``subject`` = the disk image's manifest, and the snapshot's identity in
annotations (:class:`..snapshot_identity.SnapshotIdentity`). Registries without the referrers
API find it through the referrers tag schema: the tag ``sha256-<hex>`` of the subject names an
image index listing the artifacts that refer to it.
"""

from __future__ import annotations

from vmsidecar_runtime.image.digest import is_sha256_digest

#: a file at least this large is published zstd-compressed (guest RAM and migration streams
#: shrink 3-10x; small files are not worth a decoder)
COMPRESS_FROM = 64 << 10
#: the entry's own record of its files (``snapshots.SnapshotMeta``): always published, as it is
META_FILE = "meta.json"
#: bounds on what a runtime reads from a source: candidates listed, manifests fetched, files
MAX_CANDIDATES = 64
MAX_MANIFESTS_READ = 8
MAX_FILES = 32



def referrers_tag(digest: str) -> str:
    """The referrers tag schema's tag for ``digest`` (OCI distribution 1.1: ``<alg>-<ref>``)."""
    algorithm, _, hex_ = digest.partition(":")
    return f"{algorithm}-{hex_}"[:128]


def is_digest(value: object) -> bool:
    """Whether ``value`` is a ``sha256:<64 hex>`` digest."""
    return is_sha256_digest(value)
