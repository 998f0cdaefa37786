"""One error root for vmsidecar, mapped to the wire in one place (``api.errors``).

Tree::

    VmsidecarError                 code            HTTP
    ├── SpecError                  invalid_spec    400
    │   └── HostPathError          host_path_not_allowed 400
    ├── RequestError               bad_request     400
    ├── NotFoundError              not_found       404
    ├── StateError                 wrong_phase     409
    │   └── GenerationChangedError generation_changed 409
    ├── ImageError                 image_error     422
    │   ├── BadReferenceError      bad_reference   400
    │   ├── RegistryError          registry_error  502
    │   ├── DigestMismatchError    digest_mismatch 422
    │   └── PlatformError          wrong_platform  422
    ├── HostError                  host_error      500  (QEMU missing, no /dev/kvm, disk full …)
    └── GuestError                 guest_error     500  (crashed, never ready)

Every message is one sentence naming the cause, then the fix.
"""

from __future__ import annotations


class VmsidecarError(Exception):
    """Base of every error vmsidecar raises on purpose."""

    code: str = "error"
    http_status: int = 500

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, str]:
        """The wire form: ``{"error": code, "message": sentence}``."""
        return {"error": self.code, "message": self.message}


class SpecError(VmsidecarError):
    """The VM spec is invalid."""

    code = "invalid_spec"
    http_status = 400


class HostPathError(SpecError):
    """A host path (``file:``, ``oci-layout:``, kernel, initrd) named over the API, outside what the
    administrator allowed."""

    code = "host_path_not_allowed"


class RequestError(VmsidecarError):
    """A malformed API request (bad JSON, missing field, wrong value)."""

    code = "bad_request"
    http_status = 400


class NotFoundError(VmsidecarError):
    """The thing asked for does not exist."""

    code = "not_found"
    http_status = 404


class StateError(VmsidecarError):
    """The VM is in a phase where the operation is not allowed."""

    code = "wrong_phase"
    http_status = 409

    def __init__(self, message: str, *, actual: str | None = None, required: str | None = None) -> None:
        super().__init__(message)
        self.actual = actual
        self.required = required


class GenerationChangedError(StateError):
    """A conditional operation named a generation that is no longer current."""

    code = "generation_changed"


class ImageError(VmsidecarError):
    """A guest image cannot be resolved, fetched, verified or unpacked."""

    code = "image_error"
    http_status = 422


class BadReferenceError(ImageError):
    """An image reference that cannot be parsed or names an unknown scheme."""

    code = "bad_reference"
    http_status = 400


class RegistryError(ImageError):
    """The registry is unreachable, refuses, or has no such repository/tag."""

    code = "registry_error"
    http_status = 502


class DigestMismatchError(ImageError):
    """Content does not match the digest that names it."""

    code = "digest_mismatch"


class PlatformError(ImageError):
    """No image for the wanted architecture."""

    code = "wrong_platform"


class HostError(VmsidecarError):
    """The host lacks something (QEMU binary, /dev/kvm, disk space, vcan …)."""

    code = "host_error"
    http_status = 500


class GuestError(VmsidecarError):
    """The guest crashed or never became ready."""

    code = "guest_error"
    http_status = 500
