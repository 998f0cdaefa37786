"""Readiness of one boot: a regex seen on the chosen console, or a timeout with the tail.

Which regex, console and timeout (the *effective* readiness) is decided per field: what the spec
sets, else what the image's ``io.vmsidecar.readiness.*`` annotations say, else the defaults of
:class:`~vmsidecar_contract.spec.Readiness` (our marker, a login prompt or a shell prompt). So a
guest built without vmsidecar in mind still becomes Ready, and a pool needs no per-image YAML.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from vmsidecar_contract.errors import GuestError, ImageError, SpecError, VmsidecarError
from vmsidecar_contract.spec import READINESS_ANNOTATIONS, Readiness, VmSpec, compile_readiness_pattern

from ..console import ConsoleHub
from ..disk import DiskImage

#: bytes of console output kept to match a pattern split across chunks: the regex (RE2, linear) runs
#: on this tail plus the new chunk, however long the guest has been printing
WINDOW = 4096

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


class ReadinessWatch:
    """Arms a watcher per boot; calls ``on_ready`` once, or ``on_error`` with the reason."""

    def __init__(self, on_ready: Callable[[], None], on_error: Callable[[VmsidecarError], None]) -> None:
        self._on_ready = on_ready
        self._on_error = on_error
        self._task: asyncio.Task[None] | None = None

    def arm(self, spec: VmSpec, hubs: dict[str, ConsoleHub], disk: DiskImage | None = None) -> None:
        """Start watching this boot of ``disk`` (an earlier watch is dropped)."""
        self.disarm()
        try:
            eff = effective_readiness(spec, disk)
        except ImageError as e:
            self._on_error(e)
            return
        readiness = eff.readiness
        if readiness.pattern is None:
            self._on_ready()
            return
        hub = hubs.get(readiness.console)
        if hub is None:
            self._on_error(SpecError(f"readiness console {readiness.console} (from the {eff.source}) is not "
                                     "enabled in the spec; enable virtio_console or watch ttyS0"))
            return
        self._task = asyncio.create_task(self._watch(hub, eff), name="readiness")

    def disarm(self) -> None:
        """Stop watching (the boot ended or a new one began)."""
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None

    async def _watch(self, hub: ConsoleHub, eff: EffectiveReadiness) -> None:
        readiness = eff.readiness
        assert readiness.pattern is not None
        # RE2: linear in the text, so no pattern (spec or image) can stall the loop on guest output
        try:
            pattern = compile_readiness_pattern(readiness.pattern)
        except ValueError as e:  # checked when the spec was read; a spec from before RE2 lands here
            self._on_error(SpecError(f"{e}; set readiness.pattern in RE2 syntax"))
            return
        seen = asyncio.Event()
        window = bytearray()

        def on_data(data: bytes) -> None:
            if seen.is_set():
                return
            # the tail of earlier output plus this chunk (the hub reads at most 64 KiB): a match split
            # across chunks is found, and each byte is searched at most WINDOW / chunk times over
            window.extend(data)
            if pattern.search(window):
                seen.set()
            del window[:-WINDOW]

        with hub.watch(on_data):
            try:
                await asyncio.wait_for(seen.wait(), readiness.timeout)
            except TimeoutError:
                tail = hub.tail(800).strip().replace("\r", "")
                self._on_error(GuestError(
                    f"the guest did not print {readiness.pattern!r} on {readiness.console} within "
                    f"{readiness.timeout:.0f} s (readiness from the {eff.source}; console tail: {tail[-400:]!r}); "
                    "check the image boots, or set readiness.pattern/timeout (spec, --ready-pattern, or the "
                    "image's io.vmsidecar.readiness.* annotations)"))
                return
        self._on_ready()
