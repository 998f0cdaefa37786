"""The VM spec: one pydantic model shared by the CLI, the API, the backends and the drivers.

Field names are snake_case; camelCase spellings are accepted too, so a spec can sit in a
Kubernetes-style YAML file unchanged. Unknown fields are errors (a typo must not pass silently).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from .arch import host_arch, normalize_arch
from .errors import SpecError

try:
    import re2 as _re2
except ImportError:  # an exporter without RE2 passes the pattern on; the runtime checks it on arrival
    _re2 = None

#: What vmsidecar's own guests print on ttyS0 and hvc0 once they are up.
READY_MARKER = "VMSIDECAR-READY"
#: Readiness when neither the spec nor the image says anything (docs/decisions.md): our marker, a
#: getty's login prompt ("debian login: ", also with autologin), or a shell prompt ending in "# " or
#: "$ " as the last thing on the console (busybox's line editing may follow it with a terminal
#: query, ESC[6n) — except dracut's emergency shell, a failed boot.
#: RE2 has no lookahead: "a line not starting with dracut" is spelled out prefix by prefix.
_NOT_DRACUT = (r"(?:[^d\r\n][^\r\n]{0,79}|d(?:[^r\r\n][^\r\n]{0,78}|r(?:[^a\r\n][^\r\n]{0,77}|"
               r"a(?:[^c\r\n][^\r\n]{0,76}|c(?:[^u\r\n][^\r\n]{0,75}|u(?:[^t\r\n][^\r\n]{0,74})?)?)?)?)?)?")
DEFAULT_READY_PATTERN = READY_MARKER + r"|\blogin: |(?m:^" + _NOT_DRACUT + r"[#$] (?:\x1b\[[0-9;?]*[A-Za-z])*\z)"
#: OCI annotations by which an image states its own readiness (manifest or index entry), read at
#: pull time and used for every field the spec leaves unset.
READINESS_ANNOTATIONS = {
    "pattern": "io.vmsidecar.readiness.pattern",
    "console": "io.vmsidecar.readiness.console",
    "timeout": "io.vmsidecar.readiness.timeout",
}

_SIZE_RE = re.compile(r"^\s*(\d+)\s*(?:([KMGT])(?:i?B)?|(B))?\s*$", re.IGNORECASE)
_UNIT_SHIFT = {"K": 10, "M": 20, "G": 30, "T": 40}
#: upper bounds: a spec arrives over the API, and an absurd value must be a 400, not a failed boot
MAX_MEMORY_MIB = 1 << 20  # 1 TiB
MAX_TEXT = 4096
#: a QEMU CPU model name (``max``, ``host``, ``Skylake-Client-v4``, ``cortex-a57``): one argv item,
#: and no comma, so never a property list (``max,+vmx``) or anything but a model
CPU_MODEL_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"
#: ``REGISTRY[:PORT]/REPO``: a repository, never a tag or digest (the runtime finds the artifact by
#: the image's digest); checked again by the runtime's reference parser
SNAPSHOT_SOURCE_PATTERN = r"^[A-Za-z0-9.\[\]:-]+/[a-z0-9._/-]+$"
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
#: bitrates slcand can set (-s0 … -s8)
SLCAN_BITRATES = (10000, 20000, 50000, 100000, 125000, 250000, 500000, 800000, 1000000)


def parse_size_mib(value: object) -> int:
    """Parse a memory size ("512M", "1G", "1GiB", 512) into MiB; a bare number means MiB (anything
    else is read as its text).

    :raise ValueError: when the text is not a size.
    """
    if isinstance(value, int):
        size = value << 20
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ValueError(f"{value!r} is not a size; write it like 512M, 2G or 1024 (MiB)")
        number, unit, plain_bytes = int(m.group(1)), m.group(2), m.group(3)
        size = number if plain_bytes else number << _UNIT_SHIFT[unit.upper()] if unit else number << 20
    if size % (1 << 20):
        raise ValueError(f"{value!r} is not a whole number of MiB; round it to M")
    return size >> 20


def _check_name(value: str) -> str:
    if not _NAME_RE.fullmatch(value):  # not match(): "$" also matches before a trailing newline
        raise ValueError(
            f"{value!r} is not a valid name; use 1-31 lowercase letters, digits and '-', starting with a letter"
        )
    return value


def _check_cpu(value: str) -> str:
    if not re.fullmatch(CPU_MODEL_PATTERN, value):
        raise ValueError(f"{value!r} is not a QEMU CPU model name; name one model (e.g. max, host, Skylake-Client-v4, "
                         "cortex-a57), without options or +features")
    return value


def _check_source(value: str) -> str:
    if not re.fullmatch(SNAPSHOT_SOURCE_PATTERN, value):
        raise ValueError(f"{value!r} is not a repository; write REGISTRY/REPO, without a tag or digest (the "
                         "runtime finds the snapshot by the image's digest)")
    return value


#: the patterns are also in the document (the validators' own messages name the fix)
CpuModel = Annotated[str, AfterValidator(_check_cpu), Field(json_schema_extra={"pattern": CPU_MODEL_PATTERN})]
SnapshotSource = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_check_source),
                           Field(json_schema_extra={"pattern": SNAPSHOT_SOURCE_PATTERN})]
#: the pattern is also in the document (the validator's own message names the fix)
Name = Annotated[str, AfterValidator(_check_name), Field(json_schema_extra={"pattern": _NAME_RE.pattern})]
#: what the document says of memory: MiB as a number, or a size text (bounds checked on the value)
_MEMORY_SCHEMA = {"anyOf": [
    {"type": "integer", "minimum": 16, "maximum": MAX_MEMORY_MIB},
    {"type": "string", "pattern": r"^\s*\d+\s*(?:[KMGTkmgt](?:[iI]?[bB])?|[bB])?\s*$"},
]}
#: architecture spellings the spec takes (normalized to the first two)
_ARCH_SCHEMA = {"type": "string", "enum": ["x86_64", "aarch64", "amd64", "arm64"]}


#: ``load_spec(data, wire=True)``: the data is the API's JSON, held to the document's types
WIRE = {"wire": True}


def _wire_number(value: Any, info: ValidationInfo) -> Any:
    """Over the API a number is a JSON number: true is not 1 and "2" is not 2 (text sources, such
    as environment variables and image annotations, go through pydantic's usual conversion)."""
    if info.context == WIRE and isinstance(value, bool | str):
        raise ValueError(f"{json.dumps(value)} is not a number; send a JSON number (no quotes, not true/false)")
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class PortForward(_Model):
    """A named TCP port forward from the host's loopback to a guest port."""

    name: Name
    guest_port: int = Field(ge=1, le=65535)
    #: 0 = pick a free port at boot (reported by the API); fixed ports collide between instances.
    host_port: int = Field(default=0, ge=0, le=65535)
    host_address: Literal["127.0.0.1", "0.0.0.0"] = "127.0.0.1"

    _ports = field_validator("guest_port", "host_port", mode="before")(_wire_number)


class Network(_Model):
    """The guest's NIC: QEMU's user-mode networking (no privilege, no host bridge), every frame the
    guest sends checked by the runtime first (docs/spec.md)."""

    enabled: StrictBool = True
    #: let the guest reach the pod's loopback (slirp's 10.0.2.2, 127.0.0.1) and the pod's own
    #: addresses: every local listener of the pod, the exporter's gRPC port among them. For a
    #: laptop whose guest must reach a service of the host; never in a shared pod.
    allow_host_loopback: StrictBool = False
    #: let the guest reach the cloud metadata service (169.254.0.0/16, fd00:ec2::254)
    allow_metadata: StrictBool = False
    forwards: list[PortForward] = Field(default=[], max_length=64)

    @field_validator("forwards")
    @classmethod
    def _unique(cls, forwards: list[PortForward]) -> list[PortForward]:
        names = [f.name for f in forwards]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"port forward names must be unique; {sorted(dup)} repeat")
        return forwards


