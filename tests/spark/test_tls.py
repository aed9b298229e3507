"""The connector against a server with mutual TLS and bearer tokens: reads, writes, and clear refusals.

The certificate options name files, read where the query is planned; the tasks
get their contents, so this also shows that executors need no copies.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from clients import Client
from tests.service.helpers import ServerThread
from tests.service.secure import APP_TOKEN, VIEWER_TOKEN, Pki, secure_files
from tests.spark.helpers import finish

SecureServer = tuple[ServerThread, Pki]


@pytest.fixture
def secure(start_server: Callable[..., ServerThread], tmp_path: Path) -> SecureServer:
    """A server with mutual TLS (clients need a certificate from the CA) and bearer tokens."""
    settings, pki = secure_files(tmp_path)
    return start_server(**settings), pki


def tls_options(server: ServerThread, pki: Pki, **overrides: str) -> dict[str, str]:
    options = {
        "endpoint": server.target,
        "tlsCa": str(pki.ca),
        "tlsCert": str(pki.client_cert),
        "tlsKey": str(pki.client_key),
        "token": APP_TOKEN,
    }
    options.update(overrides)
    return {key: value for key, value in options.items() if value}


def client(server: ServerThread, pki: Pki) -> Client:
    return Client(
        server.target,
        token=APP_TOKEN,
        root_certificates=pki.ca,
        certificate_chain=pki.client_cert,
        private_key=pki.client_key,
        timeout=10,
    )


def payloads(server: ServerThread, pki: Pki, stream: str) -> list[bytes]:
    with client(server, pki) as c:
        return [entry.payload for entry in c.read(stream, 0, count=10_000)]


def test_batch_read_and_write_over_mutual_tls_with_a_token(spark, secure: SecureServer) -> None:
    server, pki = secure
    with client(server, pki) as c:
        c.append("in", [f"e{i}".encode() for i in range(2500)])
    options = tls_options(server, pki)
    frame = spark.read.format("streamlog").options(streams="in", entriesPerPartition=1000, **options).load()
    assert frame.rdd.getNumPartitions() == 3
    rows = frame.select("offset", "payload").collect()
    assert sorted((r.offset, bytes(r.payload)) for r in rows) == [(i, f"e{i}".encode()) for i in range(2500)]
    tagged = frame.selectExpr("payload", "concat('t', offset % 3) as tag")
    tagged.write.format("streamlog").mode("append").options(stream="out", **options).save()
    assert sorted(payloads(server, pki, "out")) == sorted(f"e{i}".encode() for i in range(2500))


def test_streaming_read_and_write_over_mutual_tls_with_a_token(
    spark, secure: SecureServer, tmp_path: Path
) -> None:
    server, pki = secure
    with client(server, pki) as c:
        c.append("events", [f"e{i}".encode() for i in range(1000)])
    options = tls_options(server, pki)
    frame = (
        spark.readStream.format("streamlog")
        .options(streams="events", startingOffsets="earliest", maxEntriesPerTrigger=400, **options)
        .load()
        .select("payload")
    )
    query = (
        frame.writeStream.format("streamlog")
        .options(stream="copy", checkpointLocation=str(tmp_path / "cp"), **options)
        .trigger(availableNow=True)
        .start()
    )
    finish(query)
    assert [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]] == [400, 400, 200]
    assert sorted(payloads(server, pki, "copy")) == sorted(f"e{i}".encode() for i in range(1000))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"token": "not-a-token-0123456789"}, r"refused GetStreamInfo with the token given.*UNAUTHENTICATED"),
        ({"token": ""}, r"refused GetStreamInfo with no token.*STREAMLOG_TOKEN"),
        ({"tlsCa": "", "tlsCert": "", "tlsKey": ""}, r"cannot reach the streamlog server.*tlsCa"),
        ({"tlsCert": "", "tlsKey": ""}, r"cannot reach the streamlog server.*tlsCert"),
    ],
)
def test_refused_credentials_are_clear_errors(
    spark, secure: SecureServer, overrides: dict[str, str], message: str
) -> None:
    server, pki = secure
    with client(server, pki) as c:
        c.append("in", b"x")
    reader = spark.read.format("streamlog").options(streams="in", **tls_options(server, pki, **overrides))
    with pytest.raises(Exception, match=message):
        reader.load().collect()


def test_a_token_that_may_only_read_cannot_write(spark, secure: SecureServer) -> None:
    server, pki = secure
    frame = spark.range(3).selectExpr("cast(id as string) as payload")
    options = tls_options(server, pki, token=VIEWER_TOKEN)
    with pytest.raises(Exception, match=r"refused Append with the token given.*PERMISSION_DENIED"):
        frame.write.format("streamlog").mode("append").options(stream="out", **options).save()
