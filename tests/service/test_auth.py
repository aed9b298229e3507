"""Authentication and authorization: token and ACL files, the allow/deny matrix for every RPC,
TLS and mutual TLS handshakes, and reloading of certificates, tokens and rules."""

from __future__ import annotations

import base64
import logging
import queue
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from service import auth
from service.config import ConfigError, Settings, validate
from service.server import SERVICE
from storage import AppendBatch
from tests.service.certs import CertificateAuthority
from tests.service.helpers import ServerThread

DOCS = Path(__file__).resolve().parents[2] / "docs"

TOKENS = {
    "reader": "reader-token-0123456789",
    "writer": "writer-token-0123456789",
    "admin": "admin-token-01234567890",
    "worker": "worker-token-0123456789",
    "stranger": "stranger-token-01234567",
}

TOKENS_TOML = f"""
[[tokens]]
principal = "reader"
token = "{TOKENS["reader"]}"

[[tokens]]
principal = "writer"
sha256 = "{auth.hash_token(TOKENS["writer"])}"
roles = ["producers"]

[[tokens]]
principal = "admin"
token = "{TOKENS["admin"]}"

[[tokens]]
principal = "worker"
token = "{TOKENS["worker"]}"

[[tokens]]
principal = "stranger"
token = "{TOKENS["stranger"]}"
"""

ACL_TOML = """
[[rules]]
principals = ["reader"]
streams = ["s*"]
permissions = ["read"]

[[rules]]
principals = ["role:producers"]
streams = ["s*", "dlq"]
permissions = ["write"]

[[rules]]
principals = ["admin"]
streams = ["*"]
permissions = ["admin"]

# The worker consumes stream s1 through group g1 only.
[[rules]]
principals = ["worker"]
streams = ["s1"]
groups = ["g1"]
permissions = ["consume"]

[[rules]]
principals = ["stranger"]
streams = ["elsewhere-*"]
permissions = ["admin"]
"""


