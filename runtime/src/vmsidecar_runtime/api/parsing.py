"""Requests held to what docs/api/openapi.json says, no looser.

JSON bodies need ``Content-Type: application/json``, UTF-8 and at most ``MAX_JSON_BODY`` bytes;
booleans are JSON booleans; a query parameter the operation does not have (or one given twice) is
an error. Every refusal names the cause and the fix.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from vmsidecar_contract.endpoints import ENDPOINTS, Endpoint
from vmsidecar_contract.errors import RequestError

from .audit import BODY_KEY

#: query parameters per (method, path), from the endpoint table; any other is a 400 (a typo must
#: not pass silently)
QUERY_PARAMS: dict[tuple[str, str], tuple[str, ...]] = {(e.method, e.path): e.query_names for e in ENDPOINTS
                                                       if e.query}
#: JSON is UTF-8 (RFC 8259); a body that names another charset is refused rather than guessed at
_JSON_CHARSETS = {None, "utf-8", "utf8", "us-ascii"}
M = TypeVar("M", bound=BaseModel)


class HttpRefusal(Exception):
    """A refusal at the HTTP level (415 here; 413 comes from aiohttp), sent as code ``http_error``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


#: the row of each operation, by (method, path)
ROWS: dict[tuple[str, str], Endpoint] = {(e.method, e.path): e for e in ENDPOINTS}


def row_of(request: web.Request) -> Endpoint | None:
    """The endpoint-table row a routed request is for; None for an unrouted one (404, 405)."""
    resource = request.match_info.route.resource
    return ROWS.get((request.method, resource.canonical)) if resource is not None else None


def check_query(request: web.Request) -> None:
    """Refuse a query parameter the operation does not have, or one given twice (which would win?)."""
    row = row_of(request)
    known = row.query_names if row is not None else ()
    for name in request.query:
        if name not in known:
            use = f"it takes {', '.join(known)}" if known else "it takes no query parameters"
            raise RequestError(f"{request.method} {request.path} has no query parameter {name!r}; {use} "
                               "(see docs/api/openapi.json)")
        if len(request.query.getall(name)) > 1:
            raise RequestError(f"query parameter {name!r} is given {len(request.query.getall(name))} times; give it once")


def _require_no_encoding(request: web.Request) -> None:
    """A body sent compressed (``Content-Encoding``) is a 415: aiohttp would inflate it on the fly, and a
    body that does not inflate fails mid-read with an error of its own. Disk images are sent as they
    are (the runtime decompresses zstd, gzip and xz disks itself, checked)."""
    encoding = request.headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise HttpRefusal(415, f"the request body is sent with Content-Encoding {encoding!r}; send it "
                               "without one (a compressed disk image as it is: the runtime reads zstd, gzip "
                               "and xz disks)")


def require_disk_image_type(request: web.Request) -> None:
    """A disk image declared as anything but ``application/octet-stream`` is a 415 (none declared is fine)."""
    _require_no_encoding(request)
    ctype = request.headers.get("Content-Type")
    if ctype is not None and request.content_type != "application/octet-stream":
        raise HttpRefusal(415, f"the disk image was sent with Content-Type {ctype!r}; send it as application/octet-stream "
                               "(curl: -T FILE -H 'Content-Type: application/octet-stream')")


def _require_json_type(request: web.Request) -> None:
    """A non-empty JSON body must say so: a form or a file sent by mistake is a 415, not parsed."""
    if not request.body_exists:
        return
    _require_no_encoding(request)
    ctype = request.headers.get("Content-Type")
    if ctype is None or request.content_type != "application/json":
        sent = f"Content-Type {ctype!r}" if ctype else "no Content-Type"
        raise HttpRefusal(415, f"the request body has {sent}; send JSON with Content-Type: application/json "
                               "(curl: -H 'Content-Type: application/json')")


async def json_body(request: web.Request) -> Any:
    """The body as JSON (``{}`` when empty); every way it can be malformed is a 400 (415: not
    declared as JSON, 413: too large)."""
    _require_json_type(request)
    charset = request.charset.lower() if request.charset else None
    if charset not in _JSON_CHARSETS:
        raise RequestError(f"the request declares charset={request.charset!r}; send the JSON body as UTF-8 "
                           "(Content-Type: application/json)")
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not UTF-8 (byte {e.start} is 0x{raw[e.start]:02x}); "
                           "send UTF-8 JSON") from e
    if not text.strip():
        return {}
    try:
        request[BODY_KEY] = data = json.loads(text, parse_constant=_not_json)  # for the audit line
        return data
    except json.JSONDecodeError as e:
        raise RequestError(f"request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                           "send a JSON object") from e
    except RecursionError as e:
        raise RequestError("request body nests too deeply to be a request; send a flat JSON object") from e
    except ValueError as e:  # a number of more digits than Python converts (4300)
        raise RequestError(f"request body is not a request ({e}); send a JSON object of the documented "
                           "fields") from e


def _not_json(name: str) -> Any:
    # Python's json reads NaN and Infinity; JSON (RFC 8259) has neither
    raise RequestError(f"request body is not valid JSON ({name} is not a JSON number); send a finite number")


async def parse(request: web.Request, model: type[M]) -> M:
    """The JSON body as the operation's request model; a body that does not fit is a 400 naming each field."""
    data = await json_body(request)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        parts = [f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()]
        raise RequestError(f"invalid request body: {'; '.join(parts)}; see docs/api/openapi.json") from e


def bool_query(request: web.Request, name: str) -> bool:
    """A boolean query parameter: exactly ``true`` or ``false``, as the document's boolean (no 1/yes)."""
    value = request.query.get(name, "false")
    if value not in ("true", "false"):
        raise RequestError(f"query parameter {name}={value!r} is not a boolean; use true or false")
    return value == "true"
