"""One error root for vmsidecar, mapped to the wire in one place (``api.errors``).

Tree::

    VmsidecarError                 code            HTTP
    ├── SpecError                  invalid_spec    400
    │   └── HostPathError          host_path_not_allowed 400
    ├── RequestError               bad_request     400
    ├── NotFoundError              not_found       404
    ├── StateError                 wrong_phase     409
    │   └── GenerationChangedError generation_changed 409
    ├── TransferError              transfer_in_progress 409 (one disk transfer at a time; transfer_cancelled)
    │   └── PullTimeoutError       pull_timeout    504
    ├── ImageError                 image_error     422
    │   ├── BadReferenceError      bad_reference   400
    │   ├── RegistryError          registry_error  502
    │   ├── DigestMismatchError    digest_mismatch 422
    │   └── PlatformError          wrong_platform  422
    ├── HostError                  host_error      500  (QEMU missing, no /dev/kvm, disk full …)
    └── GuestError                 guest_error     500  (crashed, never ready)

Every message is one sentence naming the cause, then the fix. Besides its own ``code``, a class
lists in ``codes`` the more precise codes it may carry; ``registry()`` collects them all, the
OpenAPI document lists them, and the client rebuilds the class a code belongs to.
"""

from __future__ import annotations

from typing import Any, ClassVar


class VmsidecarError(Exception):
    """Base of every error vmsidecar raises on purpose."""

    code: str = "error"
    http_status: int = 500
    #: more precise codes this class may carry instead of ``code``, with what each means (a subclass
    #: without its own inherits these; the registry keeps each code for the first class listing it)
    codes: ClassVar[dict[str, str]] = {
        "internal_error": "a bug in the runtime (500); the message names the exception: please report it",
    }

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The wire form: ``{"error": code, "message": sentence}`` plus the class's fields."""
        return {"error": self.code, "message": self.message}

    @classmethod
    def from_dict(cls, body: dict[str, Any], status: int) -> VmsidecarError:
        """Rebuild an error of this class from its wire form."""
        exc = cls.__new__(cls)
        VmsidecarError.__init__(exc, str(body.get("message", f"HTTP {status}")), code=str(body.get("error")))
        exc.http_status = status
        return exc


class SpecError(VmsidecarError):
    """The VM spec is invalid."""

    code = "invalid_spec"
    http_status = 400
    codes = {"no_spec": "the runtime has no spec yet; PUT /v1/vm/spec or start it with --spec"}


class HostPathError(SpecError):
    """A host path (``file:``, ``oci-layout:``, kernel, initrd) named over the API, outside what the
    administrator allowed."""

    code = "host_path_not_allowed"


class RequestError(VmsidecarError):
    """A malformed API request (bad JSON, missing field, wrong value)."""

    code = "bad_request"
    http_status = 400
    codes = {
        "method_not_allowed": "the path exists but not with this method (405; the Allow header lists them)",
        "bad_value": "a GPIO value that is not 0 or 1",
        "bad_wait": "a GPIO wait with a bad edge or timeout",
        "not_host_driven": "a GPIO line the guest drives (direction out) cannot be set by the host",
    }


class NotFoundError(VmsidecarError):
    """The thing asked for does not exist."""

    code = "not_found"
    http_status = 404
    codes = {"no_line": "no GPIO line of that name"}


