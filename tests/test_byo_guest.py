"""Bring your own guest: a disk published by podman or skopeo (not vmsidecar-oci) becomes Ready,
and ``GET /v1/vm`` says where its readiness came from — the spec (``--ready-pattern``), the
image's ``io.vmsidecar.readiness.pattern`` annotation, or the default.

Real runtime processes, real QEMU (TCG), a real registry; the guest is the tiny guest's disk,
which prints ``VMSIDECAR-READY image=tiny …`` and then its shell prompt ``vm# `` on ttyS0. A guest
that knows nothing of vmsidecar (the tiny kernel and initramfs with ``rdinit=/bin/sh``: a bare
shell, no marker) becomes Ready on the default pattern too, and so does the systemd Debian guest
with vmsidecar's marker service masked (its serial getty's login prompt).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from fixtures.byo import (
    IMAGE_PATTERN,
    SPEC_PATTERN,
    Published,
    podman_containerdisk,
    podman_published,
    skopeo_artifact,
    skopeo_published,
)
from fixtures.images import DEBIAN_FAST_CPU
from vmsidecar_contract.spec import DEFAULT_READY_PATTERN, READY_MARKER
from vmsidecar_images.console import Console

__all__ = ["podman_containerdisk", "skopeo_artifact"]  # fixtures, used by name

#: source -> (tag, runtime flags, the effective pattern GET /v1/vm must report)
CASES = {
    "spec": ("plain", ["--ready-pattern", SPEC_PATTERN], SPEC_PATTERN),
    "image": ("annotated", [], IMAGE_PATTERN),
    "default": ("plain", [], DEFAULT_READY_PATTERN),
    "spec over image": ("annotated", ["--ready-pattern", SPEC_PATTERN, "--ready-timeout", "200"], SPEC_PATTERN),
}


def _published(request: pytest.FixtureRequest, publisher: str) -> Published:
    return request.getfixturevalue({"podman": "podman_containerdisk", "skopeo": "skopeo_artifact"}[publisher])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("publisher", ["podman", "skopeo"])
async def test_published_guest_is_ready_and_names_its_readiness_source(
    publisher: str, case: str, request: pytest.FixtureRequest, start_runtime: Any
) -> None:
    tag, flags, pattern = CASES[case]
    ref = getattr(_published(request, publisher), tag)
    rt = await start_runtime({"memory": "256M", "snapshot": "off"}, extra_args=["--image", ref, *flags])
    client = rt.client()
    state = await client.wait_ready(180)
    assert state.readiness_source == case.split()[0], state
    assert state.readiness is not None and state.readiness.pattern == pattern
    assert state.readiness.console == "ttyS0"
    assert state.readiness.timeout == (200 if "--ready-timeout" in flags else 300)
    assert state.image == ref and state.image_digest
    assert rt.log_text().count("phase Running -> Ready") == 1, rt.log_text()[-2000:]


async def test_a_guest_that_knows_nothing_of_vmsidecar_is_ready_on_the_default(
    start_runtime: Any, tiny_image: Any
) -> None:
    # the tiny kernel and initramfs, but PID 1 is a bare busybox shell: no rcS, no marker, no getty
    spec = {"image": f"file:{tiny_image.disk}", "kernel": str(tiny_image.kernel), "initrd": str(tiny_image.initrd),
            "cmdline": "console=ttyS0 rdinit=/bin/sh", "memory": "256M", "snapshot": "off"}
    rt = await start_runtime(spec)
    state = await rt.client().wait_ready(180)
    assert state.readiness is not None
    assert (state.readiness_source, state.readiness.pattern) == ("default", DEFAULT_READY_PATTERN)
    seen = await _scrollback(rt.shared / "console.sock")
    assert READY_MARKER.encode() not in seen
    assert re.search(rb"\n/ # ", seen), seen[-300:]  # busybox ash's prompt
    await rt.client().power("off", graceful=False)  # a bare shell ignores the ACPI button


@pytest.mark.timeout(900)
async def test_a_systemd_debian_guest_from_podman_and_skopeo(
    debian_image: Any, registry: Any, start_runtime: Any, tmp_path: Path
) -> None:
    # 1. podman containerDisk, no annotation, vmsidecar's marker service masked: a systemd guest
    #    that prints nothing of vmsidecar is Ready on the default (its serial getty)
    (tmp_path / "cd").mkdir()
    with podman_published(debian_image.disk, registry, "byo/debian-podman", tmp_path / "cd") as podman:
        spec = {"image": podman.plain, "memory": "1G", "cpu": DEBIAN_FAST_CPU, "snapshot": "off", "kernel": str(debian_image.kernel),
                "initrd": str(debian_image.initrd),
                "cmdline": debian_image.manifest["cmdline"] + " systemd.mask=vmsidecar-ready.service"}
        rt = await start_runtime(spec, name="podman")
        state = await rt.client().wait_ready(600)
        assert state.readiness is not None
        assert (state.readiness_source, state.readiness.pattern) == ("default", DEFAULT_READY_PATTERN)
        seen = await _scrollback(rt.shared / "console.sock")
        assert READY_MARKER.encode() not in seen and b"login: " in seen, seen[-500:]
        rt.stop()

    # 2. skopeo index artifact whose index entry names the getty's autologin line: the disk boots
    #    as it is (BIOS, its own boot loader) and is Ready on what the image says
    pattern = r"login: root \(automatic login\)"
    skopeo = skopeo_published(debian_image.disk, registry, "byo/debian-skopeo", tmp_path / "layout", pattern)
    rt = await start_runtime({"image": skopeo.annotated, "memory": "1G", "cpu": DEBIAN_FAST_CPU, "snapshot": "off"}, name="skopeo")
    state = await rt.client().wait_ready(600)
    assert state.readiness is not None
    assert (state.readiness_source, state.readiness.pattern) == ("image", pattern)


async def _scrollback(socket: Path) -> bytes:
    """This boot's output on a console (a new client is sent the scrollback first)."""
    console = await Console.open(socket)
    try:
        await console.drain_replay()
    finally:
        await console.close()
    return bytes(console.seen)
