"""The HTTP policy of registry requests, on top of oras-py: auth, TLS, timeouts and bounded retries.

oras-py (``oras.provider.Registry``) does the URLs, blob existence checks and chunked blob
uploads. :class:`OrasRegistry` adds what it lacks for our use:

* ``do_request`` with a bounded retry (3 tries, < 10 s in total) and socket timeouts: oras-py's
  own retry sleeps 3 s, 5 s, 11 s, 29 s, 83 s for an unreachable host and sets no timeout;
* credentials sent only where they belong (:mod:`.auth` says which are whose): to the registry's
  own origin (scheme, host, port), in answer to its ``Basic`` or ``Bearer`` challenge; a token
  service (``realm``) on another host gets the registry's own credentials only when it is a token
  service that registry is known to use (:data:`KNOWN_TOKEN_SERVICES`) or its auth entry holds the
  very same credentials, else nothing (oras' token backend sent the registry's password to any
  realm the registry named; and never another host's credentials, which the registry's answer
  would choose, the token issued on them going to the registry); a realm in plain HTTP only when
  its host is listed as insecure;
* a redirect keeps the Authorization header only to the same origin, and ``~/.netrc`` (which
  requests would add to every request and redirect) is never read;
* a redirect into the pod (loopback, link-local: the metadata service) is refused unless the
  registry itself is there: a lease holder's ``flash oci://`` names their own registry; a redirect
  to plain HTTP only to a host listed as insecure, as every other plain-HTTP request (over HTTPS
  no request is sent before the certificate matches the name, whatever the name resolves to at
  the connect: that is what keeps DNS rebinding out of the pod);
* no body is read without a bound but a blob's or a manifest's (each bounded and checked by its
  reader): an error answer's at most :data:`MAX_ERROR_BODY` (past it, no error codes), a token
  answer's :data:`MAX_TOKEN_BODY` (past it, refused), and whatever requests reads whole on its own
  (a request not streamed, a redirect's body) the same (:class:`_BoundedBody`): a registry's 404 of
  many GB, or chunked for ever, had been read into memory whole;
* a pull given up (its :func:`..threads.current_abort` set) stops at once: every connection made
  for it is shut down then, which wakes the read a registry that trickles keeps it in (a timeout is
  per read, and a byte now and then never lets one expire), and no request or retry follows.

What is asked of the registry, and how its answers become vmsidecar errors, is :mod:`.registry`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from http.cookiejar import DefaultCookiePolicy
from typing import Any
from urllib.parse import SplitResult, urljoin, urlsplit

import oras.provider
import requests
import requests.adapters
import requests.auth
import urllib3
import urllib3.connection

from vmsidecar_contract.errors import RegistryError
from vmsidecar_contract.reach import resolves_to_pod

from ..threads import current_abort
from .auth import ENV_INSECURE, HOW_TO_CONFIGURE, INSECURE_FLAG, Credentials, RegistryConfig, normalize_host
from .mediatypes import load_document

CONNECT_TIMEOUT = 2.5
READ_TIMEOUT = 60.0
TRIES = 3
BACKOFF = (0.3, 1.0)
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: the most of an error answer's body read: an OCI error document is a few hundred bytes; past it,
#: the answer has no error codes (its status still says what happened)
MAX_ERROR_BODY = 64 << 10
#: the most of a token service's answer read: real tokens are a few KB (Docker Hub's ~4 KB, JWTs of
#: GitLab's and registry:2's token servers 1-2 KB); past it, the token is refused
MAX_TOKEN_BODY = 1 << 20
#: the most of any other successful answer requests reads whole for a request not streamed (upload
#: answers are empty); what is read with a purpose has its own bound (tags, manifests: :mod:`.registry`)
MAX_BODY = 1 << 20
READ_CHUNK = 64 << 10
#: the token services on another host that registries are known to use: the registry's own
#: credentials go there (their auth entries name the registry: ``docker login`` writes Docker Hub's
#: as ``https://index.docker.io/v1/``, GitLab's as ``registry.gitlab.com``)
KNOWN_TOKEN_SERVICES: dict[str, frozenset[str]] = {
    "registry-1.docker.io": frozenset({"auth.docker.io"}),
    "index.docker.io": frozenset({"auth.docker.io"}),
    "docker.io": frozenset({"auth.docker.io"}),
    "registry.gitlab.com": frozenset({"gitlab.com"}),
}


def origin(url: str) -> tuple[str, str, int | None]:
    """``(scheme, host, port)`` of a URL, the default port made explicit."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


