"""What a spec sent over the API may not do that the runtime's own configuration may.

An API caller is a lease holder (docs/security.md): it may not add QEMU arguments, and it may name
only the host paths the administrator allowed. The runtime's own ``--spec`` file may do both.
"""

from __future__ import annotations

from vmsidecar_contract.errors import SpecError
from vmsidecar_contract.spec import VmSpec

from ..hostpaths import HostPathPolicy


def admit_api_spec(spec: VmSpec, current: VmSpec | None, *, host_paths: HostPathPolicy,
                   allow_extra_args: bool) -> None:
    """:raise SpecError: extra_args without ``--allow-extra-args``.
    :raise HostPathError: a new host path the administrator did not allow."""
    if spec.extra_args and not allow_extra_args:
        raise SpecError("extra_args may only be set by an administrator; start the runtime with "
                        "--allow-extra-args or put them in the runtime's own --spec file")
    host_paths.check_spec(spec, current)
