"""Whole system: both images built from a local Debian base, a real registry, `podman kube play`
of container/pod.yaml, and `jmp` from the host — standalone, and through real leases for both
recycle strategies."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.jmp import PIPE_UNTIL, VM_TYPE, jmp_env
from fixtures.ports import free_port

from .podman import ENV, ROOT, Pod, run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]


def test_standalone_pod_from_the_host(images: Any, published: dict[str, str], pod: Pod, tmp_path: Path) -> None:
    port = free_port()
    started = pod.up("--image", published["tiny"], "--port", str(port), "--memory", "256M")
    pod.wait_ready()
    print(f"\nkube play -> Ready: {time.monotonic() - started:.1f} s")
    _check_least_privilege(pod)
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


def _check_least_privilege(pod: Pod) -> None:
    """pod.yaml's securityContext holds for every process, QEMU adds its own seccomp filter and runs
    in its Landlock domain, the root filesystem is read-only, and the sockets are the runtime user's
    0660 (docs/security.md)."""
    least = {"Uid": "\t".join(["65532"] * 4), "Gid": "\t".join(["65532"] * 4), "CapEff": "0" * 16,
             "NoNewPrivs": "1", "Seccomp": "2"}
    for container in ("runtime", "exporter"):
        processes = pod.processes(container)
        assert processes and all(p | least == p for p in processes), processes
    runtime = pod.processes("runtime")
    [qemu] = [p for p in runtime if p["argv0"].startswith("qemu-system")]
    container_filters = min(int(p["Seccomp_filters"]) for p in runtime if p is not qemu)  # the runtime's own
    assert int(qemu["Seccomp_filters"]) > container_filters, runtime  # QEMU's -sandbox on top of the pod's
    # and QEMU is in its Landlock domain: the pod's seccomp profile let the runtime make the ruleset
    log = subprocess.run(["podman", "logs", f"{pod.name}-runtime"], env=ENV, capture_output=True, text=True)
    assert "starting qemu-system" in log.stdout + log.stderr  # (the whole log, from its start)
    assert "without a Landlock domain" not in log.stdout + log.stderr, log.stderr[-3000:]
    for container in ("runtime", "exporter"):
        touched = subprocess.run(["podman", "exec", f"{pod.name}-{container}", "touch", "/probe"], env=ENV,
                                 capture_output=True, text=True)
        assert touched.returncode != 0 and "Read-only file system" in touched.stderr, touched.stderr
    sockets = run("podman", "exec", f"{pod.name}-exporter", "stat", "-c", "%a %u %n", "/shared/vmsidecar",
                  "/shared/vmsidecar/api.sock", "/shared/vmsidecar/console.sock").splitlines()
    assert [s.split()[:2] for s in sockets] == [["2770", "65532"], ["660", "65532"], ["660", "65532"]], sockets


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


def test_up_never_replaces_a_pod_of_its_name(pod: Pod) -> None:
    """A second `up` (or one after a run stopped before its `down`) says what to do, and leaves the pod
    it found alone: someone may be in a shell on it."""
    run("podman", "pod", "create", "--name", pod.name)
    refused = subprocess.run(["scripts/pod", "up", "--name", pod.name, "--image", "127.0.0.1:1/vm/none:1"],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1, refused.stderr
    assert f"a pod named {pod.name} exists already" in refused.stderr, refused.stderr
    assert f"scripts/pod down --name {pod.name} first" in refused.stderr, refused.stderr
    assert subprocess.run(["podman", "pod", "exists", pod.name], env=ENV).returncode == 0
