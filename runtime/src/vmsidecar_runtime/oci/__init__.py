"""OCI disk images: references, pull into a digest-keyed cache, push, OCI layouts.

See ``docs/oci.md`` for the formats and the cache.
"""

from __future__ import annotations

from .layout import write_layout
from .pull import PulledDisk, inspect, pull
from .push import push, push_artifact, push_containerdisk
from .reference import Reference, parse_reference

__all__ = [
    "PulledDisk",
    "Reference",
    "inspect",
    "parse_reference",
    "pull",
    "push",
    "push_artifact",
    "push_containerdisk",
    "write_layout",
]
