"""The vmsidecar-oci CLI, and registry credentials (htpasswd-protected registry)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.registry import AUTH_PASSWORD, RunningRegistry
from vmsidecar_contract.errors import RegistryError
from vmsidecar_runtime.oci import pull, push_artifact
from vmsidecar_runtime.oci.cli import main

SECRET = AUTH_PASSWORD


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vmsidecar_runtime.oci.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_cli_push_inspect_pull(registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path) -> None:
    ref = f"{registry.host}/cli/tiny:1"
    pushed = run_cli("push", str(oci_qcow2), ref, "--form", "containerdisk", "--arch", "aarch64")
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout.strip().startswith(f"{ref}@sha256:")
    inspected = run_cli("inspect", ref, "--arch", "arm64")
    assert inspected.returncode == 0, inspected.stderr
    info = json.loads(inspected.stdout)
    assert [p["platform"] for p in info["platforms"]] == ["linux/arm64"]
    assert info["disk"]["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    pulled = run_cli("pull", ref, "--cache", str(tmp_path / "cache"), "--arch", "arm64", "--json")
    assert pulled.returncode == 0, pulled.stderr
    result = json.loads(pulled.stdout)
    assert Path(result["path"]).read_bytes() == oci_qcow2.read_bytes()
    assert result["cached"] is False
    again = run_cli("pull", ref, "--cache", str(tmp_path / "cache"), "--arch", "arm64")
    assert again.returncode == 0 and again.stdout.strip() == result["path"]
    assert "cached" in again.stderr


def test_cli_layout_then_pull(oci_qcow2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", str(oci_qcow2), str(tmp_path / "lay"), "--tag", "v3"]) == 0
    assert capsys.readouterr().out.startswith(f"oci-layout:{tmp_path / 'lay'}:v3 sha256:")
    assert main(["pull", f"oci-layout:{tmp_path / 'lay'}:v3", "--cache", str(tmp_path / "c"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "qcow2"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["pull", "ftp://x"], "error: reference 'ftp://x' uses the unknown scheme 'ftp'"),
        (["pull", "file:/nonexistent/disk.qcow2"], "error: disk file /nonexistent/disk.qcow2 does not exist"),
        (["push", "/nonexistent.qcow2", "127.0.0.1:1/x/y:1"], "error: disk file /nonexistent.qcow2 does not exist"),
        (["inspect", "foo/bar:1"], "error: reference 'foo/bar:1' has no registry host"),
    ],
)
def test_cli_errors_exit_2_without_traceback(args: list[str], needle: str, tmp_path: Path) -> None:
    result = run_cli(*args, "--cache", str(tmp_path)) if args[0] == "pull" else run_cli(*args)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_credentials_from_argument_and_environment(
    auth_registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = f"{auth_registry.host}/auth/tiny:1"
    with pytest.raises(RegistryError) as info:
        push_artifact(oci_qcow2, ref)
    assert info.value.code == "registry_unauthorized"
    assert f"no credentials are configured for {auth_registry.host}" in info.value.message
    assert "VMSIDECAR_REGISTRY_HOST" in info.value.message and "--registry-auth" in info.value.message
    push_artifact(oci_qcow2, ref, credentials=("tester", SECRET))
    with pytest.raises(RegistryError) as wrong:
        pull(ref, tmp_path / "c", credentials=("tester", "wrong-password"))
    assert SECRET not in wrong.value.message and "wrong-password" not in wrong.value.message
    assert "the credentials argument were refused; check them" in wrong.value.message
    monkeypatch.setenv("VMSIDECAR_REGISTRY_USERNAME", "tester")
    monkeypatch.setenv("VMSIDECAR_REGISTRY_PASSWORD", SECRET)
    monkeypatch.setenv("VMSIDECAR_REGISTRY_HOST", auth_registry.host)  # scoped: for this registry only
    disk = pull(ref, tmp_path / "c")
    assert disk.path.read_bytes() == oci_qcow2.read_bytes()


def test_cli_inspect_without_matching_arch_still_lists_platforms(
    registry: RunningRegistry, oci_qcow2: Path
) -> None:
    ref = f"{registry.host}/cli/amd64only:1"
    assert main(["push", str(oci_qcow2), ref]) == 0
    result = run_cli("inspect", ref, "--arch", "aarch64")
    assert result.returncode == 2
    assert [p["platform"] for p in json.loads(result.stdout)["platforms"]] == ["linux/amd64"]
    assert "error: " in result.stderr and "available: linux/amd64" in result.stderr