def write(path: Path, text: str) -> str:
    """Replace the file at once, as an operator's tools do (a server that watches the file must
    never read it half-written: an empty rules file is a valid one that allows nothing)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
    return str(path)


def bearer(principal: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[principal]}"),)


# ---------------------------------------------------------------------------- files


def test_token_lookup_finds_plain_and_hashed_tokens(tmp_path: Path) -> None:
    store = auth.load_tokens(write(tmp_path / "t.toml", TOKENS_TOML))
    assert store.lookup(TOKENS["reader"]) == auth.Principal("reader", frozenset(), "token")
    writer = store.lookup(TOKENS["writer"])
    assert writer is not None and writer.name == "writer" and writer.roles == {"producers"}
    assert store.lookup(TOKENS["reader"] + "x") is None
    assert store.lookup("") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[tokens]]\nprincipal = "a"\n', "exactly one of `token` and `sha256`"),
        ('[[tokens]]\nprincipal = "a"\ntoken = "short"\n', "at least 16 characters"),
        ('[[tokens]]\nprincipal = "a"\nsha256 = "abc"\n', "64 hexadecimal digits"),
        ('[[tokens]]\ntoken = "0123456789abcdef"\n', "`principal` must be"),
        ('[[tokens]]\nprincipal = "a"\ntoken = "0123456789abcdef"\ncolour = 1\n', "unknown keys colour"),
        (
            '[[tokens]]\nprincipal = "a"\ntoken = "0123456789abcdef"\n'
            '[[tokens]]\nprincipal = "b"\ntoken = "0123456789abcdef"\n',
            "listed twice",
        ),
        ("tokens = [", "not valid TOML"),
        # A principal named like a role would pass for it: the form is reserved.
        ('[[tokens]]\nprincipal = "role:admins"\ntoken = "0123456789abcdef"\n', "names roles only"),
    ],
)
def test_bad_token_files_are_refused_with_the_reason(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        auth.load_tokens(write(tmp_path / "t.toml", text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[rules]]\nprincipals = ["a"]\nstreams = ["*"]\npermissions = ["fly"]\n', "unknown permissions"),
        ('[[rules]]\nprincipals = ["a"]\npermissions = ["read"]\n', "`streams` is required"),
        ('[[rules]]\nprincipals = []\nstreams = ["*"]\npermissions = ["read"]\n', "must not be empty"),
        (
            '[[rules]]\nprincipals = ["a"]\nstreams = ["*"]\npermissions = ["read"]\nhost = "x"\n',
            "unknown keys",
        ),
        ('rules = "all"\n', "array of tables"),
        ('[[rules]]\nprincipals = ["role:"]\nstreams = ["*"]\npermissions = ["read"]\n', "needs a role name"),
    ],
)
def test_bad_acl_files_are_refused_with_the_reason(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        auth.load_acl(write(tmp_path / "a.toml", text))


def test_acl_decisions_follow_patterns_roles_groups_and_admin_implies_the_rest(tmp_path: Path) -> None:
    acl = auth.load_acl(write(tmp_path / "a.toml", ACL_TOML))
    reader = auth.Principal("reader")
    writer = auth.Principal("writer", frozenset({"producers"}))
    admin = auth.Principal("admin")
    worker = auth.Principal("worker")
    assert acl.allows(reader, "read", "s1") and acl.allows(reader, "read", "s1", "any-group")
    assert not acl.allows(reader, "read", "t1") and not acl.allows(reader, "write", "s1")
    assert acl.allows(writer, "write", "s9") and not acl.allows(writer, "read", "s9")
    assert not acl.allows(auth.Principal("writer"), "write", "s9")  # the role, not the name, grants it
    # A principal whose name looks like the role (a certificate's common name) is not in it.
    assert not acl.allows(auth.Principal("role:producers", frozenset(), "certificate"), "write", "s9")
    assert all(acl.allows(admin, p, "anything") for p in auth.PERMISSIONS)
    assert acl.allows(worker, "consume", "s1", "g1") and acl.allows(worker, "read", "s1", "g1")
    assert not acl.allows(reader, "consume", "s1", "g1")  # read on the stream takes nothing from groups
    assert acl.allows(admin, "consume", "s1", "g1")
    assert not acl.allows(worker, "read", "s1")  # no plain reads: the rule names groups
    assert not acl.allows(worker, "read", "s1", "g2") and not acl.allows(worker, "read", "s2", "g1")
    assert acl.visible(worker, "s1") and not acl.visible(worker, "s2")


def test_settings_refuse_auth_without_rules_or_identities(tmp_path: Path) -> None:
    tokens = write(tmp_path / "t.toml", TOKENS_TOML)
    rules = write(tmp_path / "a.toml", ACL_TOML)
    with pytest.raises(ConfigError, match="tokens_file needs acl_file"):
        validate(Settings(tokens_file=tokens))
    with pytest.raises(ConfigError, match="acl_file needs a way to identify callers"):
        validate(Settings(acl_file=rules))
    with pytest.raises(ConfigError, match="set both"):
        validate(Settings(tls_cert_file=tokens))
    with pytest.raises(ConfigError, match="is not a readable file"):
        validate(Settings(tokens_file=str(tmp_path / "missing"), acl_file=rules))
    validate(Settings(tokens_file=tokens, acl_file=rules))


def test_every_rpc_has_an_access_class() -> None:
    # A new RPC must be classified in service/auth.py, or servers with auth refuse to start.
    unclassified = {m.name for m in SERVICE.methods if m.name not in auth.METHOD_ACCESS}
    assert unclassified <= auth.CATALOG_METHODS


# ---------------------------------------------------------------------------- the matrix

# Expected decisions, written out by hand (not derived from auth.METHOD_ACCESS, which they check).
# "r": needs read on the stream; "w": write; "a": admin; "gr"/"gc"/"ga": read/consume/admin on the group.
EXPECTED_CLASS = {
    "Append": "w",
    "Publish": "w",  # each message: a refused one is answered so, the session goes on
    "AppendMany": "w",  # each batch: a refused one is answered so in its result
    "Read": "r",
    "Subscribe": "r",
    "GetStreamInfo": "r",
    "SeekTime": "r",
    "CountRange": "r",
    "ListGroups": "r",
    "Ack": "gc",
    "Consume": "gc",
    "Nack": "gc",
    "Claim": "gc",
    "AutoClaim": "gc",
    "DeleteConsumer": "gc",
    "GetPending": "gr",
    "GetGroupInfo": "gr",
    "CreateGroup": "ga",
    "DeleteGroup": "ga",
    "SetGroupOffset": "ga",
    "SetGroupConfig": "ga",
    "DeleteStream": "a",
    "Trim": "a",
    "SetStreamConfig": "a",
    "ReassignReplicas": "a",
}
# Who passes each class on stream s1 (group g1 where the call names one).
ALLOWED = {
    "r": {"reader", "admin"},
    "w": {"writer", "admin"},
    "a": {"admin"},
    "gr": {"reader", "admin", "worker"},  # the worker's consume includes read on its group
    "gc": {"admin", "worker"},  # read on the stream is not enough
    "ga": {"admin"},
}
DENIED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def request_for(method: Any, **fields: Any) -> Any:
    """A request of `method`'s type for stream s1 (and group g1, consumer c1, where it has them)."""
    request = getattr(pb, method.input_type.name)()
    names = {f.name for f in request.DESCRIPTOR.fields}
    defaults = {"stream": "s1", "group": "g1", "consumer": "c1"}
    for name, value in defaults.items():
        if name in names and method.name not in ("Read", "Subscribe"):
            setattr(request, name, value)
    if "stream" in names:
        request.stream = "s1"
    extra = {
        "Append": {"payloads": [b"x"]},
        "Publish": {"payloads": [b"x"]},
        "AppendMany": {"batches": [pb.AppendRequest(stream="s1", payloads=[b"x"])]},
        "Trim": {"keep_last": 1},
    }
    extra = extra.get(method.name, {})
    for name, value in {**extra, **fields}.items():
        field = getattr(request, name)
        if isinstance(value, list):
            field.extend(value)
        else:
            setattr(request, name, value)
    if "offsets" in names and not request.offsets and method.name in ("Ack", "Nack", "Claim"):
        request.offsets.append(0)
    return request