def _host_port(url: SplitResult) -> str:
    """``host[:port]`` of a URL as the insecure list names hosts (an unparsable port: the netloc)."""
    try:
        port = url.port
    except ValueError:
        return url.netloc
    host = url.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}" if port else host


class _NoNetrc(requests.auth.AuthBase):
    """A session ``auth`` that adds nothing: with none set, requests adds ``~/.netrc`` credentials
    (a ``default`` entry: to every host) to each request it prepares."""

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        return r


class _Session(requests.Session):
    """requests' session with our credential rules for redirects (and no netrc, no cookies)."""

    def __init__(self, config: RegistryConfig) -> None:
        super().__init__()
        self._config = config
        self.auth = _NoNetrc()
        # some registries set a cookie and then take the client for a browser (oras-py does the same)
        self.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))

    def get_redirect_target(self, resp: requests.Response) -> str | None:
        """The redirect's target, refused when it is (or resolves to) an address of the pod and the
        registry's own host is not: the registry is whoever the reference names; refused in plain
        HTTP to a host not listed as insecure.

        :raise RegistryError: naming the target.
        """
        target = super().get_redirect_target(resp)
        if target is not None:
            current, new = urlsplit(resp.url), urlsplit(urljoin(resp.url, target))
            # the origin the answer came from was already spoken to in plain HTTP: checked then
            if new.scheme.lower() == "http" and not self._config.is_insecure(_host_port(new)) and (
                    origin(resp.url) != origin(new.geturl())):
                raise RegistryError(
                    f"registry {current.netloc} answered with a redirect in plain HTTP to {_host_port(new)}, "
                    f"which is not listed as insecure; list it if it is yours (serve {INSECURE_FLAG} "
                    f"HOST[:PORT] or {ENV_INSECURE}; vmsidecar-oci {INSECURE_FLAG}), or use another registry",
                    code="registry_error")
            if new.hostname and resolves_to_pod(new.hostname, new.port or 443) and not resolves_to_pod(
                    current.hostname or "", current.port or 443):
                raise RegistryError(
                    f"registry {current.netloc} answered with a redirect to {new.netloc}, this pod "
                    "(loopback) or a link-local address such as the cloud metadata service, which a registry "
                    "may not send the runtime to; use another registry", code="registry_error")
        return target

    def rebuild_auth(self, prepared_request: requests.PreparedRequest, response: requests.Response) -> None:
        """Keep Authorization on a redirect only to the very same origin (requests keeps it on an
        http → https upgrade and would add netrc credentials for the new host)."""
        old = response.request.url or ""
        if "Authorization" in prepared_request.headers and origin(old) != origin(prepared_request.url or ""):
            del prepared_request.headers["Authorization"]


class _BoundedBody:
    """An answer's body (urllib3's response, which requests reads) that ends after ``limit`` bytes
    (decoded), closing the connection there; ``exceeded`` says it was cut. Everything else is the
    wrapped response's."""

    def __init__(self, raw: Any, limit: int) -> None:
        self._raw = raw
        self._left = limit
        self.exceeded = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def _cut(self) -> None:
        self.exceeded, self._left = True, 0
        self._raw.close()  # the rest stays unread: the connection cannot be used again

    def stream(self, amt: int | None = READ_CHUNK, decode_content: bool | None = None) -> Iterator[bytes]:
        """urllib3's ``stream``, in chunks of at most :data:`READ_CHUNK`, ending at the limit."""
        if self.exceeded:
            return
        for chunk in self._raw.stream(min(amt or READ_CHUNK, READ_CHUNK), decode_content=decode_content):
            if len(chunk) > self._left:
                left = self._left
                self._cut()
                if left:
                    yield chunk[:left]
                return
            self._left -= len(chunk)
            yield chunk

    def read(self, amt: int | None = None, *args: Any, **kwargs: Any) -> bytes:
        """urllib3's ``read``, never past the limit (requests reads a redirect's body so when
        ``stream`` fails)."""
        if self.exceeded:
            return b""
        data: bytes = self._raw.read(self._left + 1 if amt is None else min(amt, self._left + 1), *args, **kwargs)
        if len(data) > self._left:
            data = data[:self._left]
            self._cut()
        else:
            self._left -= len(data)
        return data


