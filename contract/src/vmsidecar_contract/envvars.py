"""Every ``VMSIDECAR_*`` environment variable the project's programs read, and what reads it.

``vmsidecar-runtime serve`` warns of any other it finds in its environment and names the nearest
of these: a typo (``VMSIDECAR_MEMROY=4G``) was ignored without a word, and the guest booted with
the default memory. ``tests/test_envvars.py`` keeps the list whole: every ``VMSIDECAR_*`` name in
the project's sources is here.
"""

from __future__ import annotations

from collections.abc import Mapping

from .spec import ENV_FIELDS, READY_ENV_FIELDS

PREFIX = "VMSIDECAR_"

#: variable -> what reads it
KNOWN: dict[str, str] = {
    **{f"{PREFIX}{field.upper()}": f"the runtime: spec field {field}" for field in ENV_FIELDS},
    **{f"{PREFIX}READY_{field.upper()}": f"the runtime: spec field readiness.{field}" for field in READY_ENV_FIELDS},
    f"{PREFIX}SPEC": "the runtime and vmsidecar-oci: the spec file",
    f"{PREFIX}SPEC_JSON": "the runtime: spec fields as a JSON object",
    f"{PREFIX}SHARED_DIR": "the runtime and the local driver: the shared socket directory",
    f"{PREFIX}CACHE_DIR": "the runtime and vmsidecar-oci: the image cache",
    f"{PREFIX}CACHE_BUDGET": "the runtime: what the image cache may hold",
    f"{PREFIX}STATE_DIR": "the runtime: overlays, logs, flashed disks",
    f"{PREFIX}SOCKET_OWNER": "the runtime: UID[:GID] its sockets are handed to",
    f"{PREFIX}LOG_FORMAT": "the runtime: text or json",
    f"{PREFIX}LOG_LEVEL": "the runtime: debug, info, warning, error or critical",
    f"{PREFIX}ALLOW_HOST_PATHS": "the runtime: host directories API callers may name",
    f"{PREFIX}MAX_DISK_SIZE": "the runtime: the largest disk a pull or flash may bring",
    f"{PREFIX}PULL_TIMEOUT": "the runtime: the deadline of one pull or flash",
    f"{PREFIX}HEALTH_LISTEN": "the runtime: the TCP address of its probes and metrics",
    f"{PREFIX}REGISTRY_AUTH_FILE": "the runtime and vmsidecar-oci: registry credentials",
    f"{PREFIX}INSECURE_REGISTRIES": "the runtime and vmsidecar-oci: registries spoken to in plain HTTP",
    f"{PREFIX}LEASE_REGISTRIES": "the runtime: registry scopes lent to a lease's flash",
    f"{PREFIX}REGISTRY_HOST": "the runtime and vmsidecar-oci: the host of the credentials below",
    f"{PREFIX}REGISTRY_USERNAME": "the runtime and vmsidecar-oci: a registry user",
    f"{PREFIX}REGISTRY_PASSWORD": "the runtime and vmsidecar-oci: that user's password",
    f"{PREFIX}SNAPSHOT_FORM": "the runtime: stream (the full-stream snapshot form)",
    f"{PREFIX}CAPTURE_SETTLE_S": "the runtime: the longest wait for a guest to settle before its capture",
    f"{PREFIX}QEMU_CONFINEMENT": "the runtime: off runs QEMU outside its Landlock domain",
    f"{PREFIX}TCG_TB_SIZE": "the runtime: TCG's translation cache, MiB",
    f"{PREFIX}LIBVIRT_NAMESPACES": "the runtime's libvirt backend: the private daemon's namespaces",
    f"{PREFIX}QEMU_RULES": "the private libvirtd's emulator: its boot plan's Landlock rules (the runtime sets it "
                           "in the domain XML, for libvirt_emulator; not a setting)",
    f"{PREFIX}DEBUG": "vmsidecar-oci: tracebacks on errors",
    f"{PREFIX}API_SOCKET": "the drivers' exec shim: the runtime's API socket",
    f"{PREFIX}EXPORTER_METRICS_LISTEN": "the exporter: the TCP address of its metrics",
    f"{PREFIX}IMAGE_CACHE": "vmsidecar-image: where built guest images go",
    f"{PREFIX}IMAGE_EXACT_PINS": "vmsidecar-image: Debian packages at their pinned versions only",
    f"{PREFIX}PAYLOAD": "vmsidecar-image: a make variable of the kernel stub's build",
    f"{PREFIX}VO_SYMBOLS": "vmsidecar-image: a make variable of the kernel stub's build",
    f"{PREFIX}TEST_WORKERS": "scripts/test: pytest workers",
    f"{PREFIX}E2E_TAG": "e2e/: the image tag under test",
}


def unknown(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The ``VMSIDECAR_*`` names of ``environ`` that no program reads, each with the nearest known
    name (None: none is near)."""
    names = [name for name in sorted(environ) if name.startswith(PREFIX) and name not in KNOWN]
    if not names:
        return []
    import difflib  # here: every serve asks, and almost never has a name to match (1.4 ms of import)

    return [(name, next(iter(difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.75)), None)) for name in names]