def call(channel: grpc.Channel, method: Any, request: Any, metadata: Any) -> grpc.StatusCode:
    """The status code of one call (OK for a Subscribe that sent its first reply, and for a
    Consume session of one request that ended OK; for a Publish session of one message, the
    message's own status; for an AppendMany of one batch, the batch's own status)."""
    path = f"/{SERVICE.full_name}/{method.name}"
    reply_type = getattr(pb, method.output_type.name)
    if method.client_streaming:
        session = channel.stream_stream(
            path,
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply_type.FromString,
        )
        try:
            replies = list(session(iter([request]), metadata=metadata, timeout=10))
            errors = [r.error.code for r in replies if method.name == "Publish" and r.HasField("error")]
            codes = (c for c in grpc.StatusCode if errors and c.value[0] == errors[0])
            return next(codes, grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            return exc.code()
    if method.server_streaming:
        stream = channel.unary_stream(path, request_serializer=type(request).SerializeToString)
        replies = stream(request, metadata=metadata, timeout=10)
        try:
            next(iter(replies))
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()
        finally:
            replies.cancel()
    unary = channel.unary_unary(
        path, request_serializer=type(request).SerializeToString, response_deserializer=reply_type.FromString
    )
    try:
        reply = unary(request, metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    batches = reply.results if method.name == "AppendMany" else []
    errors = [r.error.code for r in batches if r.HasField("error")]
    return next((c for c in grpc.StatusCode if errors and c.value[0] == errors[0]), grpc.StatusCode.OK)


@pytest.fixture
def auth_server(start_server: Callable[..., ServerThread], tmp_path: Path) -> ServerThread:
    server = start_server(
        tokens_file=write(tmp_path / "tokens.toml", TOKENS_TOML),
        acl_file=write(tmp_path / "acl.toml", ACL_TOML),
    )
    # Something to read, so allowed calls reach the engine (their answers vary; none is an auth refusal).
    server.server.engine.append("s1", AppendBatch([b"a", b"b"]))
    return server


@pytest.fixture
def auth_channel(auth_server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(auth_server.target) as channel:
        yield channel


def test_the_allow_deny_matrix_for_every_rpc(auth_channel: grpc.Channel) -> None:
    methods = [m for m in SERVICE.methods if m.name not in auth.CATALOG_METHODS]
    assert {m.name for m in methods} <= set(EXPECTED_CLASS), "classify new RPCs in EXPECTED_CLASS"
    mismatches = []
    for method in methods:
        allowed = ALLOWED[EXPECTED_CLASS[method.name]]
        for principal in TOKENS:
            code = call(auth_channel, method, request_for(method), bearer(principal))
            if (principal in allowed) == (code in DENIED):
                mismatches.append((method.name, principal, code.name))
            if principal not in allowed and code != grpc.StatusCode.PERMISSION_DENIED:
                mismatches.append((method.name, principal, code.name, "expected PERMISSION_DENIED"))
        # No credentials, a wrong token, a malformed header: UNAUTHENTICATED, whatever the RPC.
        for metadata in (
            (),
            (("authorization", "Bearer not-a-known-token"),),
            (("authorization", "Basic x"),),
        ):
            code = call(auth_channel, method, request_for(method), metadata)
            if code != grpc.StatusCode.UNAUTHENTICATED:
                mismatches.append((method.name, metadata, code.name))
    assert mismatches == []


def test_group_reads_need_consume_on_the_group_and_plain_reads_need_read(auth_channel: grpc.Channel) -> None:
    names = {m.name: m for m in SERVICE.methods}
    for name in ("Read", "Subscribe"):
        method = names[name]
        in_group = request_for(method, group="g1", consumer="c1")
        other_group = request_for(method, group="g2", consumer="c1")
        assert call(auth_channel, method, in_group, bearer("worker")) not in DENIED
        assert call(auth_channel, method, other_group, bearer("worker")) == grpc.StatusCode.PERMISSION_DENIED
        assert (
            call(auth_channel, method, request_for(method), bearer("worker"))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        # Read on the stream reads it, and takes nothing from its groups.
        assert call(auth_channel, method, request_for(method), bearer("reader")) not in DENIED
        assert call(auth_channel, method, in_group, bearer("reader")) == grpc.StatusCode.PERMISSION_DENIED
        assert call(auth_channel, method, other_group, bearer("admin")) not in DENIED


def docs_acl_example() -> str:
    """The example acl.toml of docs/OPERATIONS.md, as printed there."""
    (block,) = re.findall(r"```toml\n(# acl\.toml\n.*?)```", (DOCS / "OPERATIONS.md").read_text(), re.S)
    return block


def test_the_docs_read_only_spark_job_cannot_take_or_ack_entries_of_group_billing(
    start_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    tokens = {"spark-job": "spark-job-token-0123456789", "billing-worker": "billing-token-0123456789"}
    tokens_toml = "".join(f'[[tokens]]\nprincipal = "{p}"\ntoken = "{t}"\n' for p, t in tokens.items())
    server = start_server(
        tokens_file=write(tmp_path / "tokens.toml", tokens_toml),
        acl_file=write(tmp_path / "acl.toml", docs_acl_example()),
    )
    engine = server.server.engine
    engine.append("rides", AppendBatch([b"ride %d" % i for i in range(5)]))
    engine.create_group("rides", "billing", start="oldest")
    spark = (("authorization", f"Bearer {tokens['spark-job']}"),)
    worker = (("authorization", f"Bearer {tokens['billing-worker']}"),)
    group = {"stream": "rides", "group": "billing"}
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        # The worker has taken entries 0 and 1; they are pending, owned by it.
        taken = stub.Read(pb.ReadRequest(**group, consumer="w1", count=2), metadata=worker, timeout=5)
        assert [e.offset for e in taken.entries] == [0, 1]
        # The Spark job reads the stream ...
        read = stub.Read(pb.ReadRequest(stream="rides", count=10), metadata=spark, timeout=5)
        assert len(read.entries) == 5
        # ... and can neither take billing's entries, nor acknowledge, release or claim them.
        attempts = {
            "Read": pb.ReadRequest(**group, consumer="spark", count=5),
            "Subscribe": pb.SubscribeRequest(**group, consumer="spark"),
            "Consume": pb.ConsumeRequest(**group, consumer="spark", batches=1),
            "Ack": pb.AckRequest(**group, offsets=[0, 1]),
            "Nack": pb.NackRequest(**group, offsets=[0, 1]),
            "Claim": pb.ClaimRequest(**group, consumer="spark", offsets=[0, 1]),
            "AutoClaim": pb.AutoClaimRequest(**group, consumer="spark"),
            "DeleteConsumer": pb.DeleteConsumerRequest(**group, consumer="w1"),
        }
        for name, request in attempts.items():
            code = call(channel, SERVICE.methods_by_name[name], request, spark)
            assert code == grpc.StatusCode.PERMISSION_DENIED, name
        info = engine.group_info("rides", "billing")
        assert (info.cursor, info.pending, [c.name for c in info.consumers]) == (2, 2, ["w1"])
        # Billing sees every entry.
        rest = stub.Read(pb.ReadRequest(**group, consumer="w1", count=5), metadata=worker, timeout=5)
        assert [e.offset for e in rest.entries] == [2, 3, 4]
        acked = stub.Ack(pb.AckRequest(**group, offsets=range(5)), metadata=worker, timeout=5)
        assert acked.acknowledged == 5


def test_a_dead_letter_stream_needs_write_permission_on_it(auth_channel: grpc.Channel) -> None:
    names = {m.name: m for m in SERVICE.methods}
    if "CreateGroup" not in names:
        pytest.skip("this proto has no consumer groups")
    method = names["CreateGroup"]
    # "stranger" administers elsewhere-* only: it may dead-letter there, not into another stream.
    inside = request_for(method, stream="elsewhere-1", create_stream=True)
    inside.config.dead_letter_stream = "elsewhere-dlq"
    outside = request_for(method, stream="elsewhere-1", group="g2", create_stream=True)
    outside.config.dead_letter_stream = "s1"
    assert call(auth_channel, method, outside, bearer("stranger")) == grpc.StatusCode.PERMISSION_DENIED
    assert call(auth_channel, method, inside, bearer("stranger")) not in DENIED
    assert call(auth_channel, method, outside, bearer("admin")) not in DENIED


@pytest.mark.parametrize("method", ["Append", "Subscribe", "Consume"])
def test_credentials_are_checked_before_the_request_is_read(
    auth_server: ServerThread, auth_channel: grpc.Channel, method: str
) -> None:
    # Not a protobuf message (field 31, wire type 7): a server that parsed it would fail there.
    garbage = b"\xff" * (900 << 10)
    path = f"/{SERVICE.full_name}/{method}"
    kind = SERVICE.methods_by_name[method]

    def send(metadata: Any) -> grpc.StatusCode:
        try:
            if kind.client_streaming:
                list(auth_channel.stream_stream(path)(iter([garbage]), metadata=metadata, timeout=10))
            elif kind.server_streaming:
                list(auth_channel.unary_stream(path)(garbage, metadata=metadata, timeout=10))
            else:
                auth_channel.unary_unary(path)(garbage, metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    for metadata in ((), (("authorization", "Bearer not-a-known-token"),), (("authorization", "Basic x"),)):
        assert send(metadata) == grpc.StatusCode.UNAUTHENTICATED, metadata
    # A known caller's request is read (and this one found malformed).
    assert send(bearer("admin")) not in DENIED


def test_list_streams_shows_only_what_the_caller_may_touch(auth_server: ServerThread) -> None:
    engine = auth_server.server.engine
    for name in ("s2", "s3", "t1", "t2", "t3", "t4", "t5", "u1"):
        engine.append(name, AppendBatch([b"x"]))
    with grpc.insecure_channel(auth_server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        # Pages of 2 (of 9 names); the hidden t* names end pages, and their tokens must not name them.
        seen, token, tokens = [], "", []
        for _ in range(10):
            reply = stub.ListStreams(
                pb.ListStreamsRequest(page_size=2, page_token=token), metadata=bearer("reader"), timeout=5
            )
            seen += reply.streams
            token = reply.next_page_token
            tokens.append(token)
            if not token:
                break
        assert seen == ["s1", "s2", "s3"]
        # The servicer's own tokens carry the page's last name; the caller gets random handles.
        for handle in filter(None, tokens):
            assert b"streamlog.v1/streams" not in base64.urlsafe_b64decode(handle + "==")
        # A handle is bound to the principal it was issued to.
        first = stub.ListStreams(pb.ListStreamsRequest(page_size=2), metadata=bearer("reader"), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListStreams(
                pb.ListStreamsRequest(page_size=2, page_token=first.next_page_token),
                metadata=bearer("admin"),
                timeout=5,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        every = stub.ListStreams(pb.ListStreamsRequest(page_size=5), metadata=bearer("admin"), timeout=5)
        assert list(every.streams) == ["s1", "s2", "s3", "t1", "t2"]
        with pytest.raises(grpc.RpcError) as info:
            stub.ListStreams(pb.ListStreamsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_stay_open(auth_channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(auth_channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(auth_channel)
    replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    services = {s.name for s in next(replies).list_services_response.service}
    assert SERVICE.full_name in services


def test_tokens_and_rules_reload_on_change(start_server: Callable[..., ServerThread], tmp_path: Path) -> None:
    tokens = write(tmp_path / "tokens.toml", TOKENS_TOML)
    rules = write(tmp_path / "acl.toml", ACL_TOML)
    server = start_server(tokens_file=tokens, acl_file=rules, reload_interval_ms=100)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        request = pb.AppendRequest(stream="s1", payloads=[b"x"])
        with pytest.raises(grpc.RpcError) as info:
            stub.Append(request, metadata=bearer("reader"), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

        grant = '[[rules]]\nprincipals = ["reader"]\nstreams = ["s1"]\npermissions = ["write"]\n'
        write(Path(rules), ACL_TOML + grant)
        fresh = "fresh-token-0123456789"
        write(Path(tokens), TOKENS_TOML + f'\n[[tokens]]\nprincipal = "reader"\ntoken = "{fresh}"\n')
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the watcher looks every 100 ms
            try:
                stub.Append(request, metadata=(("authorization", f"Bearer {fresh}"),), timeout=5)
                break
            except grpc.RpcError as exc:
                assert exc.code() in DENIED
                time.sleep(0.05)
        else:
            pytest.fail("the new token and rule were not picked up")

        # A broken file is refused; the rules in force stay.
        write(Path(rules), "rules = [")
        assert server.server.ops.reload("test") is False
        stub.Append(request, metadata=bearer("reader"), timeout=5)


def without(text: str, part: str) -> str:
    assert part in text
    return text.replace(part, "")


def test_a_revoked_token_ends_its_open_subscriptions(
    start_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    tokens = write(tmp_path / "tokens.toml", TOKENS_TOML)
    server = start_server(tokens_file=tokens, acl_file=write(tmp_path / "acl.toml", ACL_TOML))
    server.server.engine.append("s1", AppendBatch([b"before"]))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        revoked = stub.Subscribe(pb.SubscribeRequest(stream="s1"), metadata=bearer("reader"), timeout=30)
        kept = stub.Subscribe(pb.SubscribeRequest(stream="s1"), metadata=bearer("admin"), timeout=30)
        assert [e.payload for e in next(revoked).entries] == [b"before"]
        assert [e.payload for e in next(kept).entries] == [b"before"]

        reader = f'[[tokens]]\nprincipal = "reader"\ntoken = "{TOKENS["reader"]}"\n'
        write(Path(tokens), without(TOKENS_TOML, reader))
        assert server.server.ops.reload("test") is True
        stub.Append(pb.AppendRequest(stream="s1", payloads=[b"after"]), metadata=bearer("admin"), timeout=5)

        received = []
        with pytest.raises(grpc.RpcError) as info:
            for reply in revoked:
                received += reply.entries
        assert received == []
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "reloaded" in info.value.details() and "unknown bearer token" in info.value.details()
        # A subscriber whose rights stand goes on.
        assert [e.payload for e in next(kept).entries] == [b"after"]
        kept.cancel()


def test_a_subscriber_revoked_while_a_reply_waits_to_be_sent_ends_after_that_reply(
    start_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    tokens = write(tmp_path / "tokens.toml", TOKENS_TOML)
    server = start_server(
        tokens_file=tokens, acl_file=write(tmp_path / "acl.toml", ACL_TOML), metrics_port=free_port()
    )
    open_calls, replies = server.server.ops.open_calls, server.server.servicer.replies
    registry = server.server.ops.metrics.registry
    engine = server.server.engine
    chunk = [b"x" * 4000] * 16
    # The client's flow-control window, fixed (no BDP probing, which grows it to megabytes).
    window = 100_000
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        subscription = pb_grpc.StreamLogServiceStub(channel).Subscribe(
            pb.SubscribeRequest(stream="s1"), metadata=bearer("reader"), timeout=60
        )
        engine.append("s1", AppendBatch(chunk))
        first = next(subscription).ByteSize()

        # The client stops reading; replies pile up until the server waits to send one: it has
        # handed gRPC more than the window since the first reply, so the last cannot have gone
        # (and the status queued behind it can reach the client only once the client reads).
        # A reply merely being sent is not enough: a client gRPC drops the replies it has
        # received and not yet read when an error status arrives behind them.
        def handed() -> float:
            value = registry.get_sample_value("streamlog_subscribe_reply_bytes_total", {"stream": "s1"})
            return value or 0.0

        def sending() -> bool:
            engine.append("s1", AppendBatch(chunk))
            state = server.call(lambda: (len(open_calls), replies.queued > 0, handed() - first > window))
            return state == (1, True, True)

        wait_for(sending, timeout_s=30)
        written = engine.bounds("s1").end_offset
        reader = f'[[tokens]]\nprincipal = "reader"\ntoken = "{TOKENS["reader"]}"\n'
        write(Path(tokens), without(TOKENS_TOML, reader))
        assert server.server.ops.reload("test") is True
        engine.append("s1", AppendBatch(chunk))
        offsets = []
        with pytest.raises(grpc.RpcError) as info:
            for reply in subscription:
                offsets += [e.offset for e in reply.entries]
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # What it had read before the reload reaches the client; nothing appended since does.
        assert offsets and max(offsets) < written


def wait_for(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_reloaded_rules_end_the_sessions_and_blocked_reads_they_no_longer_allow(
    start_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    rules = write(tmp_path / "acl.toml", ACL_TOML)
    server = start_server(tokens_file=write(tmp_path / "tokens.toml", TOKENS_TOML), acl_file=rules)
    engine = server.server.engine
    engine.append("s1", AppendBatch([b"a", b"b"]))
    engine.create_group("s1", "g1", start="oldest")
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        requests: queue.Queue[pb.ConsumeRequest | None] = queue.Queue()
        consume = channel.stream_stream(
            f"/{SERVICE.full_name}/Consume",
            request_serializer=pb.ConsumeRequest.SerializeToString,
            response_deserializer=pb.ConsumeResponse.FromString,
        )
        session = consume(iter(requests.get, None), metadata=bearer("worker"), timeout=30)
        requests.put(pb.ConsumeRequest(stream="s1", group="g1", consumer="c1", count=10, batches=1))
        assert [e.payload for e in next(session).entries] == [b"a", b"b"]
        # A group read waits for more, as a second consumer.
        blocked = stub.Read.future(
            pb.ReadRequest(stream="s1", group="g1", consumer="c2", block_ms=9000),
            metadata=bearer("worker"),
            timeout=20,
        )
        wait_for(lambda: server.call(lambda: server.server.ops.limits.blocked_reads) == 1)

        worker = '[[rules]]\nprincipals = ["worker"]\nstreams = ["s1"]\ngroups = ["g1"]\n'
        write(Path(rules), without(ACL_TOML, worker + 'permissions = ["consume"]\n'))
        assert server.server.ops.reload("test") is True
        requests.put(pb.ConsumeRequest(batches=1))  # the session asks for another batch
        stub.Append(pb.AppendRequest(stream="s1", payloads=[b"c"]), metadata=bearer("admin"), timeout=5)

        with pytest.raises(grpc.RpcError) as info:
            next(session)
        requests.put(None)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "reloaded" in info.value.details() and "may not Consume" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            blocked.result()
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Neither took the new entry: it waits in the group for a consumer still allowed.
    group = engine.group_info("s1", "g1")
    assert (group.cursor, group.pending) == (2, 2)


def test_tokens_over_plaintext_are_warned_about_at_start_up(
    start_server: Callable[..., ServerThread],
    tmp_path: Path,
    pki: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    files = {
        "tokens_file": write(tmp_path / "tokens.toml", TOKENS_TOML),
        "acl_file": write(tmp_path / "acl.toml", ACL_TOML),
    }
    with caplog.at_level(logging.INFO, logger="service.ops"):
        start_server(tmp_path / "plain", **files)
        start_server(tmp_path / "tls", **files, **tls_files(tmp_path, pki, mutual=False))
    warnings = [r for r in caplog.records if "over plaintext" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "tls_cert_file" in warnings[0].getMessage()


def test_start_up_refuses_unloadable_auth_files(tmp_path: Path) -> None:
    tokens = write(tmp_path / "tokens.toml", '[[tokens]]\nprincipal = "a"\ntoken = "short"\n')
    rules = write(tmp_path / "acl.toml", ACL_TOML)
    server = ServerThread(Settings(data_dir=tmp_path / "data", port=0, tokens_file=tokens, acl_file=rules))
    try:
        with pytest.raises(ConfigError, match="at least 16 characters"):
            server.start()
    finally:
        server.stop()


# ---------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def pki() -> dict[str, Any]:
    ca, other = CertificateAuthority(), CertificateAuthority("another CA")
    return {
        "ca": ca,
        "other": other,
        "server": ca.issue("streamlog", server=True),
        "server2": other.issue("streamlog", server=True),
        "alice": ca.issue("alice", server=False),
        "mallory": other.issue("alice", server=False),
    }


def tls_files(tmp_path: Path, pki: dict[str, Any], *, mutual: bool) -> dict[str, str]:
    cert, key = pki["server"].write(tmp_path, "server")
    files = {"tls_cert_file": str(cert), "tls_key_file": str(key)}
    if mutual:
        ca = tmp_path / "clients-ca.crt"
        ca.write_bytes(pki["ca"].cert_pem)
        files["tls_client_ca_file"] = str(ca)
    return files


def secure_call(
    server: ServerThread, roots: bytes, client: Any = None, metadata: Any = ()
) -> grpc.StatusCode:
    credentials = grpc.ssl_channel_credentials(
        roots, client.key_pem if client else None, client.cert_pem if client else None
    )
    # A private subchannel pool: each check makes its own connection (and handshake).
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.secure_channel(f"localhost:{server.server.port}", credentials, options=options) as channel:
        try:
            pb_grpc.StreamLogServiceStub(channel).GetStreamInfo(
                pb.GetStreamInfoRequest(stream="s1"), metadata=metadata, timeout=5
            )
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_tls_serves_verified_clients_and_refuses_plaintext(
    start_server: Callable[..., ServerThread], tmp_path: Path, pki: dict[str, Any]
) -> None:
    server = start_server(**tls_files(tmp_path, pki, mutual=False))
    server.server.engine.append("s1", AppendBatch([b"x"]))
    assert secure_call(server, pki["ca"].cert_pem) == grpc.StatusCode.OK
    # A client that does not trust the server's CA fails the handshake.
    assert secure_call(server, pki["other"].cert_pem) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.StreamLogServiceStub(channel).GetStreamInfo(
                pb.GetStreamInfoRequest(stream="s1"), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_ca(
    start_server: Callable[..., ServerThread], tmp_path: Path, pki: dict[str, Any]
) -> None:
    server = start_server(**tls_files(tmp_path, pki, mutual=True))
    server.server.engine.append("s1", AppendBatch([b"x"]))
    roots = pki["ca"].cert_pem
    assert secure_call(server, roots, pki["alice"]) == grpc.StatusCode.OK
    assert secure_call(server, roots) == grpc.StatusCode.UNAVAILABLE  # no certificate
    assert secure_call(server, roots, pki["mallory"]) == grpc.StatusCode.UNAVAILABLE  # signed by another CA


def test_a_client_certificate_names_the_principal_for_the_rules(
    start_server: Callable[..., ServerThread], tmp_path: Path, pki: dict[str, Any]
) -> None:
    rules = write(
        tmp_path / "acl.toml",
        '[[rules]]\nprincipals = ["alice"]\nstreams = ["s1"]\npermissions = ["read"]\n' + ACL_TOML,
    )
    tokens = write(tmp_path / "tokens.toml", TOKENS_TOML)
    server = start_server(**tls_files(tmp_path, pki, mutual=True), acl_file=rules, tokens_file=tokens)
    server.server.engine.append("s1", AppendBatch([b"x"]))
    roots, alice = pki["ca"].cert_pem, pki["alice"]
    assert secure_call(server, roots, alice) == grpc.StatusCode.OK
    # A token, when sent, names the caller instead: "stranger" may not read s1.
    assert secure_call(server, roots, alice, bearer("stranger")) == grpc.StatusCode.PERMISSION_DENIED
    assert secure_call(server, roots, alice, bearer("reader")) == grpc.StatusCode.OK


def test_a_certificate_named_like_a_role_is_refused_not_taken_for_the_role(
    start_server: Callable[..., ServerThread],
    tmp_path: Path,
    pki: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A CA-signed certificate with CN "role:admins", and rules granting role admins everything.
    rules = write(
        tmp_path / "acl.toml",
        ACL_TOML + '[[rules]]\nprincipals = ["role:admins"]\nstreams = ["*"]\npermissions = ["admin"]\n',
    )
    server = start_server(**tls_files(tmp_path, pki, mutual=True), acl_file=rules)
    server.server.engine.append("s1", AppendBatch([b"x"]))
    impostor = pki["ca"].issue("role:admins", server=False)
    with caplog.at_level(logging.INFO, logger="service.auth"):
        assert secure_call(server, pki["ca"].cert_pem, impostor) == grpc.StatusCode.UNAUTHENTICATED
    (record,) = [r for r in caplog.records if "reserved `role:` form" in r.getMessage()]
    assert record.levelno == logging.WARNING and "'role:admins'" in record.getMessage()
    # An ordinary certificate still names its principal.
    assert secure_call(server, pki["ca"].cert_pem, pki["alice"]) == grpc.StatusCode.PERMISSION_DENIED


def test_renewed_certificates_apply_to_new_connections_without_restart(
    start_server: Callable[..., ServerThread], tmp_path: Path, pki: dict[str, Any]
) -> None:
    files = tls_files(tmp_path, pki, mutual=False)
    server = start_server(**files)
    server.server.engine.append("s1", AppendBatch([b"x"]))
    assert secure_call(server, pki["ca"].cert_pem) == grpc.StatusCode.OK
    # A key that does not match the certificate is refused; the old pair stays in use.
    Path(files["tls_key_file"]).write_bytes(pki["server2"].key_pem)
    assert server.server.ops.reload("test") is False
    assert secure_call(server, pki["ca"].cert_pem) == grpc.StatusCode.OK
    pki["server2"].write(tmp_path, "server")
    assert server.server.ops.reload("test") is True
    assert secure_call(server, pki["other"].cert_pem) == grpc.StatusCode.OK
    assert secure_call(server, pki["ca"].cert_pem) == grpc.StatusCode.UNAVAILABLE