class Readiness(_Model):
    """When the guest counts as ready: a regex seen on a console, or as soon as it runs.

    A field the spec leaves out is taken from the image's ``io.vmsidecar.readiness.*`` annotations,
    else from these defaults; ``pattern: null`` (Ready as soon as the guest runs) is not the same
    as leaving the pattern out.
    """

    # "Leaves out" is pydantic's model_fields_set, not a sentinel value: so two settings are equal
    # only when they also set the same fields, and the wire form keeps unset fields out (to_json).

    #: null or empty: Ready as soon as the guest runs
    pattern: str | None = Field(default=DEFAULT_READY_PATTERN, max_length=1024)
    console: Literal["ttyS0", "hvc0"] = "ttyS0"
    #: Seconds from power-on; generous because TCG guests boot 5-40 s.
    timeout: float = Field(default=300.0, gt=0, le=3600)

    _timeout = field_validator("timeout", mode="before")(_wire_number)

    def __eq__(self, other: object) -> bool:
        return super().__eq__(other) and self.model_fields_set == getattr(other, "model_fields_set", None)

    def __hash__(self) -> int:
        return hash((self.pattern, self.console, self.timeout, frozenset(self.model_fields_set)))

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern == "":
            return None  # an empty regex would match at once: say so plainly
        if pattern is not None and _re2 is not None:
            compile_readiness_pattern(pattern)
        return pattern


