"""The pool's spec, remembered in the state directory by a runtime a lease has claimed, for the
runtime that restarts on that directory after it was killed.

A pool pod's runtime starts with no ``--spec``: its own spec (what a claim naming none serves, and
the one snapshot source a lease's spec may name: docs/security.md rows 40 and 50) is the spec it is
given over the API before any lease, or its first claim's. Killed while a lease holds its pod (an
OOM, a crash), it is started again by its container with no ``--spec`` and knew nothing of the
pool's, so it took the first spec sent to it, which the lease holder with the API socket could send
before the exporter's tree claimed again. Now the first claim writes the runtime's own spec here
(the pod's volume outlives its containers; QEMU's Landlock domain cannot write here:
``confinement.py``), a runtime started without ``--spec`` reads it back and holds to it, and a
runtime that stops cleanly removes it: a runtime that exits of its own accord or on SIGTERM is not
mid-lease in a pod that goes on, and a state directory that outlives the pod (a host directory, a
laptop's default) must not bind the next pool's configuration to this one's.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from vmsidecar_contract.errors import SpecError
from vmsidecar_contract.spec import VmSpec, load_spec

log = logging.getLogger(__name__)

#: the file, in the state directory
FILE_NAME = "pool-spec.json"
#: more than any spec's JSON (a spec's strings are bounded); a larger file is not this runtime's
MAX_BYTES = 1 << 20


def remember(state: Path, spec: VmSpec) -> None:
    """Write ``spec`` as the pool's (atomically: a runtime killed meanwhile leaves the former one)."""
    path = state / FILE_NAME
    tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(spec.to_json(), fh)
        os.replace(tmp, path)
    except OSError as e:  # the lease goes on; a restart would take its first spec, as before
        log.warning("the pool's spec could not be written to %s (%s): a runtime restarted on this state "
                    "directory while a lease holds the pod will take the first spec it is sent as the pool's",
                    path, e.strerror or e)
        tmp.unlink(missing_ok=True)


def remembered(state: Path) -> VmSpec | None:
    """The pool's spec an earlier runtime on ``state`` was claimed with and did not stop cleanly,
    or None (none there; unreadable or invalid, which is logged)."""
    path = state / FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("the pool's spec left in %s cannot be read (%s); this runtime takes the first spec it is "
                    "sent as the pool's", path, e.strerror or e)
        return None
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_BYTES + 1)
    try:
        if len(data) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object")
        spec = load_spec(raw, wire=True)
    except (ValueError, SpecError) as e:
        log.warning("the pool's spec left in %s is not a spec (%s); this runtime takes the first spec it is "
                    "sent as the pool's", path, str(e)[:300])
        return None
    log.info("holding to the pool's spec left in %s by a runtime killed mid-lease (snapshot_source %s); remove "
             "that file if the pool's configuration changed", path, spec.snapshot_source or "none")
    return spec


def forget(state: Path) -> None:
    """The runtime stops cleanly: no runtime after it is mid-lease."""
    (state / FILE_NAME).unlink(missing_ok=True)
