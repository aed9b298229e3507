"""Who may call what: TLS and mutual TLS, bearer tokens, per-stream access rules.

**Transport.** With `tls_cert_file` and `tls_key_file` the server speaks TLS only;
with `tls_client_ca_file` too, every client must present a certificate that CA
signed (mutual TLS). The files are re-read when they change (checked every
`reload_interval_ms`, and on SIGHUP): gRPC's dynamic server credentials ask
`TlsCredentials` for the current certificates at each new connection, so renewed
certificates apply to new connections without a restart. A replacement that does
not load (a key that does not match its certificate, a truncated file) is refused
and logged, and the previous certificates stay in use.

**Identity.** A call names its caller with `authorization: Bearer <token>`
metadata; the token file maps tokens (or their SHA-256, so the file need not hold
secrets) to a principal and its roles. Tokens are compared with
`hmac.compare_digest` against every entry, so the time taken says nothing about
how close a guess was. Under mutual TLS, a call without a token is the principal
named by its certificate's common name. Names of the form `role:NAME` are reserved
for roles: a tokens file may not give them to a principal, and a certificate with
such a common name is refused (UNAUTHENTICATED, logged as a warning). The token
is checked from the call's metadata before its request is read: a call without
valid credentials is refused without a byte of its body read or parsed.

**Authorization.** With `acl_file` set, every StreamLogService call needs an
identity (else UNAUTHENTICATED) and a rule that allows it (else
PERMISSION_DENIED): nothing is allowed by default. Health and reflection stay
open, so probes and grpcurl's `list` work without credentials. A rule names
principals (a name; `role:NAME`, matching the callers the tokens file gives role
NAME; or `*` for any identified caller), stream-name
patterns (`fnmatch`: `*`, `?`, `[abc]`), optionally consumer-group patterns, and
permissions:

- `read`: Read, Subscribe, GetStreamInfo, SeekTime, CountRange, ListGroups; with
  a group: GetPending, GetGroupInfo (looking at a group, changing nothing).
- `consume`, with a group: what changes the group's deliveries: group reads
  (Read and Subscribe naming the group), Consume, Ack, Nack, Claim, AutoClaim, and
  DeleteConsumer (its pending entries go back to the group, no more than Claim
  could take). `consume` includes `read`: Kafka and Redis, too, ask for more than
  read rights on the topic or key to consume through a group.
- `write`: Append, Publish (checked on each message's stream: a message refused is
  answered PERMISSION_DENIED and the session goes on), AppendMany (checked on each
  batch's stream: a batch refused gets PERMISSION_DENIED in its result, the others
  are served), and being the dead-letter stream of a group one configures.
- `admin`: DeleteStream, Trim, SetStreamConfig, ReassignReplicas; with a group: CreateGroup,
  DeleteGroup, SetGroupOffset, SetGroupConfig (what shapes the group for all its
  consumers: its existence, position and redelivery policy). `admin` includes
  the other three.

A rule without `groups` covers its streams and all their groups; a rule with
`groups` covers only calls on those groups (a worker may consume through group
"billing" without being able to read the stream directly or touch other groups).
ListStreams and DescribeCluster are open to every identified caller and list only
the streams some rule lets it touch (DescribeCluster shows every node: clients
need their addresses to reach stream leaders); their page tokens are then opaque
handles, so a page that ends on a hidden stream does not reveal that stream's name.

**Reloads** of the token and ACL files check the calls that outlive them again
(Subscribe, Consume, blocking Reads: the server's open calls, service/opencalls.py),
and end those the new files refuse, with the refusal as their status: wherever
such a call waits, it stops there. Replies already handed to gRPC still reach
the client, before the status.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import contextvars
import dataclasses
import fnmatch
import functools
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import tomllib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

from service import batchparts
from service.callcontext import CallContext
from service.config import ConfigError, Settings
from service.errors import ServiceError
from service.interceptors import (
    MESSAGE_SESSIONS,
    SessionBehavior,
    StreamBehavior,
    UnaryBehavior,
    WrappingInterceptor,
    checked,
    iterate,
)
from service.opencalls import OpenCalls

log = logging.getLogger(__name__)

READ, WRITE, CONSUME, ADMIN = "read", "write", "consume", "admin"
PERMISSIONS = (READ, WRITE, CONSUME, ADMIN)
_GRANTS = {
    READ: frozenset({READ}),
    WRITE: frozenset({WRITE}),
    CONSUME: frozenset({CONSUME, READ}),
    ADMIN: frozenset(PERMISSIONS),
}
ANY_PRINCIPAL = "*"
ROLE_PREFIX = "role:"
# Shorter tokens are refused: a bearer token is a password that is never typed.
MIN_TOKEN_CHARS = 16
# Page handles of ListStreams and DescribeCluster kept per server; older ones: list again.
PAGE_HANDLES = 10_000
_DECISION_CACHE = 65_536


@dataclasses.dataclass(frozen=True)
class Principal:
    """An identified caller: a name, its roles, and how it was identified."""

    name: str
    roles: frozenset[str] = frozenset()
    via: str = "token"  # "token" or "certificate"


@dataclasses.dataclass(frozen=True)
class Access:
    """What an RPC needs: a permission, on the stream or (group_scoped) on the request's group."""

    permission: str
    group_scoped: bool = False
    # Read and Subscribe act on a group only when the request names one, and then need this
    # permission on that group instead.
    named_group_permission: str | None = None