def _check_abort() -> None:
    """:raise threads.Abandoned: the pull this thread runs for was given up."""
    if (abort := current_abort()) is not None:
        abort.check()


def _pause(seconds: float) -> None:
    """Sleep ``seconds``, less once the current pull is given up (the next check then stops it)."""
    abort = current_abort()
    if abort is None:
        time.sleep(seconds)
    else:
        abort.wait(seconds)


def _connect_abortably(conn: urllib3.connection.HTTPConnection, connect: Callable[[], None]) -> None:
    """``connect()`` of ``conn``, its socket shut down when the current pull is given up (then, or
    at once if it was already): what the thread then reads or writes on it fails at once."""
    abort = current_abort()
    if abort is None:
        connect()
        return

    def shut() -> None:
        if (sock := conn.sock) is not None:
            sock.shutdown(socket.SHUT_RDWR)

    # never unregistered: the connection may outlive this request in the session's pool (a
    # closed socket's shutdown fails with EBADF, which the Abort ignores). Not covered: the TLS
    # handshake, where conn.sock is the plain socket the TLS one has taken over (each of its reads
    # is bounded by CONNECT_TIMEOUT)
    abort.on_set(shut)
    abort.check()
    connect()
    abort.check()  # set while it connected: the hook found no socket yet


class _AbortableHTTPConnection(urllib3.connection.HTTPConnection):
    def connect(self) -> None:
        _connect_abortably(self, super().connect)


class _AbortableHTTPSConnection(urllib3.connection.HTTPSConnection):
    def connect(self) -> None:
        _connect_abortably(self, super().connect)


class _HTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _AbortableHTTPConnection


class _HTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _AbortableHTTPSConnection


class _TimeoutAdapter(requests.adapters.HTTPAdapter):
    """Requests' adapter with our socket timeouts wherever the caller gave none (oras-py never does),
    and a bound on every body requests may read whole: a request not streamed (requests reads its
    answer at once), an error answer and a redirect's (:class:`_BoundedBody`). Its connections are
    shut down when the pull they serve is given up (:func:`_connect_abortably`)."""

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any) -> None:
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> urllib3.PoolManager:
        manager: urllib3.PoolManager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if isinstance(manager, urllib3.ProxyManager):  # (a SOCKS proxy's manager has pools of its own)
            manager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
        return manager

    def send(self, request: requests.PreparedRequest, stream: bool = False,
             timeout: float | tuple[float | None, float | None] | None = None, verify: bool | str = True,
             cert: str | tuple[str, str] | None = None, proxies: dict[str, str] | None = None) -> requests.Response:
        response = super().send(request, stream, (CONNECT_TIMEOUT, READ_TIMEOUT) if timeout is None else timeout,
                                verify, cert, proxies)
        success = 200 <= response.status_code < 300
        if not (stream and success):  # a streamed success is a blob's or a manifest's: its reader bounds it
            response.raw = _BoundedBody(response.raw, MAX_BODY if success else MAX_ERROR_BODY)
        return response


def read_body(response: requests.Response, limit: int) -> bytes | None:
    """The body of ``response`` when it is at most ``limit`` bytes, else ``None``, having read no more
    than ``limit`` and a chunk (the caller's close then drops the connection).

    :raise requests.RequestException: the connection broke, or the body was read already as a stream.
    """
    body = bytearray()
    for chunk in response.iter_content(chunk_size=READ_CHUNK):
        body += chunk
        if len(body) > limit:
            return None
    return None if getattr(response.raw, "exceeded", False) else bytes(body)


