"""Our images in the pod upstream's `qemu.jumpstarter.dev` provisioner renders today
(upstream JEP-0014, as described in docs/containers.md): an init container copies
/jumpstarter/bin/jumpstarter-exec out of the exporter image; the runtime image runs its
ENTRYPOINT with no arguments as UID 0; the exporter runs `jmp run --exporter-config …` as UID
65532; the only shared volume is a 100Mi emptyDir at /shared; no fsGroup. Differences here,
forced by podman 4.3 and the in-test controller: the runtime is a plain container (no native
sidecars), the config Secret is a ConfigMap, and the pod uses the host network to reach the
controller on the host's loopback."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.jmp import PIPE_UNTIL, VM_TYPE

from .podman import ENV, Pod

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _render(name: str, images: dict[str, str], config: Path) -> str:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"exporter-config-{name}"},
          "data": {"config.yaml": config.read_text()}}
    shared = {"name": "shared", "mountPath": "/shared"}
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"exporterset.jumpstarter.dev/name": "tiny"}},
        "spec": {
            "restartPolicy": "Never",
            "hostNetwork": True,
            "initContainers": [{"name": "copy-jumpstarter-exec", "image": images["exporter"],
                                "command": ["cp", "/jumpstarter/bin/jumpstarter-exec", "/shared/jumpstarter-exec"],
                                "volumeMounts": [shared]}],
            "containers": [
                {"name": "runtime", "image": images["runtime"],
                 "securityContext": {"runAsUser": 0, "runAsNonRoot": False},
                 "env": [{"name": "JUMPSTARTER_EXEC_LOG_FIELDS",
                          "value": f"component=exporter,exporter={name},namespace=default"},
                         # the test registry on the host's loopback speaks plain HTTP: named on purpose
                         # (a pool's registry speaks HTTPS and needs nothing here)
                         {"name": "VMSIDECAR_INSECURE_REGISTRIES",
                          "value": os.environ.get("VMSIDECAR_INSECURE_REGISTRIES", "")}],
                 "volumeMounts": [shared]},
                {"name": "exporter", "image": images["exporter"],
                 "command": ["jmp", "run", "--exporter-config", "/etc/jumpstarter/exporters/config.yaml"],
                 "securityContext": {"runAsUser": 65532, "runAsNonRoot": True},
                 "env": [{"name": "JUMPSTARTER_LAUNCHER_SOCKET", "value": "/shared/launcher.sock"}],
                 "volumeMounts": [shared, {"name": "exporter-credentials", "mountPath": "/etc/jumpstarter/exporters",
                                           "readOnly": True}]},
            ],
            "volumes": [{"name": "shared", "emptyDir": {"sizeLimit": "100Mi"}},
                        {"name": "exporter-credentials", "configMap": {"name": f"exporter-config-{name}"}}],
        },
    }
    return yaml.safe_dump_all([cm, pod])


def _exec(pod: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", "exec", pod, *argv], env=ENV, capture_output=True, text=True, timeout=60)


def test_upstream_provisioner_pod_shape(images: dict[str, str], published: dict[str, str], jmpctl: Any,
                                        tmp_path: Path) -> None:
    name = "vms-e2e-upstream"
    spec = {"image": published["tiny"], "memory": "256M"}
    config = jmpctl.exporter_config({"vm": {"type": VM_TYPE, "config": {
        "socket": "/shared/vmsidecar/api.sock", "recycle": "ExitAndReplace", "spec": spec}}})
    manifest = tmp_path / "upstream-pod.yaml"
    manifest.write_text(_render(name, images, config))
    pod = Pod(name)
    # podman 4.3 plays an emptyDir as a named volume called by the volume's name ("shared"), kept after
    # the pod: remove it, and the config map's volume, before and after, so the pod starts empty; a run
    # killed mid-test leaves its pod too (a container stuck "stopping"), which kube play would refuse
    volumes = ["shared", f"exporter-config-{name}"]
    subprocess.run(["podman", "pod", "rm", "-f", "--ignore", name], env=ENV, capture_output=True, timeout=120)
    subprocess.run(["podman", "volume", "rm", "-f", *volumes], env=ENV, capture_output=True, timeout=60)
    try:
        started = time.monotonic()
        subprocess.run(["podman", "kube", "play", "--quiet", str(manifest)], env=ENV, check=True, capture_output=True)
        jmpctl.wait_status("vm", "AVAILABLE", 180)  # the runtime started bare and got its spec from the driver
        pod.wait_ready()
        print(f"\nupstream pod shape: kube play -> Ready {time.monotonic() - started:.1f} s")

        listing = _exec(f"{name}-runtime", "stat", "-c", "%a %u %n", "/shared/vmsidecar/api.sock",
                        "/shared/vmsidecar/console.sock", "/shared/vmsidecar").stdout.split("\n")
        assert listing[0].startswith("660 65532 ") and listing[1].startswith("660 65532 "), listing  # not 0666
        # the directory stays root's: the exporter's user connects, but writes nothing there (security.md, row 54)
        assert listing[2].startswith("755 0 "), listing
        refused = _exec(f"{name}-exporter", "/shared/jumpstarter-exec", "exec", "--", "id")
        assert refused.returncode == 1 and "runs no commands on request" in refused.stderr

        with jmpctl.lease("vm") as lease:
            script = PIPE_UNTIL + "j vm power on\npipe_until 'VMSIDECAR-READY image=tiny ' boot.txt\n"
            result = subprocess.run(lease.argv("bash", "-c", f"set -euo pipefail\ncd {tmp_path}\n{script}"),
                                    env=lease.env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr[-2000:] + pod.logs()
        assert pod.wait_exited("exporter") == 0, pod.logs()
        assert pod.wait_exited("runtime") == 0, pod.logs()
    finally:
        subprocess.run(["podman", "kube", "down", str(manifest)], env=ENV, capture_output=True, timeout=120)
        subprocess.run(["podman", "volume", "rm", "-f", *volumes], env=ENV, capture_output=True, timeout=60)
    left = subprocess.run(["podman", "ps", "-a", "--filter", f"pod={name}", "--format", "{{.Names}}"], env=ENV,
                          capture_output=True, text=True).stdout.split()
    assert left == [], left
