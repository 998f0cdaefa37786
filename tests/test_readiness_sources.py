"""Readiness from every entry point, with the same names: spec file, ``VMSIDECAR_READY_*``,
``vmsidecar-runtime serve --ready-*``, ``vmsidecar-shell --ready-*``, ``scripts/pod --ready-*``; the
default pattern against what real guests print; "says nothing" versus ``pattern: null``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.jmp import exporter_config
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.spec import (
    DEFAULT_READY_PATTERN,
    READY_MARKER,
    VmSpec,
    compile_readiness_pattern,
    load_spec,
    spec_from_sources,
)
from vmsidecar_runtime.disk import DiskImage
from vmsidecar_runtime.readiness_rules import effective_readiness
from vmsidecar_runtime.snapshots import snapshot_key

ROOT = Path(__file__).parents[1]

#: what guests print on a serial console when they are up (the end of the output so far)
MEETS_DEFAULT = {
    "agetty (Debian, systemd)": b"\r\nDebian GNU/Linux 12 debian ttyS0\r\n\r\ndebian login: ",
    "agetty with autologin": b"debian login: root (automatic login)\r\n\r\nLinux debian 6.1.0\r\n",
    "busybox getty (Alpine)": b"\r\nWelcome to Alpine Linux 3.19\r\nKernel 6.6 on an x86_64 (/dev/ttyS0)\r\n\r\n"
                              b"localhost login: ",
    "Fedora": b"\r\nFedora Linux 39 (Cloud Edition)\r\nKernel 6.5 on an x86_64 (ttyS0)\r\n\r\nlocalhost login: ",
    "bash root prompt with bracketed paste": b"\r\n\x1b[?2004hroot@debian:~# ",
    "busybox ash asking the terminal size": b"/bin/sh: can't access tty; job control turned off\r\n/ # \x1b[6n",
    "user shell": b"\r\n[user@fedora ~]$ ",
    "the tiny guest": b"VMSIDECAR-READY image=tiny uptime=3.1 boot=x\r\n",
}
#: output on the way up (or of a boot that failed) that must not count as Ready
MISSES_DEFAULT = {
    "SMP bring-up": b"[    0.1] smp: Bringing up secondary CPUs ...\r\n .... node  #0, CPUs:      #1 ",
    "logind starting": b"         Starting systemd-logind.service - User Login Management...\r\n",
    "dracut emergency shell": b"\r\nGenerating \"/run/initramfs/rdsosreport.txt\"\r\n\r\ndracut:/# ",
    "initramfs-tools shell": b"ALERT!  UUID=766d does not exist.  Dropping to a shell!\r\n(initramfs) ",
    "systemd emergency mode": b"Give root password for maintenance\r\n(or press Control-D to continue): ",
    "a prompt followed by output": b"vm# ls\r\nbin  etc\r\n",
}


@pytest.mark.parametrize("guest", list(MEETS_DEFAULT))
def test_the_default_meets_ordinary_guests(guest: str) -> None:
    assert compile_readiness_pattern(DEFAULT_READY_PATTERN).search(MEETS_DEFAULT[guest])


@pytest.mark.parametrize("output", list(MISSES_DEFAULT))
def test_the_default_does_not_fire_early_or_on_a_failed_boot(output: str) -> None:
    assert not compile_readiness_pattern(DEFAULT_READY_PATTERN).search(MISSES_DEFAULT[output])


def test_says_nothing_is_not_null() -> None:
    nothing, null, empty = load_spec({}), load_spec({"readiness": {"pattern": None}}), load_spec(
        {"readiness": {"pattern": ""}})
    assert nothing.readiness.pattern == DEFAULT_READY_PATTERN and READY_MARKER in DEFAULT_READY_PATTERN
    assert nothing.readiness.model_fields_set == set()
    assert null.readiness.pattern is None and null.readiness.model_fields_set == {"pattern"}
    assert empty.readiness == null.readiness  # an empty pattern means null
    # a spec that spells out the default value still *says* it: it wins over the image
    spelled = load_spec({"readiness": {"pattern": DEFAULT_READY_PATTERN}})
    assert spelled != nothing and hash(spelled.readiness) != hash(nothing.readiness)
    image = DiskImage(Path("/d"), "qcow2", "sha256:0", "reg/x:1", {"io.vmsidecar.readiness.pattern": "up"})
    assert effective_readiness(nothing, image).source == "image"
    assert effective_readiness(spelled, image).source == "spec"
    assert effective_readiness(null, image).readiness.pattern is None


def test_the_wire_form_keeps_unset_fields_unset() -> None:
    spec = load_spec({"image": "reg/x:1", "readiness": {"timeout": 90}})
    wire = spec.to_json()
    assert wire["readiness"] == {"timeout": 90.0}
    again = VmSpec.model_validate(json.loads(json.dumps(wire)))
    assert again == spec and again.readiness.model_fields_set == {"timeout"}
    assert load_spec({"image": "reg/x:1"}).to_json()["readiness"] == {}


def test_file_env_json_and_flags_merge_field_by_field(tmp_path: Path) -> None:
    f = tmp_path / "spec.yaml"
    f.write_text("image: file:/a.qcow2\nreadiness: {pattern: from-file, timeout: 10}\n")
    spec = spec_from_sources(f, {"readiness": {"timeout": 30}}, env={
        "VMSIDECAR_READY_CONSOLE": "hvc0", "VMSIDECAR_READY_TIMEOUT": "20",
        "VMSIDECAR_SPEC_JSON": '{"readiness": {"pattern": "from-json"}}'})
    assert (spec.readiness.pattern, spec.readiness.console, spec.readiness.timeout) == ("from-json", "hvc0", 30)
    # an empty VMSIDECAR_READY_PATTERN is a value (Ready when the guest runs); other empty ones are unset
    spec = spec_from_sources(None, env={"VMSIDECAR_READY_PATTERN": "", "VMSIDECAR_READY_TIMEOUT": ""})
    assert spec.readiness.pattern is None and spec.readiness.model_fields_set == {"pattern"}
    assert spec_from_sources(None, env={}).readiness.model_fields_set == set()


def test_snapshot_key_covers_the_effective_readiness() -> None:
    spec = load_spec({"image": "reg/x:1"})
    from_image = effective_readiness(spec, DiskImage(Path("/d"), "qcow2", "sha256:0", "reg/x:1",
                                                     {"io.vmsidecar.readiness.pattern": "up"})).readiness
    plain = snapshot_key(spec, "sha256:0", "tcg", "max")
    assert snapshot_key(spec, "sha256:0", "tcg", "max", spec.readiness) == plain
    assert snapshot_key(spec, "sha256:0", "tcg", "max", from_image) != plain


async def test_serve_flags_and_env_set_the_readiness(start_runtime: Any) -> None:
    rt = await start_runtime(None, extra_args=["--ready-pattern", "flag-wins", "--ready-console", "hvc0"],
                             env={"VMSIDECAR_READY_PATTERN": "env-loses", "VMSIDECAR_READY_TIMEOUT": "45"})
    state = await rt.client().state()  # no image: nothing boots, but the spec's readiness is known
    assert state.readiness_source == "spec" and state.readiness is not None
    assert (state.readiness.pattern, state.readiness.console, state.readiness.timeout) == ("flag-wins", "hvc0", 45)
    spec = await rt.client().get_spec()
    assert spec is not None and spec.readiness.model_fields_set == {"pattern", "console", "timeout"}


def _render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["scripts/pod", "render", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_scripts_pod_puts_readiness_into_the_driver_spec() -> None:
    result = _render("--image", "127.0.0.1:5000/vm/x:1", "--ready-pattern", r"login: |\$ $", "--ready-timeout",
                     "600", "--ready-console", "hvc0")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(next(yaml.safe_load_all(result.stdout))["data"]["config.yaml"])
    spec = load_spec(config["export"]["vm"]["config"]["spec"])
    assert (spec.readiness.pattern, spec.readiness.console, spec.readiness.timeout) == (r"login: |\$ $", "hvc0", 600)
    null = _render("--image", "127.0.0.1:5000/vm/x:1", "--ready-pattern", "")
    config = yaml.safe_load(next(yaml.safe_load_all(null.stdout))["data"]["config.yaml"])
    assert load_spec(config["export"]["vm"]["config"]["spec"]).readiness.model_fields_set == {"pattern"}
    plain = _render("--image", "127.0.0.1:5000/vm/x:1")
    config = yaml.safe_load(next(yaml.safe_load_all(plain.stdout))["data"]["config.yaml"])
    assert "readiness" not in config["export"]["vm"]["config"]["spec"]
    refused = subprocess.run(["scripts/pod", "up", "--exporter-config", __file__, "--ready-pattern", "x"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "put readiness: in your config's spec" in refused.stderr


@pytest.mark.timeout(300)
def test_vmsidecar_shell_passes_readiness_to_its_runtime(tiny_image: Any, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMSIDECAR_")}
    env["VMSIDECAR_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, "-m", "jumpstarter_driver_vmsidecar.local", "--image", f"file:{tiny_image.disk}",
         "--ready-pattern", "vm# ", "--ready-timeout", "150", "--", "vmsidecar-runtime", "status", "--json"],
        env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads(result.stdout[result.stdout.index("{"):])
    assert state["phase"] == "Ready" and state["readiness_source"] == "spec"
    assert state["readiness"] == {"pattern": "vm# ", "console": "ttyS0", "timeout": 150.0}


async def test_spec_over_the_api_without_readiness_takes_the_default(start_runtime: Any, tiny_image: Any) -> None:
    rt = await start_runtime(None, extra_args=["--allow-host-paths", str(tiny_image.dir)])
    async with RuntimeClient(rt.socket) as client:
        await client.put_spec(load_spec({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"}))
        state = await client.wait_ready(180)
        assert state.readiness_source == "default" and state.readiness is not None
        assert state.readiness.pattern == DEFAULT_READY_PATTERN
        spec = await client.get_spec()
        assert spec is not None and spec.readiness.model_fields_set == set()


@pytest.mark.timeout(300)
async def test_exporter_started_first_hands_its_spec_and_readiness_to_a_late_runtime(
    start_runtime: Any, standalone_exporter: Any, tiny_image: Any, tmp_path: Path
) -> None:
    # a pod whose exporter wins the start-up race: no client ever connects, yet the guest boots
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off",
            "readiness": {"pattern": "vm# ", "timeout": 150}}
    socket = tmp_path / "late" / "shared" / "api.sock"
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(socket), "spec": spec})
    exp = await asyncio.to_thread(standalone_exporter, cfg)
    rt = await start_runtime(None, name="late", extra_args=["--allow-host-paths", str(tiny_image.dir)])
    state = await rt.client().wait_ready(180)
    assert exp.proc.poll() is None
    assert state.readiness_source == "spec" and state.readiness is not None
    assert (state.readiness.pattern, state.readiness.timeout) == ("vm# ", 150)
    got = await rt.client().get_spec()
    assert got is not None and got.readiness.model_fields_set == {"pattern", "timeout"}