class OrasRegistry(oras.provider.Registry):
    """oras-py's registry with our request policy (see the module docstring).

    Why a subclass: oras-py has no hook for a request policy. Its ``do_request`` retries for
    minutes with no socket timeout, cannot answer a ``Basic`` challenge and hands the registry's
    password to any token realm; it is the one method its ``upload_blob``/``blob_exists``/
    ``chunked_upload`` send through, so we override it. Everything read here is either set by
    this class or oras' public API (constructor arguments, ``session``), never oras' private
    state: that is what lets runtime/pyproject.toml accept a range of oras versions.
    """

    session: requests.Session

    def __init__(
        self,
        hostname: str,
        *,
        plain_http: bool,
        credentials: Credentials | None,
        config: RegistryConfig,
        tls_verify: bool = True,
    ) -> None:
        super().__init__(hostname=hostname, insecure=plain_http, tls_verify=tls_verify)
        self.session.close()
        self.session = _Session(config)
        adapter = _TimeoutAdapter()
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.host = normalize_host(hostname)
        self.plain_http = plain_http
        self.origin = origin(f"{'http' if plain_http else 'https'}://{hostname}/")
        self._verify = tls_verify
        self._credentials = credentials
        self._config = config
        self._basic_accepted = False  # the registry took our Basic header: send it up front
        self._token: str | None = None
        #: why credentials were not sent in answer to the last challenge (for the error message)
        self.withheld: str | None = None
        #: whether the registry's credentials were sent at all (to it or its own token service)
        self.sent_credentials = False

    def auth_hint(self) -> str:
        """What to do about a 401/403 (for :mod:`.registry`'s message): never a secret."""
        if self.withheld:
            return self.withheld
        if self._credentials is None:
            return (self._config.lease_note
                    or f"no credentials are configured for {self.host}; {HOW_TO_CONFIGURE}")
        if self.sent_credentials:
            return f"the credentials for {self.host} from {self._credentials.source} were refused; check them"
        return (f"the credentials for {self.host} from {self._credentials.source} were not asked for (the registry "
                "sent no challenge vmsidecar answers); check the registry's auth setup")

    def do_request(
        self,
        url: str,
        method: str = "GET",
        data: dict | bytes | None = None,
        headers: dict | None = None,
        json: dict | None = None,
        stream: bool = False,
    ) -> requests.Response:
        """Send one request with our auth, retrying only an unreachable registry, briefly.

        :raise Unreachable: no answer after :data:`TRIES` tries.
        :raise requests.exceptions.SSLError: TLS failed (never retried).
        """
        for attempt in range(TRIES):
            _check_abort()  # a pull given up sends nothing more (its connection was shut down: no retry)
            try:
                return self._send_with_auth(url, method, data, dict(headers or {}), json, stream)
            except requests.exceptions.SSLError:
                raise  # a certificate problem is not "unreachable" and retrying cannot fix it
            except (requests.ConnectionError, requests.Timeout) as exc:
                _check_abort()
                if attempt == TRIES - 1:
                    raise Unreachable(str(exc)) from exc
                _pause(BACKOFF[attempt])
        raise AssertionError("unreachable")

    def _send_with_auth(
        self, url: str, method: str, data: dict | bytes | None, headers: dict, json: dict | None, stream: bool
    ) -> requests.Response:
        """Send once, answering a Basic or Bearer challenge of the registry by sending again."""
        headers.pop("Authorization", None)
        own = origin(url) == self.origin  # an upload Location may point elsewhere: nothing goes there
        if own and self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        elif own and self._credentials and self._basic_accepted:
            headers["Authorization"] = f"Basic {self._credentials.basic()}"

        def send() -> requests.Response:
            return self.session.request(
                method, url, data=data, json=json, headers=headers, stream=stream, verify=self._verify
            )

        response = send()
        if response.status_code not in (401, 403) or not own:
            return response
        scheme, _, rest = response.headers.get("Www-Authenticate", "").strip().partition(" ")
        if scheme.lower() == "basic":
            if not self._credentials or self._basic_accepted:
                return response
            headers["Authorization"] = f"Basic {self._credentials.basic()}"
            self.sent_credentials = True
        elif scheme.lower() == "bearer":
            token = self._request_token(_challenge_params(rest))
            if token is None:
                return response
            self._token = token
            headers["Authorization"] = f"Bearer {token}"
        else:
            return response
        response.close()
        response = send()
        if headers["Authorization"].startswith("Basic"):
            self._basic_accepted = response.status_code not in (401, 403)
        return response

    def _request_token(self, params: dict[str, str]) -> str | None:
        """A token from the challenge's realm, asked with the registry's credentials where they may go.

        The registry's own credentials go to a realm on the registry's own host[:port] and to a
        token service on another host it is known to use (:meth:`_realm_credentials`); any other
        realm is asked anonymously (public registries hand out anonymous pull tokens); a plain-HTTP
        realm is asked at all only when its host is listed as insecure (or is the registry, spoken
        to in HTTP on purpose). Its answer is read up to :data:`MAX_TOKEN_BODY`.
        """
        self.withheld = None
        realm = params.get("realm", "")
        scheme, realm_host, _ = origin(realm)
        if scheme not in ("http", "https") or not realm_host:
            self.withheld = f"registry {self.host} named an unusable token service {realm!r}; check its auth setup"
            return None
        realm_key = normalize_host(urlsplit(realm).netloc)
        creds = self._realm_credentials(realm_key)
        # a plain-HTTP realm is a URL of the registry's choosing fetched in the clear: the pod's
        # loopback or the cloud metadata service (HTTP only) on a lease holder's word. Only a host
        # listed as insecure on purpose (or the registry itself, spoken to in HTTP on purpose) is asked
        if scheme == "http" and not (self._config.is_insecure(realm_key) or (realm_key == self.host and self.plain_http)):
            self.withheld = (
                f"registry {self.host} named the token service {realm} in plain HTTP, which is not listed as "
                f"insecure, so vmsidecar did not ask it; use an HTTPS token service, or list {realm_key} "
                "as insecure if it is plain HTTP on purpose"
            )
            return None
        query = {k: params[k] for k in ("service", "scope") if params.get(k)}
        headers = {"Accept": "application/json"}
        if creds is not None:
            headers["Authorization"] = f"Basic {creds.basic()}"
            self.sent_credentials = True
        response = self.session.get(realm, params=query, headers=headers, verify=self._verify, stream=True)
        with response:
            if response.status_code != 200:
                return None
            body = read_body(response, MAX_TOKEN_BODY)
        if body is None:
            self.withheld = (
                f"the token service {realm_key} of registry {self.host} answered with more than "
                f"{MAX_TOKEN_BODY >> 20} MiB, where a token is a few KB, so vmsidecar refused it; check the "
                "registry's token service"
            )
            return None
        try:
            doc = load_document(body)  # bounded nesting: never a RecursionError
        except ValueError:
            return None
        token = doc.get("token") or doc.get("access_token") if isinstance(doc, dict) else None
        return token if isinstance(token, str) and token else None

    def _realm_credentials(self, realm_key: str) -> Credentials | None:
        """The credentials a token service on ``realm_key`` (``host[:port]``) is asked with: only ever
        the registry's own, and to another host only when it is a token service the registry is known
        to use (:data:`KNOWN_TOKEN_SERVICES`: then its own entry, if the registry has none) or the auth
        file's entry for it holds the very same credentials (the owner's word that it takes them).

        Never another host's credentials on the registry's word: the registry names the realm, the
        service and the scope, and receives the token issued (a token for that host's private
        repositories, handed to whoever the registry is). Sets :attr:`withheld` when it holds back.
        """
        if realm_key == self.host:
            return self._credentials
        mine, its_own = self._credentials, self._config.credentials_for(realm_key)
        if realm_key in KNOWN_TOKEN_SERVICES.get(self.host, frozenset()):
            return mine or its_own
        if mine is not None and its_own is not None and (mine.username, mine.password) == (
                its_own.username, its_own.password):
            return mine
        if mine is not None or its_own is not None:
            self.withheld = (
                f"registry {self.host} sent vmsidecar for a token to the token service {realm_key}, another "
                f"host, so vmsidecar asked it without credentials: it sends a token service on another host "
                f"{self.host}'s credentials only when the auth file's entry for {realm_key} holds the same "
                f"ones, and never {realm_key}'s own on {self.host}'s word (the token would go to "
                f"{self.host}); if {realm_key} is {self.host}'s token service, give both entries the "
                "registry's credentials"
            )
        return None


def _challenge_params(text: str) -> dict[str, str]:
    """``realm="…",service="…",scope="…"`` as a dict (quoted values may hold commas)."""
    params: dict[str, str] = {}
    rest = text.strip()
    while rest:
        key, sep, rest = rest.partition("=")
        if not sep:
            break
        rest = rest.lstrip()
        if rest.startswith('"'):
            value, _, rest = rest[1:].partition('"')
        else:
            value, _, rest = rest.partition(",")
        params[key.strip().strip(",").strip().lower()] = value
        rest = rest.lstrip().lstrip(",")
    return params


class Unreachable(Exception):
    """No answer from the registry after :data:`TRIES` tries (:mod:`.registry` words the error)."""
