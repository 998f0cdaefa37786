"""The API's endpoint table: one row per operation, the one place an endpoint is written down.

The runtime's routes (``api/server.py``), the OpenAPI document (``api/openapi.py``, committed as
docs/api/openapi.json) and both clients are built from these rows, and tests/test_endpoint_table.py
checks that the four name the same operations. Adding an endpoint is one row here plus its
handler in ``api/server.py`` (the server refuses to start with a row that has none) and its
method in ``client.RuntimeClient``.

The table is plain data on purpose: the blocking client of the fast CLI imports it, so it imports
neither pydantic nor aiohttp. Models are named, and :func:`model` resolves a name when asked.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

from . import errors

#: the largest JSON request body (a spec at every list's maximum fits); larger is a 413. Disk
#: images are not JSON: ``PUT /v1/vm/disk`` streams them and has no such limit.
MAX_JSON_BODY = 1 << 20
#: the longest ``GET /v1/events?timeout=`` (seconds), like the other timeouts of the API
MAX_EVENTS_TIMEOUT = 3600.0
#: the longest wait a lease's call may ask for (a driver's timeout, a ``gpio.sock`` wait), seconds
MAX_WAIT_S = 86400.0
#: a caller bound to one lease (a driver tree) names its generation in this header on every call;
#: the runtime answers 409 ``generation_changed`` once the VM has moved on, so a call of a lease
#: that ended (the exporter may still run its tree while the next lease claims) acts on nothing of
#: the next. Without the header a call is not bound (the CLI, the pool's own tools).
GENERATION_HEADER = "Vmsidecar-Generation"


def is_wait(value: object) -> TypeGuard[int | float]:
    """Whether a JSON value is a wait in seconds: a number (not a bool, not NaN) from 0 to
    :data:`MAX_WAIT_S`. A lease holder sends any JSON; infinity and NaN never end."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= MAX_WAIT_S

Media = Literal["json", "ndjson", "binary"]
MEDIA_TYPES: dict[Media, str] = {
    "json": "application/json",
    "ndjson": "application/x-ndjson",
    "binary": "application/octet-stream",
}
#: where :func:`model` looks for a model name (pydantic modules, imported on first use)
_MODEL_MODULES = ("models", "spec", "state", "events")


@dataclass(frozen=True)
class Query:
    """A query parameter (any other is a 400, and so is one given twice)."""

    name: str
    #: its JSON Schema
    schema: Mapping[str, Any]
    description: str | None = None


@dataclass(frozen=True)
class Body:
    """A request body: a JSON model, or (media binary) a byte stream with no size limit."""

    media: Media
    model: str | None = None
    required: bool = True
    #: JSON Schema keywords the operation adds to its model's
    schema_extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """A documented answer that is not an error: its status, and a model (None: bytes)."""

    status: int
    description: str
    media: Media = "json"
    model: str | None = None


@dataclass(frozen=True, eq=False)  # a row is itself: the server keys its handlers by row
class Endpoint:
    """One operation of the API.

    ``errors`` are the codes (``errors.registry()``) it answers with an error status before any
    stream starts; a code stands for itself and the finer codes its class lists. Each is sent with
    its class's status. A JSON body adds 413 and 415 (``http_error``), a byte stream 415. The
    ``error`` lines of a stream may carry any code.
    """

    method: str
    path: str
    summary: str
    #: the success answer first
    answers: tuple[Answer, ...]
    errors: tuple[str, ...]
    body: Body | None = None
    query: tuple[Query, ...] = ()
    #: takes :data:`GENERATION_HEADER` (all but the claim, which moves the generation, and the probes)
    lease_bound: bool = True

    @property
    def status(self) -> int:
        """The status of success."""
        return self.answers[0].status

    @property
    def request(self) -> str | None:
        """The name of the request body's model."""
        return self.body.model if self.body else None

    @property
    def response(self) -> str | None:
        """The name of the success answer's model (of each line, for a stream)."""
        return self.answers[0].model

    @property
    def streams(self) -> bool:
        """Whether success is an NDJSON stream."""
        return self.answers[0].media == "ndjson"

    @property
    def query_names(self) -> tuple[str, ...]:
        """The query parameters it takes."""
        return tuple(q.name for q in self.query)

    def error_statuses(self) -> dict[int, tuple[str, ...]]:
        """Each error status it may answer, with the codes sent with it."""
        found: dict[int, list[str]] = {}
        registry = errors.registry()
        for code in (*self.errors, *(("generation_changed",) if self.lease_bound else ())):
            found.setdefault(registry[code].http_status, []).append(code)
        if self.body is not None:
            found.setdefault(415, []).append("http_error")
            if self.body.media == "json":
                found.setdefault(413, []).append("http_error")
        return {status: tuple(codes) for status, codes in sorted(found.items())}

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


