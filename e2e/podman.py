"""Helpers for the e2e tests: podman with the project's containers.conf, and a pod handle."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from fixtures.ports import free_port
from fixtures.waiting import wait_until

ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "container" / "containers.conf")}


def run(*argv: str, timeout: float = 900, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(argv, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{argv}: {result.stderr[-3000:]}"
    return result.stdout


#: run in a container (``python3 -c``): who each process runs as and how it is confined
PROCESSES = """
import json, os
found = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        lines = open(f"/proc/{pid}/status").read().splitlines()
        argv0 = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")[0].decode()
    except OSError:
        continue
    status = {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}
    keys = ("Uid", "Gid", "Groups", "CapEff", "NoNewPrivs", "Seccomp", "Seccomp_filters")
    found.append({"argv0": os.path.basename(argv0), **{k: status.get(k, "") for k in keys}})
print(json.dumps(found))
"""


class Pod:
    def __init__(self, name: str) -> None:
        self.name = name

    def processes(self, container: str) -> list[dict[str, str]]:
        """Every process in a container with its /proc status: Uid, Gid, Groups, CapEff, NoNewPrivs,
        Seccomp, Seccomp_filters."""
        return json.loads(run("podman", "exec", f"{self.name}-{container}", "python3", "-c", PROCESSES))

    def up(self, *args: str) -> float:
        started = time.monotonic()
        # the test registry on the host's loopback speaks plain HTTP: configured as insecure on purpose
        hosts = [h for h in os.environ.get("VMSIDECAR_INSECURE_REGISTRIES", "").split(",") if h]
        insecure = [arg for h in hosts for arg in ("--insecure-registry", h)]
        # the host's network: a free loopback port for the health listener, as for the exporter's
        with tempfile.TemporaryDirectory(prefix="vms-e2e-tmp-") as scratch:
            run("scripts/pod", "up", "--name", self.name, "--host-network", "--health-port", str(free_port()),
                *insecure, *args, env={**ENV, "TMPDIR": scratch})
            # what `up` renders goes to podman, not into a file that outlives the pod
            assert os.listdir(scratch) == [], f"scripts/pod up left {os.listdir(scratch)} in TMPDIR"
        return started

    def wait_ready(self, timeout: float = 300) -> None:
        def ready() -> bool:
            probe = subprocess.run(["podman", "exec", f"{self.name}-runtime", "/opt/vmsidecar/bin/vmsidecar-runtime",
                                    "ready", "--quiet", "--socket", "/shared/vmsidecar/api.sock"], env=ENV,
                                   capture_output=True)
            return probe.returncode == 0

        wait_until(ready, timeout, f"pod {self.name} to be Ready", interval=0.5, detail=self.logs)

    def state(self, container: str) -> dict[str, Any]:
        return json.loads(run("podman", "inspect", f"{self.name}-{container}"))[0]["State"]

    def wait_exited(self, container: str, timeout: float = 120) -> int:
        def exited() -> dict[str, Any] | None:
            state = self.state(container)
            return state if state["Status"] in ("exited", "stopped") else None

        state = wait_until(exited, timeout, f"{self.name}-{container} to exit", interval=0.5, detail=self.logs)
        return int(state["ExitCode"])

    def logs(self) -> str:
        out = []
        for c in ("runtime", "exporter"):
            r = subprocess.run(["podman", "logs", "--tail", "30", f"{self.name}-{c}"], env=ENV, capture_output=True,
                               text=True)
            out.append(f"--- {c}\n{r.stdout[-2500:]}{r.stderr[-2500:]}")
        return "\n".join(out)

    def down(self) -> None:
        run("scripts/pod", "down", "--name", self.name)
        left = run("podman", "ps", "-a", "--filter", f"pod={self.name}", "--format", "{{.Names}}").split()
        assert left == [], left
        # its emptyDirs, cache and config are podman volumes named after it: none may outlive it
        volumes = [v for v in run("podman", "volume", "ls", "--format", "{{.Name}}").split()
                   if v.startswith(f"{self.name}-")]
        assert volumes == [], volumes