# Every StreamLogService RPC except the catalog's (filtered instead). An RPC missing here is
# refused at start-up when authorization is on, so a new RPC is never open by accident.
METHOD_ACCESS: dict[str, Access] = {
    "Append": Access(WRITE),
    "Publish": Access(WRITE),  # checked on every message's stream
    "AppendMany": Access(WRITE),  # checked on every batch's stream
    "Read": Access(READ, named_group_permission=CONSUME),
    "Subscribe": Access(READ, named_group_permission=CONSUME),
    "GetStreamInfo": Access(READ),
    "SeekTime": Access(READ),
    "CountRange": Access(READ),
    "ListGroups": Access(READ),
    "Ack": Access(CONSUME, group_scoped=True),
    "Consume": Access(CONSUME, group_scoped=True),
    "Nack": Access(CONSUME, group_scoped=True),
    "Claim": Access(CONSUME, group_scoped=True),
    "AutoClaim": Access(CONSUME, group_scoped=True),
    "DeleteConsumer": Access(CONSUME, group_scoped=True),
    "GetPending": Access(READ, group_scoped=True),
    "GetGroupInfo": Access(READ, group_scoped=True),
    "CreateGroup": Access(ADMIN, group_scoped=True),
    "DeleteGroup": Access(ADMIN, group_scoped=True),
    "SetGroupOffset": Access(ADMIN, group_scoped=True),
    "SetGroupConfig": Access(ADMIN, group_scoped=True),
    "DeleteStream": Access(ADMIN),
    "Trim": Access(ADMIN),
    "SetStreamConfig": Access(ADMIN),
    "ReassignReplicas": Access(ADMIN),
}
# RPCs that list streams, open to every identified caller: their replies keep only the
# streams the caller may see, and their page tokens become handles. Each lists `streams`,
# as names or as messages with a `name`.
CATALOG_METHODS = frozenset({"ListStreams", "DescribeCluster"})


# ---------------------------------------------------------------------------- files


