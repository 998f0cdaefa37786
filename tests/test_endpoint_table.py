"""Issue 20: the contract's endpoint table is the one list of the API's operations.

The server's routes, the OpenAPI document and both clients' methods are built from
``vmsidecar_contract.endpoints``; these tests check that they name the same operations, that a row
without a handler stops the server from loading, and that every event the runtime publishes has a
typed model in the contract (``vmsidecar_contract.events``). No guest boots here; the last test
starts a runtime without a spec.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
from pydantic import BaseModel, ValidationError

from fixtures.source import SHARED_DEPTH_COUNT, failures_amid_garbage, parse_python
from vmsidecar_contract import blocking, client
from vmsidecar_contract import endpoints as api
from vmsidecar_contract.endpoints import ENDPOINTS, Answer, Endpoint
from vmsidecar_contract.errors import registry
from vmsidecar_contract.events import EVENTS, Event
from vmsidecar_runtime.api import server
from vmsidecar_runtime.api.openapi import build_document
from vmsidecar_runtime.api.parsing import QUERY_PARAMS
from vmsidecar_runtime.backend.base import BackendEvent
from vmsidecar_runtime.backend.libvirt.backend import map_lifecycle
from vmsidecar_runtime.backend.qemu import QMP_EVENTS, map_qmp_event

RUNTIME_SRC = Path(__file__).parents[1] / "runtime" / "src" / "vmsidecar_runtime"
TABLE = {(row.method, row.path) for row in ENDPOINTS}
#: the rows by the name the clients and the server use for them (``api.GET_VM`` …)
ROWS = {name: row for name, row in vars(api).items() if isinstance(row, Endpoint)}
#: public methods of the async client that call no endpoint themselves
CLIENT_HELPERS = {"close", "wait_ready", "wait_spare", "wait_stored"}


def test_the_table_lists_every_row_once() -> None:
    assert set(ROWS.values()) == set(ENDPOINTS)
    assert len(TABLE) == len(ENDPOINTS), "two rows name the same method and path"


def test_the_server_routes_exactly_the_table() -> None:
    app = server.make_app(cast(Any, None))  # the routes do not need a controller until a request comes
    routed = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    assert routed == TABLE
    assert {(m, p) for m, p, _ in server.ROUTES} == TABLE
    assert {(row.method, row.path): row.query_names for row in ENDPOINTS if row.query} == QUERY_PARAMS


def test_the_document_describes_exactly_the_table() -> None:
    doc = build_document()
    assert {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops} == TABLE
    for row in ENDPOINTS:
        op = doc["paths"][row.path][row.method.lower()]
        statuses = {a.status for a in row.answers} | set(row.error_statuses())
        assert set(op["responses"]) == {str(s) for s in statuses}, row
        assert ([q["name"] for q in op.get("parameters", []) if q["in"] == "query"]
                == list(row.query_names)), row
        headers = [q["name"] for q in op.get("parameters", []) if q["in"] == "header"]
        assert headers == ([api.GENERATION_HEADER] if row.lease_bound else []), row
        assert ("requestBody" in op) == (row.body is not None), row
        success = op["responses"][str(row.status)]["content"]
        assert list(success) == [api.MEDIA_TYPES[row.answers[0].media]], row
        assert row.streams == (list(success) == ["application/x-ndjson"]), row


def _endpoints_reached(cls: type) -> dict[str, set[str]]:
    """Per method of ``cls``: the rows it names (``api.NAME``); fails on a path written as a string."""
    # its module's file through parse_python: inspect.getsource of a class ast-parses the module
    # itself in 3.11, open to the garbage collection fixtures/source.py explains (a CI run hit it)
    module = parse_python(Path(cast(str, inspect.getsourcefile(cls))))
    (tree,) = (n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    reached: dict[str, set[str]] = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        names = reached.setdefault(fn.name, set())
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "api":
                names.add(node.attr)
            if isinstance(node, ast.Constant) and node.value in {row.path for row in ENDPOINTS}:
                raise AssertionError(f"{cls.__name__}.{fn.name} writes the path {node.value!r}; use its row in "
                                     "vmsidecar_contract.endpoints")
    return reached


def test_the_async_client_has_a_method_for_every_row_and_no_other() -> None:
    reached = _endpoints_reached(client.RuntimeClient)
    public = {name for name in reached if not name.startswith("_")}
    assert set().union(*(reached[m] for m in public)) == set(ROWS), "a row has no client method"
    assert {m for m in public if not reached[m]} == CLIENT_HELPERS, "a public method calls no row"
    for name in public:
        assert hasattr(client.RuntimeClient, name)


def test_reading_the_clients_survives_a_collection_that_formats_a_traceback() -> None:
    # what a CI run hit through inspect.getsource (on the interpreters that share the count)
    assert (failures_amid_garbage(lambda: inspect.getsource(client.RuntimeClient)) > 0) == SHARED_DEPTH_COUNT
    assert failures_amid_garbage(lambda: _endpoints_reached(client.RuntimeClient)) == 0


def test_the_blocking_client_uses_rows_only() -> None:
    reached = _endpoints_reached(blocking.BlockingRuntimeClient)
    used = set().union(*reached.values())
    assert used and used <= set(ROWS)


def test_a_row_without_a_handler_stops_the_server_from_loading() -> None:
    new = Endpoint("GET", "/v1/new", "A new operation.", (Answer(200, "state", model="VmState"),), ("bad_request",))
    with pytest.raises(LookupError, match="no handler for GET /v1/new"):
        server.routes((*ENDPOINTS, new))
    with pytest.raises(LookupError, match="HANDLERS serves GET /v1/vm, which the endpoint table does not list"):
        server.routes(ENDPOINTS[1:])
    # for real: a runtime whose table has a row more cannot import its server
    code = ("from vmsidecar_contract import endpoints as api\n"
            "api.ENDPOINTS += (api.Endpoint('GET', '/v1/new', 'A new operation.', (api.Answer(200, 'state'),), ()),)\n"
            "import vmsidecar_runtime.api.server\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "LookupError: no handler for GET /v1/new" in result.stderr, result.stderr


def test_rows_name_models_and_registered_codes() -> None:
    codes = registry()
    for row in ENDPOINTS:
        for name in {row.request, *(a.model for a in row.answers)} - {None}:
            assert issubclass(api.model(str(name)), BaseModel), (row, name)
        assert "bad_request" in row.errors, f"{row}: every operation refuses an unknown query parameter"
        assert set(row.errors) <= set(codes), (row, set(row.errors) - set(codes))
        assert row.body is None or (row.body.media == "json") == (row.body.model is not None), row
    with pytest.raises(LookupError, match="NoSuchModel"):
        api.model("NoSuchModel")


def test_the_table_and_the_blocking_client_load_without_pydantic() -> None:
    code = ("import sys, vmsidecar_contract.blocking, vmsidecar_contract.endpoints\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'aiohttp')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# ---- events --------------------------------------------------------------------------------
def _published() -> dict[str, set[str]]:
    """Every event type the runtime publishes by name, with the data keywords of each call
    (``_set_phase(…)`` publishes ``phase`` events)."""
    found: dict[str, set[str]] = {}
    for path in RUNTIME_SRC.rglob("*.py"):
        for node in ast.walk(parse_python(path)):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            keywords = {k.arg for k in node.keywords if k.arg is not None}
            if node.func.attr == "publish" and node.args and isinstance(node.args[0], ast.Constant):
                found.setdefault(str(node.args[0].value), set()).update(keywords)
            elif node.func.attr == "_set_phase":
                found.setdefault("phase", set()).update(keywords | {"phase"})
    return found


def test_every_event_the_runtime_publishes_has_a_model_with_its_fields() -> None:
    published = _published()
    assert {"phase", "spec", "pulled", "flashed", "claimed", "recycled", "boot"} <= set(published), published
    for type_, keywords in published.items():
        assert type_ in EVENTS, f"the runtime publishes {type_!r}, which vmsidecar_contract.events.EVENTS lacks"
        assert keywords <= set(EVENTS[type_].model_fields), (type_, keywords - set(EVENTS[type_].model_fields))
    assert {e.value for e in BackendEvent} <= set(EVENTS)


def test_backend_events_fit_their_models() -> None:
    samples = {"SHUTDOWN": {"guest": True, "reason": "guest-shutdown"}, "RESET": {"guest": False},
               "BLOCK_IO_ERROR": {"operation": "write", "action": "stop", "nospace": True, "reason": "No space"}}
    for name in QMP_EVENTS:
        mapped = map_qmp_event(name, samples.get(name, {}))
        assert mapped is not None, name
        Event(type=mapped[0], time=1.0, generation=0, data=mapped[1])
    lifecycle = [m for event in range(12) for detail in range(8) if (m := map_lifecycle(event, detail))]
    assert {kind for kind, _ in lifecycle} >= {BackendEvent.PAUSED, BackendEvent.EXITED, BackendEvent.POWERED_OFF}
    for kind, data in lifecycle:
        Event(type=kind, time=1.0, generation=0, data=data)
    Event(type=BackendEvent.EXITED, time=1.0, generation=0, data={"returncode": 0})
    Event(type=BackendEvent.EXITED, time=1.0, generation=0, data={"signal": 9, "reason": "host-signal"})


def test_an_event_outside_the_contract_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"not in vmsidecar_contract\.events\.EVENTS"):
        Event(type="guest.exploded", time=1.0, generation=0)
    with pytest.raises(ValidationError, match="extra"):
        Event(type="claimed", time=1.0, generation=1, data={"generation": 1, "lease": "x"})
    with pytest.raises(ValidationError, match="phase"):
        Event(type="phase", time=1.0, generation=1, data={"phase": "Sleeping"})
    event = Event(type="phase", time=1.0, generation=1, data={"phase": "Ready", "timings": {"ready": 1.5}})
    assert event.typed().timings is not None and event.typed().timings.ready == 1.5  # type: ignore[attr-defined]
    assert event.model_dump()["data"] == {"phase": "Ready", "timings": {"ready": 1.5}}  # the wire keeps the dict


async def test_a_live_event_stream_is_typed(start_runtime: Any) -> None:
    # the runtime's event lines validate as typed events (and against the document, through the
    # observer start_runtime installs); the async client's readiness() gets a 503 as an answer
    rt = await start_runtime(None)
    c = rt.client()
    assert (await c.readiness()).status == "not-ready"
    stream = c.events()
    hello = await anext(stream)
    assert Event.model_validate(hello).typed() == EVENTS["hello"](phase="Stopped")
    await c.claim()
    await c.recycle(boot=False)
    seen = []
    async for line in stream:
        seen.append(Event.model_validate(line))
        if line["type"] == "recycled":
            break
    await stream.aclose()
    assert [e.type for e in seen] == ["claimed", "recycled"] and seen[-1].typed() == EVENTS["recycled"](generation=1)