def model(name: str) -> Any:
    """The pydantic model a row names (importing pydantic: the server's and the async client's affair).

    :raise LookupError: for a name no contract module defines.
    """
    for module in _MODEL_MODULES:
        found = getattr(importlib.import_module(f"{__package__}.{module}"), name, None)
        if found is not None:
            return found
    raise LookupError(f"the endpoint table names model {name!r}, which no module of vmsidecar_contract defines")


_STATE = Answer(200, "The VM state after the operation", model="VmState")
_BOOL = {"type": "boolean", "default": False}

GET_VM = Endpoint(
    "GET", "/v1/vm",
    "State: phase, image digest, accel, generation, timings, last error. Any phase.",
    (_STATE,), ("bad_request",))
GET_SPEC = Endpoint(
    "GET", "/v1/vm/spec", "The current spec. Any phase.",
    (Answer(200, "spec", model="VmSpec"),), ("bad_request", "not_found"))
PUT_SPEC = Endpoint(
    "PUT", "/v1/vm/spec",
    "Replace the spec (idempotent) with the whole spec, at least one field (an empty spec is a 400). "
    "Stopped|Crashed|Error, or any phase when unchanged. Host paths (file:, oci-layout:, kernel, initrd) only "
    "under the runtime's --allow-host-paths, extra_args only with --allow-extra-args (else 400). When the lease "
    "was claimed with a spec (POST /v1/vm/lease), the recycles that end it return to that spec.",
    (_STATE,), ("bad_request", "invalid_spec", "host_path_not_allowed", "wrong_phase"),
    body=Body("json", "VmSpec", schema_extra={"minProperties": 1}))
POST_POWER = Endpoint(
    "POST", "/v1/vm/power",
    "on (Stopped|Crashed|Error; idempotent when on), off (any), reset (Starting|Running|Ready), cycle (any).",
    (_STATE,),
    ("bad_request", "no_spec", "bad_reference", "wrong_phase", "image_error", "digest_mismatch", "wrong_platform",
     "host_error", "guest_error", "registry_error", "pull_timeout"),
    body=Body("json", "PowerRequest"))
POST_RECYCLE = Endpoint(
    "POST", "/v1/vm/recycle",
    "Back to pristine (overlay, flashed disk, scrollback discarded; generation bumped), then boot. "
    "Cancels the disk transfer under way (it belonged to the lease that ended). Any phase.",
    (_STATE,), ("bad_request", "host_error", "guest_error"),
    body=Body("json", "RecycleRequest", required=False))
POST_LEASE = Endpoint(
    "POST", "/v1/vm/lease",
    "Claim the VM for a new lease (the exporter does when it hands the lease out): when an earlier lease used "
    "this generation it is recycled first (the answer then comes after the fresh boot has started); the disk "
    "transfer under way is cancelled; no memory snapshot is captured from then on (one under way finishes "
    "first). A claim naming the token of the claim that holds the current generation is answered without "
    "recycling (its first answer was lost). With a spec (the exporter's, checked as PUT /v1/vm/spec checks "
    "one), a VM running another (an earlier lease set one) is recycled onto it, and the recycles that end the "
    "lease return to it. Any phase.",
    (_STATE,), ("bad_request", "invalid_spec", "host_path_not_allowed", "host_error", "guest_error"),
    lease_bound=False,
    body=Body("json", "ClaimRequest", required=False))