class StateError(VmsidecarError):
    """The VM is in a phase where the operation is not allowed."""

    code = "wrong_phase"
    http_status = 409
    codes = {"closed": "the device was closed (the runtime is stopping)"}

    def __init__(self, message: str, *, actual: str | None = None, required: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.actual = actual
        self.required = required

    def to_dict(self) -> dict[str, Any]:
        """The wire form with the actual and the required phases."""
        return {**super().to_dict(), "actual": self.actual, "required": self.required}

    @classmethod
    def from_dict(cls, body: dict[str, Any], status: int) -> VmsidecarError:
        """Rebuild the error with its phases."""
        exc = super().from_dict(body, status)
        assert isinstance(exc, StateError)
        exc.actual, exc.required = body.get("actual"), body.get("required")
        return exc


class GenerationChangedError(StateError):
    """A conditional operation named a generation that is no longer current."""

    code = "generation_changed"


class TransferError(VmsidecarError):
    """Another disk transfer (a pull, a flash by reference or an upload flash) is under way for this VM."""

    code = "transfer_in_progress"
    http_status = 409
    codes = {
        "transfer_cancelled": "the transfer's lease ended (a recycle, or the next lease's claim) or its client went "
                              "away before it finished: nothing of it was installed",
    }


class PullTimeoutError(TransferError):
    """A pull (or upload flash) did not finish within the runtime's deadline (serve --pull-timeout)."""

    code = "pull_timeout"
    http_status = 504


class ImageError(VmsidecarError):
    """A guest image cannot be resolved, fetched, verified or unpacked."""

    code = "image_error"
    http_status = 422
    codes = {
        "bad_manifest": "the manifest or index is not a disk image vmsidecar can use",
        "bad_disk": "the disk is not a qcow2 or raw disk image, is empty, truncated or corrupt",
        "unsafe_disk": "a qcow2 that names a backing file or an external data file, or a disk declared raw that "
                       "is another format in disguise (QEMU would open a host path)",
        "disk_too_large": "over the virtual or decompressed size limit",
        "bad_compression": "a compressed layer or stream that does not decompress",
        "unsupported_compression": "a compression other than zstd, gzip and xz",
        "unsupported_format": "a disk format other than qcow2 and raw, or a disk stored as a sparse tar entry",
        "compressed_input": "a compressed file where an uncompressed disk is needed",
        "no_disk": "the image holds no disk",
        "several_disks": "the image holds more than one disk",
        "disk_not_found": "the disk the image names is missing",
        "unsafe_path": "a tar entry that is a link or leaves disk/",
        "file_not_found": "a file: reference to a missing file",
        "file_changed": "the file changed while it was being read",
        "layout_not_found": "an oci-layout: reference to a missing or invalid OCI layout",
        "tag_not_found": "no such tag",
        "blob_not_found": "a blob the manifest names is missing",
        "manifest_not_found": "no such manifest",
        "unknown_form": "vmsidecar-oci push: a form other than artifact or containerdisk",
        "bad_readiness": "the image's io.vmsidecar.readiness.* annotations are not valid readiness settings",
        "no_image": "vmsidecar-oci snapshot push: the spec names no image",
        "not_registry_image": "vmsidecar-oci snapshot push: the spec's image is a file, with no OCI manifest",
        "no_snapshot": "vmsidecar-oci snapshot push: the cache holds no snapshot of the spec",
        "bad_snapshot": "vmsidecar-oci snapshot push: the cached snapshot fails its seal check",
    }


class BadReferenceError(ImageError):
    """An image reference that cannot be parsed or names an unknown scheme."""

    code = "bad_reference"
    http_status = 400


class RegistryError(ImageError):
    """The registry is unreachable, refuses, or has no such repository/tag."""

    code = "registry_error"
    http_status = 502
    codes = {
        "registry_unreachable": "the registry does not answer (after retries)",
        "registry_unauthorized": "the registry refused the credentials, or needs some",
        "registry_tls": "TLS to the registry failed (certificate)",
        "repository_not_found": "no such repository",
        "bad_answer": "the registry's answer is malformed: JSON of the wrong shape, nesting past the parser, "
                      "headers or URLs that do not parse (a broken or hostile registry)",
    }


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
    codes = {"cache_write_failed": "the image cache cannot be written (disk full, permissions, a failing disk)"}


class GuestError(VmsidecarError):
    """The guest crashed or never became ready."""

    code = "guest_error"
    http_status = 500
    codes = {
        "timeout": "the guest did not answer in time",
        "bad_virtqueue": "the guest sent a malformed virtqueue request",
    }


#: codes the API server sends for failures no exception of ours describes
PROTOCOL_CODES = {
    "http_error": "an HTTP-level refusal (e.g. 413 body too large, 415 media type)",
}


def registry() -> dict[str, type[VmsidecarError]]:
    """Every code the runtime can send, with the class a client rebuilds for it (a code listed
    by a class and by its subclass belongs to the base class)."""
    found: dict[str, type[VmsidecarError]] = dict.fromkeys(PROTOCOL_CODES, VmsidecarError)
    pending: list[type[VmsidecarError]] = [VmsidecarError]
    while pending:
        cls = pending.pop(0)
        for code in (cls.code, *cls.codes):
            found.setdefault(code, cls)
        pending += [sub for sub in cls.__subclasses__() if sub.__module__ == __name__]
    return found


def describe(code: str) -> str:
    """What a code means (for the OpenAPI document)."""
    cls = registry()[code]
    return PROTOCOL_CODES.get(code) or cls.codes.get(code) or (cls.__doc__ or "").strip().splitlines()[0]


def from_wire(body: dict[str, Any], status: int) -> VmsidecarError:
    """The exception an error body stands for (its class and fields)."""
    cls = registry().get(str(body.get("error")), VmsidecarError)
    return cls.from_dict(body, status)
