"""Which readiness a boot of an image is held to (the *effective* readiness), decided per field:
what the spec sets, else what the image's ``io.vmsidecar.readiness.*`` annotations say, else the
defaults of :class:`~vmsidecar_contract.spec.Readiness` (our marker, a login prompt or a shell
prompt). So a guest built without vmsidecar in mind still becomes Ready, and a pool needs no
per-image YAML. The controller watches for it (``controller/readiness.py``); a snapshot's key holds
it (``snapshot_identity.py``), since it decides the instant a snapshot is taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from vmsidecar_contract.errors import ImageError
from vmsidecar_contract.spec import READINESS_ANNOTATIONS, Readiness, VmSpec

from .disk import DiskImage

Source = Literal["spec", "image", "default"]


@dataclass(frozen=True)
class EffectiveReadiness:
    """The readiness a boot is held to, and where its pattern came from."""

    readiness: Readiness
    source: Source


def _from_annotations(annotations: Mapping[str, str], where: str, skip: set[str]) -> dict[str, Any]:
    """The readiness fields an image's annotations set, but those in ``skip`` (validated as a
    spec's would be; an annotation the spec overrides cannot break a boot).

    :raise ImageError: (``bad_readiness``) an annotation that is not a valid value.
    """
    fields = {name: annotations[key] for name, key in READINESS_ANNOTATIONS.items()
              if key in annotations and name not in skip}
    try:
        Readiness.model_validate(fields)
    except ValidationError as e:
        problems = "; ".join(f"{READINESS_ANNOTATIONS.get(str(err['loc'][0]), err['loc'][0])}: "
                             f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors())
        raise ImageError(f"image {where} has invalid readiness annotations ({problems}); fix them and push "
                         "the image again, or set readiness in the spec", code="bad_readiness") from None
    return fields


def effective_readiness(spec: VmSpec, disk: DiskImage | None) -> EffectiveReadiness:
    """The spec's readiness fields, else the image's annotations, else the defaults.

    :raise ImageError: (``bad_readiness``) the image's annotations are invalid and the spec does
        not override every field they set.
    """
    own = spec.readiness.model_fields_set
    image: dict[str, Any] = {}
    if disk is not None and disk.annotations:
        image = _from_annotations(disk.annotations, disk.source, own)
    merged = Readiness.model_validate({**image, **spec.readiness.model_dump(include=own)})
    source: Source = "spec" if "pattern" in own else "image" if "pattern" in image else "default"
    return EffectiveReadiness(merged, source)


def readiness_state(spec: VmSpec | None, disk: DiskImage | None) -> dict[str, Any]:
    """``readiness`` and ``readiness_source`` of ``GET /v1/vm``: unknown (None) while the image
    that could still set the pattern is not pulled, or when its annotations are invalid."""
    if spec is None or (disk is None and "pattern" not in spec.readiness.model_fields_set):
        return {}
    try:
        eff = effective_readiness(spec, disk)
    except ImageError:
        return {}
    return {"readiness": eff.readiness, "readiness_source": eff.source}
