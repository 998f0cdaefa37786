"""Bring your own guest through `scripts/pod up`: a containerDisk built by `podman build` and pushed
by `podman push` (not by vmsidecar-oci) becomes Ready in the pod — with the readiness the flags
give, the one the image's annotation gives, or the default — and the runtime says which."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from fixtures.byo import IMAGE_PATTERN, SPEC_PATTERN, Published, podman_containerdisk
from fixtures.ports import free_port
from vmsidecar_contract.spec import DEFAULT_READY_PATTERN

from .podman import Pod, run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

__all__ = ["podman_containerdisk"]  # a fixture, used by name


def _state(pod: Pod) -> dict[str, Any]:
    out = run("podman", "exec", f"{pod.name}-runtime", "/opt/vmsidecar/bin/vmsidecar-runtime", "status", "--json",
              "--socket", "/shared/vmsidecar/api.sock")
    return json.loads(out)


def test_pod_up_readiness_from_flags_image_and_default(images: Any, podman_containerdisk: Published,
                                                       pod: Pod) -> None:
    cases = [
        ("spec", podman_containerdisk.plain, ["--ready-pattern", SPEC_PATTERN, "--ready-timeout", "240"],
         SPEC_PATTERN),
        ("image", podman_containerdisk.annotated, [], IMAGE_PATTERN),
        ("default", podman_containerdisk.plain, [], DEFAULT_READY_PATTERN),
    ]
    for source, ref, flags, pattern in cases:
        started = pod.up("--image", ref, "--port", str(free_port()), "--memory", "256M", *flags)
        pod.wait_ready()
        state = _state(pod)
        print(f"\n{source}: kube play -> Ready in {time.monotonic() - started:.1f} s")
        assert state["phase"] == "Ready", pod.logs()
        assert (state["readiness_source"], state["readiness"]["pattern"]) == (source, pattern), state
        assert state["image"] == ref
        pod.down()
