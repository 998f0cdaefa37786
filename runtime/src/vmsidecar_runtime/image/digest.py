"""``sha256:<hex>`` digests, the one spelling for disks, blobs and manifests."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Protocol

#: a digest as vmsidecar verifies it: sha256, lowercase hex (OCI's canonical form; what podman, skopeo,
#: oras and docker write)
_SHA256_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def is_sha256_digest(value: Any) -> bool:
    """Whether ``value`` is a ``sha256:<64 lowercase hex>`` string."""
    return isinstance(value, str) and _SHA256_DIGEST.fullmatch(value) is not None


class _Sha256(Protocol):
    @property
    def name(self) -> str: ...

    def hexdigest(self) -> str: ...


def sha256_digest(content: bytes | bytearray | memoryview | _Sha256) -> str:
    """``sha256:<hex>`` of ``content``: bytes, or a ``hashlib.sha256()`` fed with streamed data.

    :raise ValueError: for a hash object that is not sha256 (its digest would be mislabelled).
    """
    hasher = hashlib.sha256(content) if isinstance(content, bytes | bytearray | memoryview) else content
    if hasher.name != "sha256":
        raise ValueError(f"sha256_digest() needs a sha256 hash object, not {hasher.name}")
    return "sha256:" + hasher.hexdigest()
