"""One error registry: every code the source raises is registered for its class, the OpenAPI
document lists every code, and the client rebuilds the class (and fields) a code belongs to."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from fixtures.source import parse_python
from vmsidecar_contract import errors
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.errors import registry

ROOT = Path(__file__).parents[1]
SOURCES = [*(ROOT / "runtime" / "src").rglob("*.py"), *(ROOT / "contract" / "src").rglob("*.py")]


def _raised_codes() -> list[tuple[str, str, str]]:
    """(file, class name, code) for every ``SomeError(..., code="x")`` in the runtime and contract."""
    found = []
    for path in SOURCES:
        for node in ast.walk(parse_python(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("Error"):
                for kw in node.keywords:
                    if kw.arg == "code" and isinstance(kw.value, ast.Constant):
                        found.append((path.name, node.func.id, kw.value.value))
    return found


def test_every_raised_code_is_registered_for_its_class() -> None:
    raised = _raised_codes()
    assert len(raised) > 30  # the scan really sees the source
    for where, cls_name, code in raised:
        cls = getattr(errors, cls_name)
        owners = [c for c in cls.__mro__ if isinstance(c, type) and issubclass(c, errors.VmsidecarError)]
        assert any(code == c.code or code in c.codes for c in owners), f"{where}: {cls_name}(code={code!r}) unregistered"


def test_the_document_lists_every_code() -> None:
    doc = json.loads((ROOT / "docs" / "api" / "openapi.json").read_text())
    listed = doc["components"]["schemas"]["ErrorBody"]["properties"]["error"]["enum"]
    assert sorted(registry()) == listed
    for code in ("host_path_not_allowed", "generation_changed", "unsafe_disk", "registry_unreachable", "no_spec"):
        assert code in listed


@pytest.mark.parametrize(("code", "cls"), [
    ("host_path_not_allowed", errors.HostPathError), ("generation_changed", errors.GenerationChangedError),
    ("unsafe_disk", errors.ImageError), ("registry_tls", errors.RegistryError), ("no_spec", errors.SpecError),
    ("digest_mismatch", errors.DigestMismatchError), ("internal_error", errors.VmsidecarError),
])
def test_client_rebuilds_the_class(code: str, cls: type) -> None:
    exc = errors.from_wire({"error": code, "message": "m"}, 400)
    assert type(exc) is cls and exc.code == code and exc.message == "m"


async def test_live_409_comes_back_with_its_phases(start_runtime: Any) -> None:
    rt = await start_runtime(None)
    async with RuntimeClient(rt.socket) as client:
        with pytest.raises(errors.StateError) as info:
            await client.power("reset")
    assert info.value.code == "wrong_phase" and info.value.http_status == 409
    assert info.value.actual == "Stopped" and info.value.required == "Ready|Running|Starting"


async def test_405_names_the_allowed_methods_in_allow(start_runtime: Any) -> None:
    import aiohttp

    rt = await start_runtime(None)
    async with (aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(rt.socket))) as http,
                http.delete("http://vmsidecar/v1/vm") as resp):
        body = await resp.json()
        assert resp.status == 405 and resp.headers["Allow"] == "GET" and body["error"] == "method_not_allowed"