def _read_toml(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: {exc}") from None


def _string_list(value: Any, where: str, *, allow_empty: bool = False) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: expected a list of non-empty strings, got {value!r}")
    if not value and not allow_empty:
        raise ConfigError(f"{where}: must not be empty")
    return tuple(value)


def _check_keys(table: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(unknown)}; known: {', '.join(allowed)}")


class TokenStore:
    """Bearer tokens -> principals. Only SHA-256 digests of the tokens are kept in memory."""

    def __init__(self, entries: Iterable[tuple[bytes, Principal]] = ()) -> None:
        self._entries = list(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str) -> Principal | None:
        """The principal holding `token`, in time independent of which entry (if any) matches."""
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for known, principal in self._entries:
            # No early exit: every entry is compared, so timing reveals nothing.
            if hmac.compare_digest(digest, known):
                found = principal
        return found


def load_tokens(path: str) -> TokenStore:
    """Read a tokens file: `[[tokens]]` tables with principal, token or sha256, roles."""
    document = _read_toml(path, "tokens file")
    _check_keys(document, ("tokens",), f"tokens file {path}")
    tables = document.get("tokens", [])
    if not isinstance(tables, list):
        raise ConfigError(f"tokens file {path}: `tokens` must be an array of tables ([[tokens]])")
    entries: list[tuple[bytes, Principal]] = []
    seen: set[bytes] = set()
    for index, table in enumerate(tables):
        where = f"tokens file {path}, tokens[{index}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: expected a table")
        _check_keys(table, ("principal", "token", "sha256", "roles"), where)
        name = table.get("principal")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: `principal` must be a non-empty string")
        if name.startswith(ROLE_PREFIX):
            raise ConfigError(
                f"{where}: principal {name!r} uses the `{ROLE_PREFIX}` form, which names roles only; "
                "give the principal a plain name and list its roles in `roles`"
            )
        roles = frozenset(_string_list(table.get("roles", []), f"{where}, roles", allow_empty=True))
        if ("token" in table) == ("sha256" in table):
            raise ConfigError(f"{where}: set exactly one of `token` and `sha256`")
        if "token" in table:
            token = table["token"]
            if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
                raise ConfigError(
                    f"{where}: `token` must be a string of at least {MIN_TOKEN_CHARS} characters"
                )
            digest = hashlib.sha256(token.encode()).digest()
        else:
            text = table["sha256"]
            try:
                digest = bytes.fromhex(text) if isinstance(text, str) else b""
            except ValueError:
                digest = b""
            if len(digest) != hashlib.sha256().digest_size:
                raise ConfigError(f"{where}: `sha256` must be 64 hexadecimal digits")
        if digest in seen:
            raise ConfigError(f"{where}: the same token is listed twice")
        seen.add(digest)
        entries.append((digest, Principal(name, roles, "token")))
    return TokenStore(entries)


def hash_token(token: str) -> str:
    """The `sha256` value to put in a tokens file for `token`."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Rule:
    streams: tuple[str, ...]
    groups: tuple[str, ...] | None
    grants: frozenset[str]
    # The rule's principals, split: `*`, plain names, and the roles of `role:NAME` entries.
    anyone: bool
    names: frozenset[str]
    roles: frozenset[str]

    def applies_to(self, principal: Principal) -> bool:
        # A `role:NAME` entry matches the roles a tokens file gives, never a principal's name:
        # no certificate or token can be named into a role.
        return self.anyone or principal.name in self.names or not self.roles.isdisjoint(principal.roles)

    def covers_stream(self, stream: str) -> bool:
        return any(fnmatch.fnmatchcase(stream, pattern) for pattern in self.streams)


class Acl:
    """Access rules; immutable, so a reload swaps in a new one (and a fresh decision cache)."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = tuple(rules)
        self._decisions: dict[tuple[Principal, str, str, str | None], bool] = {}

    def allows(self, principal: Principal, permission: str, stream: str, group: str | None = None) -> bool:
        """Whether a rule grants `permission` on `stream` (group None) or on `group` of `stream`."""
        key = (principal, permission, stream, group)
        decision = self._decisions.get(key)
        if decision is None:
            decision = any(self._grants(rule, principal, permission, stream, group) for rule in self.rules)
            if len(self._decisions) >= _DECISION_CACHE:
                self._decisions.clear()  # crude bound; refilling costs a few fnmatch calls
            self._decisions[key] = decision
        return decision

    @staticmethod
    def _grants(rule: Rule, principal: Principal, permission: str, stream: str, group: str | None) -> bool:
        if permission not in rule.grants or not rule.applies_to(principal) or not rule.covers_stream(stream):
            return False
        if rule.groups is None:
            return True  # a stream rule covers the stream and every group on it
        return group is not None and any(fnmatch.fnmatchcase(group, pattern) for pattern in rule.groups)

    def visible(self, principal: Principal, stream: str) -> bool:
        """Whether any rule lets `principal` do anything with `stream` (ListStreams shows it)."""
        return any(rule.applies_to(principal) and rule.covers_stream(stream) for rule in self.rules)