PUT_DISK = Endpoint(
    "PUT", "/v1/vm/disk",
    "Flash: the body is the image (qcow2/raw, optionally zstd/gzip/xz), streamed (no size limit but the image "
    "limits). Stopped|Crashed|Error, or any phase with power_off=true.",
    (_STATE,),
    ("bad_request", "wrong_phase", "transfer_in_progress", "transfer_cancelled", "image_error", "digest_mismatch",
     "host_error", "pull_timeout"),
    body=Body("binary"),
    query=(Query("power_off", _BOOL),
           Query("digest", {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"})))
GET_DISK = Endpoint(
    "GET", "/v1/vm/disk", "Dump the disk (base + changes) as one image. Stopped|Crashed|Error. One disk "
    "transfer at a time, a flash or a dump (409 transfer_in_progress); cancelled by a recycle or the next "
    "claim (409 transfer_cancelled, or the stream cut short). The spec's image is pulled and checked "
    "first when it is not yet (the errors of a power on).",
    (Answer(200, "image", "binary"),),
    ("bad_request", "no_spec", "bad_reference", "wrong_phase", "transfer_in_progress", "transfer_cancelled",
     "image_error", "digest_mismatch", "wrong_platform", "host_error", "registry_error", "pull_timeout"),
    query=(Query("format", {"type": "string", "enum": ["qcow2", "raw"], "default": "qcow2"}),))
POST_PULL = Endpoint(
    "POST", "/v1/vm/disk/pull",
    "Flash from a reference; answers an NDJSON stream of ProgressLine (progress…, then result or error). "
    "Stopped|Crashed|Error, or any phase with power_off. One disk transfer at a time (409 transfer_in_progress); "
    "cancelled (error line transfer_cancelled, nothing installed) by a recycle, the next claim or the client "
    "going away; bounded by serve --pull-timeout (error line pull_timeout). The reference is the lease's: "
    "the pool's registry credentials only for the spec's image's repository and serve --lease-registry "
    "scopes.",
    (Answer(200, "progress stream", "ndjson", "ProgressLine"),),
    ("bad_request", "host_path_not_allowed", "wrong_phase", "transfer_in_progress"),
    body=Body("json", "PullRequest"))
GET_EVENTS = Endpoint(
    "GET", "/v1/events",
    "Event stream (NDJSON of Event; a hello event first) until the client disconnects, or until timeout seconds "
    "have passed; a stream opened with a lease's generation header ends as that lease does, before any event "
    "of the next generation. Any phase.",
    (Answer(200, "events", "ndjson", "Event"),), ("bad_request",),
    # {types}: the document fills in the names of events.EVENTS (pydantic models: not imported here)
    query=(Query("types", {"type": "string"}, "comma-separated event types, exact names ({types})"),
           Query("timeout", {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_EVENTS_TIMEOUT},
                 "end the stream after this many seconds (default: stream until the client leaves)")))
POST_SHUTDOWN = Endpoint(
    "POST", "/v1/shutdown", "Stop the guest and exit the runtime with 0 (ExitAndReplace). Any phase.",
    (Answer(202, "accepted", model="Accepted"),), ("bad_request",))
GET_HEALTHZ = Endpoint(
    "GET", "/healthz", "Liveness: the runtime answers. Any phase.",
    (Answer(200, "alive", model="Health"),), ("bad_request",), lease_bound=False)
GET_READYZ = Endpoint(
    "GET", "/readyz", "Readiness: 200 when Ready, else 503. Any phase.",
    (Answer(200, "ready", model="Health"), Answer(503, "not ready", model="Health")), ("bad_request",),
    lease_bound=False)

#: every operation of the API, in the order the document lists them
ENDPOINTS: tuple[Endpoint, ...] = (GET_VM, GET_SPEC, PUT_SPEC, POST_POWER, POST_RECYCLE, POST_LEASE, PUT_DISK,
                                   GET_DISK, POST_PULL, GET_EVENTS, POST_SHUTDOWN, GET_HEALTHZ, GET_READYZ)
