"""The OpenAPI document is the contract: committed copy current, routes match, live answers
validate, and malformed calls get 4xx JSON errors while the runtime keeps serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fixtures.openapi_check import VALIDATOR
from vmsidecar_runtime.api.openapi import build_document
from vmsidecar_runtime.api.parsing import QUERY_PARAMS
from vmsidecar_runtime.api.server import ROUTES

DOC_PATH = Path(__file__).parents[1] / "docs" / "api" / "openapi.json"
DOC = build_document()


def test_committed_document_is_current() -> None:
    committed = json.loads(DOC_PATH.read_text())
    assert committed == json.loads(json.dumps(DOC)), (
        "docs/api/openapi.json is stale: run `uv run python -m vmsidecar_runtime.api.openapi > docs/api/openapi.json`"
    )


def test_routes_match_document() -> None:
    served = {(m.lower(), p) for m, p, _ in ROUTES}
    documented = {(m, p) for p, ops in DOC["paths"].items() for m in ops}
    assert served == documented
    # the query parameters the server takes are the ones the document lists (any other is a 400)
    documented_query = {(m.upper(), p): tuple(q["name"] for q in op.get("parameters", []) if q["in"] == "query")
                        for p, ops in DOC["paths"].items() for m, op in ops.items()}
    assert {k: v for k, v in documented_query.items() if v} == QUERY_PARAMS


class ContractClient:
    """Raw HTTP over the Unix socket; every answer is checked against the document (the one
    validator of the tests, ``fixtures.openapi_check``), also for requests that are wrong on purpose."""

    def __init__(self, socket: Path) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket)),
                                             base_url="http://vmsidecar")

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, Any]:
        async with self.session.request(method, path, **kw) as resp:
            raw = await resp.read()
            VALIDATOR.response(method, path, resp.status, resp.headers, raw)
            return resp.status, json.loads(raw)


@pytest.fixture
async def api(start_runtime: Any) -> Any:
    rt = await start_runtime(None)
    client = ContractClient(rt.socket)
    yield client, rt
    await client.session.close()


async def test_live_answers_match_and_errors_are_json(api: Any) -> None:
    client, rt = api
    assert stat_mode(rt.socket) == 0o660

    status, body = await client.call("GET", "/v1/vm")
    assert status == 200 and body["phase"] == "Stopped" and body["generation"] == 0
    assert (await client.call("GET", "/healthz"))[0] == 200
    status, body = await client.call("GET", "/readyz")
    assert status == 503 and body["status"] == "not-ready"
    status, body = await client.call("GET", "/v1/vm/spec")
    assert status == 404 and "no VM spec yet" in body["message"]

    status, body = await client.call("PUT", "/v1/vm/spec", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    assert status == 400 and body["error"] == "bad_request" and "not valid JSON" in body["message"]
    status, body = await client.call("PUT", "/v1/vm/spec", json={"memory": "12Q", "cpus": 0})
    assert status == 400 and body["error"] == "invalid_spec"
    assert "memory: '12Q' is not a size" in body["message"] and "cpus:" in body["message"]
    status, body = await client.call("PUT", "/v1/vm/spec", json={"extra_args": ["-S"]})
    assert status == 400 and "--allow-extra-args" in body["message"]
    status, body = await client.call("POST", "/v1/vm/power", json={"action": "explode"})
    assert status == 400 and "action" in body["message"]
    status, body = await client.call("POST", "/v1/vm/power", json={"action": "reset"})
    assert status == 409 and body["error"] == "wrong_phase" and "Stopped" in body["message"]
    status, body = await client.call("POST", "/v1/vm/power", json={"action": "on"})
    assert status == 400 and "no VM spec yet" in body["message"]

    status, body = await client.call("DELETE", "/v1/vm")
    assert status == 405 and body["error"] == "method_not_allowed" and "GET" in body["message"]
    status, body = await client.call("GET", "/v1/nope")
    assert status == 404 and body["error"] == "not_found"

    status, body = await client.call("PUT", "/v1/vm/spec", json={"image": "file:/nonexistent.qcow2", "memory": "256M"})
    assert status == 400 and body["error"] == "host_path_not_allowed"
    status, body = await client.call("PUT", "/v1/vm/spec", json={"image": "127.0.0.1:1/vm/none:1", "memory": "256M"})
    assert status == 200 and body["image"] == "127.0.0.1:1/vm/none:1"
    status, body = await client.call("GET", "/v1/vm/spec")
    assert status == 200 and body["memory"] == 256
    assert (await client.call("GET", "/healthz"))[0] == 200  # still serving after all that


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


async def test_a_dump_whose_image_fails_its_check_answers_the_documented_image_error(
        start_runtime: Any, tmp_path: Path) -> None:
    """The dump checks (and pulls) the spec's image first, as a power on does: its errors are the
    dump's too (they were undocumented for ``GET /v1/vm/disk``)."""
    from fixtures.faults import wait_phase
    from vmsidecar_contract.errors import ImageError

    corrupt = tmp_path / "corrupt.qcow2"
    corrupt.write_bytes(b"QFI\xfb" + bytes(60) + b"\xff" * 4096)  # qcow2's magic, then no valid header
    rt = await start_runtime({"image": f"file:{corrupt}", "memory": "128M"})
    client = rt.client()
    await wait_phase(client, "Error", timeout=60)  # its boot refused the image
    with pytest.raises(ImageError):
        await client.dump(tmp_path / "dump.qcow2")