def load_acl(path: str) -> Acl:
    """Read an ACL file: `[[rules]]` tables with principals, streams, groups, permissions."""
    document = _read_toml(path, "acl file")
    _check_keys(document, ("rules",), f"acl file {path}")
    tables = document.get("rules", [])
    if not isinstance(tables, list):
        raise ConfigError(f"acl file {path}: `rules` must be an array of tables ([[rules]])")
    rules = []
    for index, table in enumerate(tables):
        where = f"acl file {path}, rules[{index}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: expected a table")
        _check_keys(table, ("principals", "streams", "groups", "permissions"), where)
        for key in ("principals", "streams", "permissions"):
            if key not in table:
                raise ConfigError(f"{where}: `{key}` is required")
        permissions = _string_list(table["permissions"], f"{where}, permissions")
        bad = [p for p in permissions if p not in PERMISSIONS]
        if bad:
            raise ConfigError(f"{where}: unknown permissions {bad}; known: {', '.join(PERMISSIONS)}")
        groups = table.get("groups")
        principals = _string_list(table["principals"], f"{where}, principals")
        roles = frozenset(p[len(ROLE_PREFIX) :] for p in principals if p.startswith(ROLE_PREFIX))
        if "" in roles:
            raise ConfigError(f"{where}, principals: `{ROLE_PREFIX}` needs a role name")
        rules.append(
            Rule(
                streams=_string_list(table["streams"], f"{where}, streams"),
                groups=None if groups is None else _string_list(groups, f"{where}, groups"),
                grants=frozenset().union(*(_GRANTS[p] for p in permissions)),
                anyone=ANY_PRINCIPAL in principals,
                names=frozenset(
                    p for p in principals if p != ANY_PRINCIPAL and not p.startswith(ROLE_PREFIX)
                ),
                roles=roles,
            )
        )
    return Acl(rules)


# ---------------------------------------------------------------------------- TLS


