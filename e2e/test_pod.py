"""Whole system: both images built from a local Debian base, a real registry, `podman kube play`
of container/pod.yaml, and `jmp` from the host — standalone, and through real leases for both
recycle strategies."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.jmp import PIPE_UNTIL, free_port, jmp_env
from vmsidecar_runtime.oci import push_artifact

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "container" / "containers.conf")}
VM_TYPE = "jumpstarter_driver_vmsidecar.driver.VirtualMachine"


def _run(*argv: str, timeout: float = 900) -> str:
    result = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{argv}: {result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    started = time.monotonic()
    names = _run("scripts/build-images").split()
    sizes = {n: json.loads(_run("podman", "image", "inspect", n))[0]["Size"] for n in names}
    print(f"\nimages built/reused in {time.monotonic() - started:.0f} s: "
          + ", ".join(f"{n} {s / 1e6:.0f} MB" for n, s in sizes.items()))
    return {"runtime": names[0], "exporter": names[1]}


@pytest.fixture(scope="module")
def published(registry: Any, tiny_image: Any, tiny_b_image: Any) -> dict[str, str]:
    refs = {"tiny": f"{registry.host}/vm/tiny:e2e", "tiny-b": f"{registry.host}/vm/tiny-b:e2e"}
    push_artifact(tiny_image.disk, refs["tiny"])
    push_artifact(tiny_b_image.disk, refs["tiny-b"])
    return refs


class Pod:
    def __init__(self, name: str) -> None:
        self.name = name

    def up(self, *args: str) -> float:
        started = time.monotonic()
        _run("scripts/pod", "up", "--name", self.name, "--host-network", *args)
        return started

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            probe = subprocess.run(["podman", "exec", f"{self.name}-runtime", "/opt/vmsidecar/bin/vmsidecar-runtime",
                                    "ready", "--quiet", "--socket", "/shared/vmsidecar/api.sock"], env=ENV,
                                   capture_output=True)
            if probe.returncode == 0:
                return
            time.sleep(0.5)
        raise AssertionError(f"pod {self.name} not Ready:\n{self.logs()}")

    def state(self, container: str) -> dict[str, Any]:
        return json.loads(_run("podman", "inspect", f"{self.name}-{container}"))[0]["State"]

    def wait_exited(self, container: str, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(container)
            if state["Status"] in ("exited", "stopped"):
                return int(state["ExitCode"])
            time.sleep(0.5)
        raise AssertionError(f"{self.name}-{container} still running:\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for c in ("runtime", "exporter"):
            r = subprocess.run(["podman", "logs", "--tail", "30", f"{self.name}-{c}"], env=ENV, capture_output=True,
                               text=True)
            out.append(f"--- {c}\n{r.stdout[-2500:]}{r.stderr[-2500:]}")
        return "\n".join(out)

    def down(self) -> None:
        _run("scripts/pod", "down", "--name", self.name)
        left = _run("podman", "ps", "-a", "--filter", f"pod={self.name}", "--format", "{{.Names}}").split()
        assert left == [], left


@pytest.fixture
def pod(request: pytest.FixtureRequest) -> Iterator[Pod]:
    p = Pod(f"vms-e2e-{request.node.name.split('[')[0][-12:].strip('_').replace('_', '-')}")
    yield p
    subprocess.run(["scripts/pod", "down", "--name", p.name], cwd=ROOT, env=ENV, capture_output=True)


def test_standalone_pod_from_the_host(images: Any, published: dict[str, str], pod: Pod, tmp_path: Path) -> None:
    port = free_port()
    started = pod.up("--image", published["tiny"], "--port", str(port), "--memory", "256M")
    pod.wait_ready()
    print(f"\nkube play -> Ready: {time.monotonic() - started:.1f} s")
    script = PIPE_UNTIL + f"""
j vm power on
pipe_until 'VMSIDECAR-READY image=tiny ' boot.txt
pipe_until 'pod-42-works' cmd.txt '\\necho pod-$((6*7))-works\\n'
j vm storage flash oci://{published['tiny-b']}
j vm power on
pipe_until 'VMSIDECAR-READY image=tiny-b' flashed.txt
j vm power off
j vm power read
"""
    result = subprocess.run(["jmp", "shell", "--tls-grpc", f"127.0.0.1:{port}", "--tls-grpc-insecure", "--",
                             "bash", "-c", f"set -euo pipefail\n{script}"], cwd=tmp_path, env=jmp_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + pod.logs()
    assert "voltage=0.0" in result.stdout
    pod.down()  # kube down leaves nothing running
    assert subprocess.run(["pgrep", "-f", f"/tmp/vmsidecar-.*{pod.name}"], capture_output=True).returncode != 0


def _controller_config(jmpctl: Any, published: dict[str, str], recycle: str, tmp_path: Path) -> Path:
    spec = {"image": published["tiny"], "memory": "256M"}
    return jmpctl.exporter_config({"vm": {"type": VM_TYPE, "config": {
        "socket": "/shared/vmsidecar/api.sock", "recycle": recycle, "spec": spec}}})


def test_pod_exit_and_replace(images: Any, published: dict[str, str], pod: Pod, jmpctl: Any, tmp_path: Path) -> None:
    pod.up("--exporter-config", str(_controller_config(jmpctl, published, "ExitAndReplace", tmp_path)))
    jmpctl.wait_status("vm", "AVAILABLE", 120)
    pod.wait_ready()
    with jmpctl.lease("vm") as lease:
        result = subprocess.run(lease.argv("j", "vm", "power", "read"), env=lease.env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:] + pod.logs()
    released = lease.released_at
    assert pod.wait_exited("exporter") == 0, pod.logs()
    assert pod.wait_exited("runtime") == 0, pod.logs()
    print(f"\nExitAndReplace in a pod: release -> both containers exited 0 in {time.monotonic() - released:.1f} s")
    pod.down()


def test_pod_in_place_reuse(images: Any, published: dict[str, str], pod: Pod, jmpctl: Any, tmp_path: Path) -> None:
    pod.up("--exporter-config", str(_controller_config(jmpctl, published, "InPlaceReuse", tmp_path)))
    jmpctl.wait_status("vm", "AVAILABLE", 120)
    pod.wait_ready()
    lease_one = PIPE_UNTIL + r"""
pipe_until 'secret-2-written' one.txt '\necho lease1-secret > /data/secret; sync; echo secret-$((1+1))-written\n'
"""
    lease_two = PIPE_UNTIL + r"""
pipe_until 'VMSIDECAR-READY' boot2.txt   # the recycled guest's own boot (scrollback was cleared)
pipe_until 'check-4-done' two.txt '\nls /data/secret; echo check-$((2+2))-done\n'
"""
    for script in (lease_one, lease_two):
        with jmpctl.lease("vm") as lease:
            result = subprocess.run(lease.argv("bash", "-c", f"set -euo pipefail\ncd {tmp_path}\n{script}"),
                                    env=lease.env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr[-2000:] + pod.logs()
    check = (tmp_path / "two.txt").read_text(errors="replace")
    assert "No such file or directory" in check and "lease1-secret" not in check
    assert pod.state("exporter")["Status"] == "running" and pod.state("runtime")["Status"] == "running"
    pod.down()
