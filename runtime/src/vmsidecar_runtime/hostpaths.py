"""Which host paths an API caller may name: none, unless the administrator allows a directory.

A lease holder reaches the runtime only through its API (the exporter's drivers forward
``flash oci://…`` and the spec). The runtime runs with more rights than the lease holder (often
root), so a ``file:`` or ``oci-layout:`` reference, or a ``kernel``/``initrd`` path, sent over the
API would let the caller read any host file through the guest's disk. Paths are therefore taken
only from the runtime's own configuration (``--spec``, flags, ``VMSIDECAR_*``), or over the API
when they resolve inside a directory the administrator named with ``--allow-host-paths DIR``
(or ``VMSIDECAR_ALLOW_HOST_PATHS=DIR[:DIR…]``), e.g. a mounted image volume.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from vmsidecar_contract.errors import HostPathError
from vmsidecar_contract.spec import VmSpec

from .oci.reference import parse_reference

ENV = "VMSIDECAR_ALLOW_HOST_PATHS"
_FIX = ("stream the file instead (`j vm storage flash FILE`, `vmsidecar-runtime flash FILE`, PUT /v1/vm/disk), "
        "put the path in the runtime's own --spec, or start the runtime with --allow-host-paths DIR")


@dataclass(frozen=True)
class HostPathPolicy:
    """The directories under which API callers may name host paths (resolved, symlinks followed)."""

    roots: tuple[Path, ...] = ()

    @classmethod
    def from_sources(cls, dirs: Iterable[str] = (), env: Mapping[str, str] | None = None) -> HostPathPolicy:
        """Directories from ``--allow-host-paths`` flags plus ``VMSIDECAR_ALLOW_HOST_PATHS``."""
        env = os.environ if env is None else env
        named = [*dirs, *(d for d in env.get(ENV, "").split(":") if d)]
        return cls(tuple(Path(os.path.realpath(d)) for d in named))

    def check_path(self, path: Path | str, what: str) -> None:
        """Allow ``path`` only inside an allowed directory, after resolving ``..`` and symlinks.

        :raise HostPathError: naming the field and the ways out.
        """
        if "\0" in str(path):  # os.path.realpath raises ValueError on it
            raise HostPathError(f"{what} names a path with a NUL byte, which no file has; {_FIX}")
        real = Path(os.path.realpath(path))
        if any(real.is_relative_to(root) for root in self.roots):
            return
        where = (f"outside the allowed directories ({', '.join(map(str, self.roots))})" if self.roots
                 else "and the runtime allows no host paths over its API")
        raise HostPathError(f"{what} names the host path {str(path)!r} {where}; {_FIX}")

    def check_reference(self, reference: str, what: str = "the image reference", *,
                        look: bool = False) -> None:
        """Refuse ``file:`` and ``oci-layout:`` references outside the allowed directories. The host is
        not looked at to tell what the reference is unless ``look`` (``parse_reference``): the answer
        to a lease's flash must not say which host files exist.

        :raise HostPathError: for a host path that is not allowed.
        :raise BadReferenceError: for a reference that does not parse.
        """
        ref = parse_reference(reference, look=look)
        if ref.kind in ("file", "layout") and ref.path is not None:
            self.check_path(ref.path, what)

    def check_spec(self, spec: VmSpec, current: VmSpec | None) -> None:
        """Check every host path of a spec sent over the API.

        A path equal to the current spec's (which the administrator configured) is accepted: the
        exporter re-sends the spec of its own config, naming nothing new.

        :raise HostPathError: for a new host path that is not allowed.
        """
        if spec.image and spec.image != (current.image if current else None):
            # a spec comes from the exporter's config (no driver call sends one): its bare paths and
            # ~ read as a shell user's, where a lease's flash reference may not probe the host
            self.check_reference(spec.image, "image", look=True)
        for field in ("kernel", "initrd"):
            value = getattr(spec, field)
            if value is not None and value != (getattr(current, field) if current else None):
                self.check_path(value, field)