def compile_readiness_pattern(pattern: str) -> Any:
    """``pattern`` compiled for RE2, on bytes, the engine the runtime matches readiness with: linear
    in the text, so no pattern from a spec or an image can stall the runtime on guest output. Latin-1
    mode makes bytes patterns behave as Python's ``re`` does on bytes.

    :raise ValueError: naming the pattern, RE2's reason and the fix (also when RE2 is not installed).
    """
    if _re2 is None:
        raise ValueError("readiness patterns need RE2: pip install google-re2")
    options = _re2.Options()
    options.encoding = _re2.Options.Encoding.LATIN1
    options.log_errors = False  # the error is ours to report, not RE2's to print on stderr
    try:
        return _re2.compile(pattern.encode(), options)
    except _re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(
            f"readiness pattern {pattern!r} is not a valid regex in RE2 syntax ({reason}); readiness patterns "
            "run on RE2 (linear time): no backreferences, lookarounds or atomic groups "
            "(https://github.com/google/re2/wiki/Syntax)") from None


class Channel(_Model):
    """A named virtio-serial port (guest: /dev/virtio-ports/<name>), served as channels/<name>.sock."""

    name: Name


class CanBus(_Model):
    """A CAN bus, carried as SLCAN over a virtio-serial port (portable) or a native bridge (opt-in)."""

    name: Name
    bitrate: int = Field(default=500000, gt=0, le=8_000_000)  # CAN FD's fastest data phase
    mode: Literal["slcan", "native"] = "slcan"
    #: host SocketCAN interface for mode "native"
    host_interface: str | None = Field(default=None, max_length=15)  # IFNAMSIZ - 1

    _bitrate = field_validator("bitrate", mode="before")(_wire_number)

    @model_validator(mode="after")
    def _mode_fits(self) -> CanBus:
        if self.mode == "slcan":
            if self.bitrate not in SLCAN_BITRATES:
                raise ValueError(
                    f"bitrate {self.bitrate} is not an SLCAN speed; use one of {', '.join(map(str, SLCAN_BITRATES))}"
                )
            if len(self.name) > 15:
                raise ValueError(
                    f"name {self.name!r} is longer than 15 characters, the limit of a Linux interface name "
                    "(the guest's SocketCAN interface is named after the bus); shorten it"
                )
        elif not self.host_interface:
            raise ValueError("mode native needs host_interface (a host SocketCAN interface, e.g. vcan0); set it or use mode slcan")
        name = self.host_interface
        if name is not None and (not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", "..")):
            # it goes into QEMU's -object option string (a comma adds an option) and a /sys path
            raise ValueError(f"host_interface {self.host_interface!r} is not a network interface name; "
                             "name one like vcan0 (letters, digits, '.', '_', '-')")
        return self


class GpioLine(_Model):
    """One GPIO line of the guest's virtio gpiochip."""

    name: Name
    #: guest's point of view: "out" lines are driven by the guest, "in" lines by the host
    direction: Literal["in", "out"] = "in"
    initial: Literal[0, 1] = 0

    _initial = field_validator("initial", mode="before")(_wire_number)


class VmSpec(_Model):
    """Everything needed to run one VM. Validated once; backends consume it as is."""

    image: str | None = Field(default=None, max_length=MAX_TEXT,
                              description="OCI reference, oci-layout:DIR[:TAG] or file:PATH")
    arch: Annotated[str, WithJsonSchema(_ARCH_SCHEMA)] = Field(
        default_factory=host_arch, description="x86_64 (or amd64) or aarch64 (or arm64); default: the host's")
    machine: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")  # a type name, no options
    #: QEMU's CPU model by name (``-cpu NAME``; no ``+feature`` options): default ``host`` under KVM,
    #: ``max`` (x86_64) or ``cortex-a57`` (aarch64) under TCG. Snapshots carry it in their key: a
    #: named model makes them portable between nodes whose host CPUs differ (``host`` does not).
    cpu: CpuModel | None = None
    cpus: int = Field(default=1, ge=1, le=64)
    memory: Annotated[int, WithJsonSchema(_MEMORY_SCHEMA)] = Field(
        default=512, description="MiB; accepts '512M', '1G'; 16 MiB to 1 TiB")
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    firmware: Literal["bios", "uefi"] = "bios"
    kernel: Path | None = None
    initrd: Path | None = None
    cmdline: str | None = Field(default=None, max_length=MAX_TEXT)
    virtio_console: StrictBool = True
    channels: list[Channel] = Field(default=[], max_length=30)  # virtio-serial has 31 ports, hvc0 is one
    network: Network = Network()
    can: list[CanBus] = Field(default=[], max_length=16)
    gpio: list[GpioLine] = Field(default=[], max_length=256)
    backend: Literal["qemu", "libvirt"] = "qemu"
    libvirt_uri: str | None = Field(default=None, max_length=MAX_TEXT)
    readiness: Readiness = Readiness()
    #: auto: capture the guest's RAM at its first Ready and restore that instead of booting
    #: (recycles, warm starts); off: always boot. Falls back to a cold boot, with the reason in
    #: the state, whenever a snapshot cannot be taken or used.
    snapshot: Literal["auto", "off"] = "auto"
    #: what waits during each lease for the next recycle (docs/operations.md, InPlaceReuse pools;
    #: not part of the snapshot's key): false, nothing (the recycle starts a QEMU and restores);
    #: "parked", a second QEMU started and paused, nothing of the guest loaded (the recycle only
    #: loads the snapshot into it: no QEMU start; ~40 MB, no CPU); true, a spare restore running
    #: idle (the recycle switches to it: recycle → Ready in hundredths of a second; a second
    #: guest's memory and idle CPU).
    standby: bool | Literal["parked"] = False
    #: ``REGISTRY/REPO`` (no tag, no digest) to look for a snapshot artifact of this spec and image
    #: in when the cache has none (``vmsidecar-oci snapshot push`` publishes them): found by the
    #: image's manifest digest, used only when its key matches this runtime's exactly, fetched by
    #: digest and verified; anything else boots cold, with the reason in the state (docs/oci.md).
    snapshot_source: SnapshotSource | None = None
    #: Extra QEMU arguments, appended verbatim as separate argv items. For admins only: the
    #: runtime refuses them over the API unless started with --allow-extra-args.
    extra_args: list[Annotated[str, Field(max_length=MAX_TEXT)]] = Field(default=[], max_length=256)

    @field_validator("arch", mode="before")
    @classmethod
    def _arch(cls, value: str) -> str:
        return normalize_arch(str(value))

    @field_validator("standby", mode="wrap")
    @classmethod
    def _standby(cls, value: object, handler: ValidatorFunctionWrapHandler) -> object:
        # pydantic's booleans and "parked", in any case (an environment variable); one message for the
        # rest instead of the union's two
        try:
            return handler(value.strip().lower() if isinstance(value, str) else value)
        except ValidationError:
            raise ValueError(f"{json.dumps(value, default=str)} is not a standby; use false (nothing waits for the "
                             'next recycle), "parked" (a paused QEMU waits) or true (a spare restore runs)') from None

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, value: object) -> int:
        if isinstance(value, float) and value.is_integer():  # JSON through Jumpstarter turns ints into floats
            value = int(value)
        mib = parse_size_mib(value)
        if mib < 16:
            raise ValueError(f"memory {value!r} is below the 16 MiB minimum a guest kernel needs")
        if mib > MAX_MEMORY_MIB:
            raise ValueError(f"memory {value!r} is above the {MAX_MEMORY_MIB >> 20} TiB limit; give the guest less")
        return mib

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpus(cls, value: Any, info: ValidationInfo) -> Any:
        value = _wire_number(value, info)
        return int(value) if isinstance(value, float) and value.is_integer() else value

    @model_validator(mode="after")
    def _consistent(self) -> VmSpec:
        if (self.initrd or self.cmdline) and not self.kernel:
            raise ValueError("initrd and cmdline need kernel; set kernel too or remove them")
        if self.arch == "aarch64" and self.firmware == "bios" and not self.kernel:
            raise ValueError("aarch64 has no BIOS; set firmware: uefi or boot with kernel/initrd")
        if self.backend == "libvirt" and self.extra_args:
            raise ValueError("extra_args is for the qemu backend only; libvirt takes its own domain XML")
        names = [c.name for c in self.channels] + [c.name for c in self.can]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"channel and CAN bus names share one namespace; {sorted(dup)} repeat")
        return self

    def to_json(self) -> dict[str, Any]:
        """The JSON form for the wire (API, events): every field, but of ``readiness`` only the
        fields this spec sets, so the receiver still tells "says nothing" from a value."""
        data = self.model_dump(mode="json")
        data["readiness"] = self.readiness.model_dump(mode="json", exclude_unset=True)
        return data