class TlsCredentials:
    """Server certificates from files, swapped in for new connections when the files change."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "") -> None:
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self._current = self._load()
        self._pending: Any = None  # a new configuration for gRPC's next fetch
        self._contexts: list[ssl.SSLContext] = []  # handed to the HTTP API (ssl_context)

    def _load(self) -> Any:
        """Read and check the files: the key must match the certificate, the CA must parse."""
        try:
            check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            check.load_cert_chain(self.cert_file, self.key_file)
            if self.client_ca_file:
                check.load_verify_locations(self.client_ca_file)
            cert, key = Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes()
            ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"TLS files ({self.cert_file}, {self.key_file}) do not load: {exc}") from None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._current, self._fetch, require_client_authentication=bool(self.client_ca_file)
        )

    def _fetch(self) -> Any:
        # Called by gRPC (on its own threads) before each handshake: None keeps the current one.
        pending, self._pending = self._pending, None
        return pending

    def reload(self) -> None:
        """Load the files again; a failure raises ConfigError and leaves the old certificates."""
        self._current = self._load()
        self._pending = self._current
        for context in self._contexts:
            self._load_into(context)

    def ssl_context(self) -> ssl.SSLContext:
        """The same certificates for the HTTP API (service/http/). A reload gives its new
        connections the new certificate and key; a client CA added by a reload is trusted
        alongside the old one until a restart (an SSLContext can add CAs, not drop them)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._load_into(context)
        self._contexts.append(context)
        return context

    def _load_into(self, context: ssl.SSLContext) -> None:
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca_file:
            context.load_verify_locations(self.client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED

    def files(self) -> list[str]:
        return [f for f in (self.cert_file, self.key_file, self.client_ca_file) if f]


# ---------------------------------------------------------------------------- calls


class AuthState:
    """The tokens and rules in force; `reload` swaps both or neither."""

    def __init__(self, tokens_file: str, acl_file: str) -> None:
        self.tokens_file, self.acl_file = tokens_file, acl_file
        self.tokens, self.acl = self._load()
        # Called after each successful reload (from whichever thread reloaded).
        self.listeners: list[Callable[[], None]] = []

    def _load(self) -> tuple[TokenStore, Acl]:
        tokens = load_tokens(self.tokens_file) if self.tokens_file else TokenStore()
        return tokens, load_acl(self.acl_file)

    def reload(self) -> None:
        self.tokens, self.acl = self._load()
        for listener in self.listeners:
            listener()

    def files(self) -> list[str]:
        return [f for f in (self.tokens_file, self.acl_file) if f]

    def stream_filter(self, authorization: str | None) -> Callable[[str], bool] | None:
        """For the metrics endpoint: which streams a scraper may see, by the rule ListStreams
        follows: none without a token, those of the token's principal with one; None (refused)
        for an `authorization` value that holds no known bearer token."""
        if not authorization:
            return _no_stream
        try:
            principal = bearer_principal(self.tokens, authorization)
        except Denied:
            return None
        return functools.partial(self.acl.visible, principal)


def _no_stream(stream: str) -> bool:
    return False


def bearer_principal(tokens: TokenStore, authorization: str) -> Principal:
    """The principal of an `authorization` value `Bearer <token>`; Denied if malformed or unknown."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Denied(
            grpc.StatusCode.UNAUTHENTICATED, "authorization metadata must be `Bearer <token>`", "malformed"
        )
    principal = tokens.lookup(token.strip())
    if principal is None:
        raise Denied(grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token", "unknown_token")
    return principal


# The principal `admit` found in the call's token (None: none sent, a client
# certificate names the caller), for the handler of the same call (the same task).
_UNCHECKED = Principal("")
_CALLER: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("caller", default=_UNCHECKED)


class Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, reason: str, level: int = logging.INFO) -> None:
        super().__init__(message)
        self.code, self.message, self.reason, self.level = code, message, reason, level


# observer(event, detail): told of every refusal, e.g. to count it (service/metrics.py).
Observer = Callable[[str, str], None]


class AuthInterceptor(WrappingInterceptor):
    """Identifies the caller of each StreamLogService call and checks the rules."""

    def __init__(
        self,
        service: Any,
        state: AuthState,
        calls: OpenCalls,
        settings: Settings,
        observer: Observer | None = None,
        *,
        certificates: bool = False,
    ) -> None:
        """`calls`: the server's open calls, checked again when the tokens and rules are reloaded;
        `settings`: the server's (the bounds of an AppendMany request as a whole, checked before
        its batches); `certificates`: mutual TLS is on, so a client certificate identifies a
        caller too."""
        super().__init__(service.full_name)
        missing = [m.name for m in service.methods if m.name not in METHOD_ACCESS.keys() | CATALOG_METHODS]
        if missing:
            raise ConfigError(f"no access rule class for RPCs {', '.join(missing)} (service/auth.py)")
        self.state = state
        self._settings = settings
        self._observer = observer
        self._certificates = certificates
        # Catalog page handle -> (principal name, the servicer's token); oldest dropped first.
        self._pages: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._calls = calls
        state.listeners.append(self._reloaded)

    # -- identity and decisions

    def identify(self, context: CallContext, *, again: bool = False) -> Principal:
        """The caller: from its token (checked by `admit` for this call, or here when
        `again`, as on a reload), else from its client certificate."""
        principal = _UNCHECKED if again else _CALLER.get()
        if principal is _UNCHECKED:
            principal = self._bearer(context.invocation_metadata())
        if principal is not None:
            return principal
        names = (context.auth_context() or {}).get("x509_common_name")
        if not names:
            raise self._missing()
        name = next(iter(names)).decode("utf-8", "replace")
        if name.startswith(ROLE_PREFIX):
            # A CA-signed certificate named like a role: refused, never taken as that role.
            raise Denied(
                grpc.StatusCode.UNAUTHENTICATED,
                f"client certificate common name {name!r} uses the reserved `{ROLE_PREFIX}` form: "
                "a certificate names a principal, never a role",
                "reserved_name",
                logging.WARNING,
            )
        return Principal(name, frozenset(), "certificate")

    def _bearer(self, metadata: Any) -> Principal | None:
        """The principal of the call's bearer token; None when it has none and a client
        certificate may name it instead."""
        headers = [value for key, value in metadata or () if key == "authorization"]
        if len(headers) > 1:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "more than one authorization header", "malformed")
        if headers:
            return bearer_principal(self.state.tokens, headers[0])
        if self._certificates:
            return None
        raise self._missing()

    def _missing(self) -> Denied:
        accepted = [
            "`authorization: Bearer <token>` metadata" if self.state.tokens_file else "",
            "a client certificate" if self._certificates else "",
        ]
        return Denied(
            grpc.StatusCode.UNAUTHENTICATED,
            "this server needs credentials: " + " or ".join(a for a in accepted if a),
            "missing",
        )

    def check(self, method: str, request: Any, principal: Principal) -> None:
        access = METHOD_ACCESS[method]
        stream = request.stream
        permission, group = access.permission, None
        if access.group_scoped:
            group = request.group
        elif access.named_group_permission is not None and request.group:
            permission, group = access.named_group_permission, request.group
        if not self.state.acl.allows(principal, permission, stream, group):
            target = f"stream {stream!r}" + (f" group {group!r}" if group is not None else "")
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{principal.name!r} may not {method} on {target}: no rule grants {permission}",
                "denied",
            )
        if method not in _GROUP_CONFIG_METHODS:
            return  # (a getattr that misses costs a microsecond: no probing of other requests)
        if method == "CreateGroup" and request.create_stream:
            self._need(principal, WRITE, stream, f"{method} with create_stream")
        dead_letters = request.config.dead_letter_stream
        if dead_letters:
            self._need(principal, WRITE, dead_letters, f"{method} with dead_letter_stream")

    def _need(self, principal: Principal, permission: str, stream: str, what: str) -> None:
        if not self.state.acl.allows(principal, permission, stream):
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{principal.name!r} may not {what} {stream!r}: no rule grants {permission} on it",
                "denied",
            )

    async def _refuse(self, context: CallContext, method: str, denied: Denied) -> None:
        self._report(context, method, denied)
        await context.abort(denied.code, denied.message)

    def _report(self, context: CallContext, method: str, denied: Denied) -> None:
        log.log(
            denied.level,
            "call refused: %s",
            denied.message,
            extra={"method": method, "peer": context.peer(), "code": denied.code.name},
        )
        if self._observer is not None:
            self._observer("auth", denied.reason)

    # -- before the request is read

    def admit(
        self, handler_call_details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler
    ) -> grpc.RpcMethodHandler:
        """Check the token in the call's metadata before its request is read: a call with no
        valid credentials gets a handler that refuses it without reading (or parsing) a byte of
        its body, however large. Rules, which need the request, are checked by the wrappers."""
        try:
            _CALLER.set(self._bearer(handler_call_details.invocation_metadata))
        except Denied as denied:
            return self._refusal(handler_call_details.method[len(self._prefix) :], denied)
        return handler

    def _refusal(self, method: str, denied: Denied) -> grpc.RpcMethodHandler:
        async def refuse(requests: AsyncIterator[Any], context: CallContext) -> None:
            await self._refuse(context, method, denied)

        # A client-streaming handler: gRPC reads a request message only when the handler asks,
        # and this one never does. (It is served as it is: service/interceptors.py.)
        return grpc.stream_unary_rpc_method_handler(refuse)

    # -- calls that outlive a reload

    def _reloaded(self) -> None:
        # Reloads run on the loop (SIGHUP, the file watcher) or on another thread (tests, tools).
        loop = self._calls.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: no calls are open
                loop.call_soon_threadsafe(self._recheck)

    def _recheck(self) -> None:
        """Check every open call against the tokens and rules now in force; end those refused."""
        for call in self._calls:
            if call.ending is not None:
                continue
            try:
                self.check(call.method, call.request, self.identify(call.context, again=True))
            except Denied as denied:
                revoked = Denied(
                    denied.code,
                    f"access withdrawn when the token and ACL files were reloaded: {denied.message}",
                    "revoked",
                )
                self._report(call.context, call.method, revoked)
                call.end(revoked.code, revoked.message)

    # -- wrappers

    def wrap_unary(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        if method in CATALOG_METHODS:
            return self._wrap_catalog(method, behavior)
        if method in batchparts.BATCH_CALLS:
            return self._wrap_batches(method, behavior)

        async def authorized(request: Any, context: CallContext) -> Any:
            try:
                self.check(method, request, self.identify(context))
            except Denied as denied:
                await self._refuse(context, method, denied)
            return await behavior(request, context)

        return authorized

    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        async def authorized(request: Any, context: CallContext) -> AsyncIterator[Any]:
            try:
                self.check(method, request, self.identify(context))
            except Denied as denied:
                await self._refuse(context, method, denied)
            async with contextlib.aclosing(iterate(behavior, request, context)) as replies:
                async for reply in replies:
                    yield reply

        return authorized

    def wrap_session(self, method: str, behavior: SessionBehavior) -> SessionBehavior:
        if method not in MESSAGE_SESSIONS:
            return super().wrap_session(method, behavior)

        async def authorized(requests: AsyncIterator[Any], context: CallContext) -> AsyncGenerator[Any, None]:
            try:
                principal = self.identify(context)
            except Denied as denied:
                await self._refuse(context, method, denied)

            check = self._part_check(method, principal, context)
            async with contextlib.aclosing(behavior(checked(requests, check), context)) as replies:
                async for reply in replies:
                    yield reply

        return authorized

    def _part_check(
        self, method: str, principal: Principal, context: CallContext
    ) -> Callable[[Any], tuple[grpc.StatusCode, str] | None]:
        """The check of each part of a call whose parts are answered one by one (a Publish message,
        an AppendMany batch): None to let it pass, else the refusal to answer it with."""

        def check(request: Any) -> tuple[grpc.StatusCode, str] | None:
            try:
                self.check(method, request, principal)
            except Denied as denied:
                self._report(context, method, denied)
                return denied.code, denied.message
            return None

        return check

    def _wrap_batches(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        """Each batch checked on its own stream; one refused is answered in its result."""

        async def authorized(request: Any, context: CallContext) -> Any:
            try:
                principal = self.identify(context)
            except Denied as denied:
                await self._refuse(context, method, denied)

            try:
                refused, passed = batchparts.checked(
                    request, self._settings, self._part_check(method, principal, context)
                )
            except ServiceError as exc:
                await context.abort(exc.code, exc.message)
            return await batchparts.passed_on(request, refused, passed, behavior, context)

        return authorized

    def _wrap_catalog(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        async def filtered(request: Any, context: CallContext) -> Any:
            try:
                principal = self.identify(context)
            except Denied as denied:
                await self._refuse(context, method, denied)
            if request.page_token:
                held = self._pages.get(request.page_token)
                if held is None or held[0] != principal.name:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "page_token: not a token this server issued to you, or too old; list again",
                    )
                inner = type(request)()
                inner.CopyFrom(request)
                inner.page_token = held[1]
                request = inner
            reply = await behavior(request, context)
            acl = self.state.acl
            visible = [s for s in reply.streams if acl.visible(principal, _stream_name(s))]
            del reply.streams[:]
            reply.streams.extend(visible)
            if reply.next_page_token:
                handle = base64.urlsafe_b64encode(secrets.token_bytes(18)).decode()
                self._pages[handle] = (principal.name, reply.next_page_token)
                while len(self._pages) > PAGE_HANDLES:
                    self._pages.popitem(last=False)
                reply.next_page_token = handle
            return reply

        return filtered


def _stream_name(item: Any) -> str:
    """A catalog reply lists streams as names (ListStreams) or as messages with one."""
    return item if isinstance(item, str) else item.name


_GROUP_CONFIG_METHODS = frozenset({"CreateGroup", "SetGroupConfig"})


# ---------------------------------------------------------------------------- reloading


class FileWatcher:
    """Notices when files change: a new size, modification time or inode (a replaced file,
    as Kubernetes does when it updates a mounted Secret through a symlink swap)."""

    def __init__(self, paths: Iterable[str]) -> None:
        self._paths = list(paths)
        self._seen = self._snapshot()

    def _snapshot(self) -> dict[str, tuple[int, int, int] | None]:
        seen: dict[str, tuple[int, int, int] | None] = {}
        for path in self._paths:
            try:
                st = os.stat(path)
            except OSError:
                seen[path] = None  # missing for now (mid-replacement); a change when it returns
                continue
            seen[path] = (st.st_mtime_ns, st.st_size, st.st_ino)
        return seen

    def changed(self) -> bool:
        now = self._snapshot()
        changed, self._seen = now != self._seen, now
        return changed


class Security:
    """The TLS credentials and auth state of one server, and their reloading."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.tls = (
            TlsCredentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
            if settings.tls_cert_file
            else None
        )
        self.auth = AuthState(settings.tokens_file, settings.acl_file) if settings.acl_file else None
        files = (self.tls.files() if self.tls else []) + (self.auth.files() if self.auth else [])
        self._watcher = FileWatcher(files)
        self.reloads = 0
        self.failed_reloads = 0

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.server_credentials())

    def interceptor(
        self, service: Any, calls: OpenCalls, observer: Observer | None = None
    ) -> AuthInterceptor | None:
        if self.auth is None:
            return None
        certificates = self.tls is not None and bool(self.tls.client_ca_file)
        return AuthInterceptor(service, self.auth, calls, self._settings, observer, certificates=certificates)

    def reload(self, reason: str) -> bool:
        """Re-read every file; keep the old state of a part whose files do not load."""
        if self.tls is None and self.auth is None:
            log.info("reload (%s): no TLS, token or ACL files are configured", reason)
            return True
        ok = True
        for part in (self.tls, self.auth):
            if part is None:
                continue
            try:
                part.reload()
            except ConfigError as exc:
                ok = False
                log.error("reload (%s) refused, keeping the previous state: %s", reason, exc)
        if ok:
            self.reloads += 1
            log.info("reloaded TLS and auth files (%s)", reason)
        else:
            self.failed_reloads += 1
        return ok

    def reload_if_changed(self) -> bool | None:
        """Reload when a file changed since the last look; None when nothing changed."""
        if not self._watcher.changed():
            return None
        return self.reload("files changed")
