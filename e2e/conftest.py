"""Fixtures of the e2e tests: the images (built once), guests published to the registry, pods."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from vmsidecar_runtime.oci import push_artifact

from .podman import ENV, ROOT, Pod, run


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    started = time.monotonic()
    names = run("scripts/build-images").split()
    sizes = {n: json.loads(run("podman", "image", "inspect", n))[0]["Size"] for n in names}
    print(f"\nimages built/reused in {time.monotonic() - started:.0f} s: "
          + ", ".join(f"{n} {s / 1e6:.0f} MB" for n, s in sizes.items()))
    return {"runtime": names[0], "exporter": names[1]}


@pytest.fixture(scope="module")
def published(registry: Any, tiny_image: Any, tiny_b_image: Any) -> dict[str, str]:
    refs = {"tiny": f"{registry.host}/vm/tiny:e2e", "tiny-b": f"{registry.host}/vm/tiny-b:e2e"}
    push_artifact(tiny_image.disk, refs["tiny"])
    push_artifact(tiny_b_image.disk, refs["tiny-b"])
    return refs


@pytest.fixture
def pod(request: pytest.FixtureRequest) -> Iterator[Pod]:
    p = Pod(f"vms-e2e-{request.node.name.split('[')[0][-12:].strip('_').replace('_', '-')}")
    # a run killed mid-test leaves its pod, which `up` refuses to replace: remove it first
    subprocess.run(["scripts/pod", "down", "--name", p.name], cwd=ROOT, env=ENV, capture_output=True)
    yield p
    subprocess.run(["scripts/pod", "down", "--name", p.name], cwd=ROOT, env=ENV, capture_output=True)