def _format_errors(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "spec"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling against docs/spec.md"
        elif e["type"] == "literal_error":
            msg = msg.replace("Input should be", "must be")
        parts.append(f"{where}: {msg}")
    return "invalid VM spec: " + "; ".join(parts)


def load_spec(data: dict[str, Any] | None, *, wire: bool = False) -> VmSpec:
    """Validate a spec from a mapping (``wire``: the API's JSON, whose numbers must be JSON numbers).

    :raise SpecError: with one line per bad field, naming the field and the fix.
    """
    try:
        return VmSpec.model_validate(data or {}, context=WIRE if wire else None)
    except ValidationError as e:
        raise SpecError(_format_errors(e)) from e


def _no_constant(name: str) -> Any:
    raise ValueError(name)


def _parse(text: str, source: str) -> Any:
    """JSON as JSON (what launchers write: no YAML parser to import on a warm start), all else as YAML."""
    if not text.strip():
        return {}
    if text.lstrip().startswith("{"):
        with contextlib.suppress(ValueError):
            return json.loads(text, parse_constant=_no_constant)  # NaN and Infinity are no JSON: YAML says so
    import yaml  # here: ~10 ms of a warm start's imports, for specs written in YAML only

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{source} is not valid YAML/JSON ({e}); fix the syntax") from e


def load_spec_text(text: str, source: str = "spec") -> VmSpec:
    """Validate a spec from YAML or JSON text.

    :raise SpecError: when the text does not parse or the spec is invalid.
    """
    data = _parse(text, source)
    if data is not None and not isinstance(data, dict):
        raise SpecError(f"{source} must be a mapping of spec fields, not {type(data).__name__}")
    return load_spec(data)


#: Top-level scalar fields settable as VMSIDECAR_<FIELD> environment variables.
ENV_FIELDS = ("image", "arch", "machine", "cpu", "cpus", "memory", "accel", "firmware", "backend", "libvirt_uri",
              "snapshot", "snapshot_source", "standby")
#: Readiness fields settable as VMSIDECAR_READY_<FIELD> (and ``--ready-<field>`` flags).
READY_ENV_FIELDS = ("pattern", "console", "timeout")


def _merge(data: dict[str, Any], layer: dict[str, Any]) -> None:
    """Apply one source's fields over ``data``; ``readiness`` merges field by field, so a layer
    that sets only the timeout keeps the pattern of the layer below."""
    for key, value in layer.items():
        if key == "readiness" and isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value


def spec_from_sources(
    spec_file: Path | None = None, overrides: dict[str, Any] | None = None, env: dict[str, str] | None = None
) -> VmSpec:
    """Merge file < environment < explicit overrides (CLI flags) into one validated spec.

    :raise SpecError: when any layer is unreadable or the result invalid.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    data: dict[str, Any] = {}
    path = spec_file or (Path(environ["VMSIDECAR_SPEC"]) if environ.get("VMSIDECAR_SPEC") else None)
    if path is not None:
        try:
            text = path.read_text()
        except OSError as e:
            raise SpecError(f"cannot read spec file {path} ({e.strerror}); check the path") from e
        data = load_spec_text(text, str(path)).model_dump(exclude_unset=True)
    for name in ENV_FIELDS:
        value = environ.get(f"VMSIDECAR_{name.upper()}")
        if value:
            data[name] = value
    # an empty VMSIDECAR_READY_PATTERN is a value (Ready as soon as the guest runs), not "unset"
    ready = {name: value for name in READY_ENV_FIELDS
             if (value := environ.get(f"VMSIDECAR_READY_{name.upper()}")) is not None and (value or name == "pattern")}
    if ready:
        _merge(data, {"readiness": ready})
    if environ.get("VMSIDECAR_SPEC_JSON"):
        try:
            extra = json.loads(environ["VMSIDECAR_SPEC_JSON"])
        except json.JSONDecodeError as e:
            raise SpecError(f"VMSIDECAR_SPEC_JSON is not valid JSON ({e}); fix the variable") from e
        if not isinstance(extra, dict):
            raise SpecError("VMSIDECAR_SPEC_JSON must be a JSON object of spec fields")
        _merge(data, extra)
    _merge(data, {k: v for k, v in (overrides or {}).items() if v is not None})
    return load_spec(data)
