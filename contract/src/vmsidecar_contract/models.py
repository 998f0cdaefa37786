"""Request and response bodies of the API (the same pydantic models the client validates)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt


def _whole_number(value: Any) -> Any:
    # JSON Schema counts 2.0 as an integer, and JSON through Jumpstarter turns ints into floats
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: a JSON number: never true or "2" (the API takes JSON types as the document states them)
JsonNumber = Annotated[float, Field(strict=True)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PowerRequest(_Request):
    """``POST /v1/vm/power``."""

    action: Literal["on", "off", "reset", "cycle"]
    #: off/cycle: ACPI power button first (off defaults to graceful, cycle to hard)
    graceful: StrictBool | None = None
    #: seconds to wait for a graceful power-off before forcing it
    timeout: JsonNumber = Field(default=60.0, gt=0, le=3600)


class RecycleRequest(_Request):
    """``POST /v1/vm/recycle``."""

    #: boot the fresh guest right away (the next lease finds it Ready)
    boot: StrictBool = True
    #: only recycle if this is still the current generation (409 generation_changed otherwise); a
    #: JSON integer, 2 or 2.0, never true or "2" (the validator goes after the bound: the bound stays in the schema)
    if_generation: Annotated[StrictInt, Field(ge=0), BeforeValidator(_whole_number)] | None = None


class ClaimRequest(_Request):
    """``POST /v1/vm/lease``."""

    #: the claiming tree's token: a claim the runtime already carried out for this token (its answer
    #: lost to a timeout) is answered again, not made twice (a second claim recycles the lease's guest)
    token: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{8,64}$")
    #: the spec the lease is served (the exporter's), as ``PUT /v1/vm/spec`` takes it: a VM with another
    #: (an earlier lease set one) is recycled onto it, and the recycles that end the lease return to it
    spec: dict[str, Any] | None = Field(default=None, min_length=1)


class PullRequest(_Request):
    """``POST /v1/vm/disk/pull``."""

    reference: str = Field(min_length=1)
    #: power the VM off first when it runs; otherwise a running VM makes the request fail with 409
    power_off: StrictBool = False


class ErrorBody(BaseModel):
    """Every error: a stable code (listed in the document) and one sentence with the cause and the fix."""

    error: str
    message: str
    #: wrong_phase and generation_changed: the phase the VM is in, and the phases the call needs
    actual: str | None = None
    required: str | None = None


class Health(BaseModel):
    """``GET /healthz`` and ``GET /readyz``."""

    status: Literal["ok", "ready", "not-ready"]
    phase: str


class Accepted(BaseModel):
    """``POST /v1/shutdown``."""

    status: Literal["shutting-down"]


class ProgressLine(BaseModel):
    """One line of the ``POST /v1/vm/disk/pull`` NDJSON stream."""

    type: Literal["progress", "result", "error"]
    done: int | None = None
    total: int | None = None
    state: dict | None = None
    error: str | None = None
    message: str | None = None
