"""Errors of the image builder, under the project's one error root."""

from __future__ import annotations

from vmsidecar_contract.errors import HostError, ImageError


class BuildError(ImageError):
    """A guest image recipe cannot be built."""

    code = "image_build_error"


class PinError(BuildError):
    """A pinned Debian package version can no longer be downloaded."""

    code = "stale_pin"


class ToolError(HostError):
    """A host tool needed by the build is missing or failed."""
