"""The `streamlog serve` command as a real process: start-up, signals, exit codes, restarts."""

from __future__ import annotations

import json
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from service.config import setting_names
from tests.service.processes import ServerProcess


@pytest.fixture
def spawn() -> Iterator:
    processes: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        process = ServerProcess(*args, env=env)
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_exits_zero_and_the_data_survives_a_restart(
    spawn, tmp_path: Path, signum: signal.Signals
) -> None:
    data = tmp_path / "data"
    server = spawn("--data", str(data), "--port", "0").wait_ready()
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        entries = [pb.Entry(payload=b"%d" % i, tag=f"t{i % 3}") for i in range(300)]
        for start in range(0, 300, 100):
            stub.Append(pb.AppendRequest(stream="kept", entries=entries[start : start + 100]), timeout=10)
        subscription = stub.Subscribe(
            pb.SubscribeRequest(stream="kept", start=pb.START_POSITION_LATEST), timeout=30
        )
        assert next(subscription).next_offset == 300

        server.process.send_signal(signum)
        with pytest.raises(grpc.RpcError) as caught:
            next(subscription)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    code, log = server.finish()
    assert code == 0, log
    assert "draining" in log and "stopped" in log

    restarted = spawn("--data", str(data), "--port", "0").wait_ready()
    with grpc.insecure_channel(restarted.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reply = stub.Read(pb.ReadRequest(stream="kept", offset=0, count=1000), timeout=10)
        assert [(e.payload, e.tag) for e in reply.entries] == [(e.payload, e.tag) for e in entries]
        assert (
            stub.Append(pb.AppendRequest(stream="kept", entries=[pb.Entry(payload=b"more")])).first_offset
            == 300
        )
    restarted.process.send_signal(signal.SIGTERM)
    assert restarted.finish()[0] == 0


def test_settings_from_environment_and_config_file(spawn, tmp_path: Path) -> None:
    config = tmp_path / "streamlog.toml"
    config.write_text(f'data_dir = "{tmp_path / "from-file"}"\nmax_entry_bytes = 100\n')
    server = spawn(
        "--config", str(config), "--port", "0", env={"STREAMLOG_MAX_ENTRY_BYTES": "200"}
    ).wait_ready()
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        stub.Append(pb.AppendRequest(stream="s", entries=[pb.Entry(payload=b"x" * 200)]), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Append(pb.AppendRequest(stream="s", entries=[pb.Entry(payload=b"x" * 201)]), timeout=10)
        assert "max_entry_bytes=200" in caught.value.details()
    server.process.send_signal(signal.SIGTERM)
    assert server.finish()[0] == 0
    assert (tmp_path / "from-file" / "streams").is_dir()


def test_bad_settings_exit_2_with_a_clear_message(spawn, tmp_path: Path) -> None:
    server = spawn("--data", str(tmp_path), "--port", "0", env={"STREAMLOG_FSYNC": "sometimes"})
    code, log = server.finish()
    assert code == 2
    assert "fsync: must be one of always, everysec, no, got 'sometimes' (from environment variable" in log


@pytest.mark.parametrize("flag", ["--port", "--set health_port"])
def test_a_taken_port_exits_1_with_one_clear_line(spawn, tmp_path: Path, flag: str) -> None:
    """Nothing starts, so nothing drains: the log is the one line saying what to do."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--port", str(port)] if flag == "--port" else ["--port", "0", "--set", f"health_port={port}"]
        code, log = spawn("--data", str(tmp_path / "data"), *args).finish()
    assert code == 1
    lines = log.splitlines()
    assert len(lines) == 1, log
    setting = "port" if flag == "--port" else "health_port"
    assert lines[0].endswith(
        f"ERROR streamlog: cannot run the server: {setting} {port} on 127.0.0.1 is in use by another "
        f"process; stop it, or choose another {setting} (0 picks a free one)"
    ), log
    assert not (tmp_path / "data").exists()  # nothing was opened


def test_a_data_directory_in_use_exits_1(spawn, tmp_path: Path) -> None:
    first = spawn("--data", str(tmp_path), "--port", "0").wait_ready()
    code, log = spawn("--data", str(tmp_path), "--port", "0").finish()
    assert code == 1
    assert "in use by another process" in log
    first.process.send_signal(signal.SIGTERM)
    assert first.finish()[0] == 0


def test_subscribers_that_disconnect_mid_stream_leave_no_error_in_the_log(spawn, tmp_path: Path) -> None:
    """A client that goes away while replies are being sent to it is normal. gRPC refuses the
    next send (ExecuteBatchError) before it tells the call it was cancelled; that must not
    reach the log as an ERROR with a traceback. Subscribe and Consume both send this way."""
    server = spawn("--data", str(tmp_path / "data"), "--port", "0").wait_ready()
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for _ in range(40):  # 40,000 entries of 1 KiB: replies of 1 MiB, more than a client takes at once
            entries = [pb.Entry(payload=b"x" * 1024)] * 1000
            stub.Append(pb.AppendRequest(stream="backlog", entries=entries), timeout=30)
        for round_ in range(1, 40, 2):  # a group per Consume: each finds the whole backlog new
            stub.CreateGroup(pb.CreateGroupRequest(stream="backlog", group=f"g{round_}"), timeout=10)
    done = threading.Event()

    def session(group: str) -> Iterator[pb.ConsumeRequest]:
        yield pb.ConsumeRequest(stream="backlog", group=group, consumer="c", count=1000, batches=100)
        done.wait(60)  # the client's side stays open: the session goes on sending

    try:
        for round_ in range(40):
            # A channel of its own, closed after the first reply: the peer leaves mid-stream.
            with grpc.insecure_channel(server.target) as channel:
                stub = pb_grpc.StreamLogServiceStub(channel)
                if round_ % 2:
                    replies = stub.Consume(session(f"g{round_}"), timeout=60)
                else:
                    request = pb.SubscribeRequest(stream="backlog", start=pb.START_POSITION_OLDEST)
                    replies = stub.Subscribe(request, timeout=60)
                assert next(replies).entries
    finally:
        done.set()
    server.process.send_signal(signal.SIGTERM)
    code, log = server.finish()
    assert code == 0, log
    assert "Traceback" not in log and " ERROR " not in log, log


def test_the_start_up_log_shows_settings_not_at_their_defaults_one_per_line(spawn, tmp_path: Path) -> None:
    server = spawn(
        "--data", str(tmp_path / "data"), "--port", "0", "--set", "max_entry_bytes=2MiB",
        env={"STREAMLOG_SHUTDOWN_GRACE_MS": "1000"},
    ).wait_ready()  # fmt: skip
    server.process.send_signal(signal.SIGTERM)
    code, log = server.finish()
    assert code == 0, log
    lines = log.splitlines()
    heading = next(i for i, line in enumerate(lines) if "settings" in line)
    assert lines[heading].endswith(
        "INFO service.ops: settings not at their defaults (every setting: streamlog serve --help):"
    ), log
    assert lines[heading + 1 : heading + 5] == [
        f"  data_dir = {tmp_path / 'data'}",
        "  port = 0",
        "  max_entry_bytes = 2 MiB",
        "  shutdown_grace_ms = 1000",
    ], log
    assert "INFO" in lines[heading + 5], log  # the next event
    assert len(log) < 1000, log  # the whole start-up and shutdown, not 2 KB of escaped JSON


def test_the_json_log_keeps_every_setting_in_one_event(spawn, tmp_path: Path) -> None:
    server = spawn("--data", str(tmp_path), "--port", "0", "--log-format", "json")
    server.wait_for('"serving')
    server.process.send_signal(signal.SIGTERM)
    code, log = server.finish()
    assert code == 0, log
    events = [json.loads(line) for line in log.splitlines()]
    settings = [e["settings"] for e in events if e["message"] == "settings"]
    assert len(settings) == 1 and settings[0]["max_entry_bytes"] == 1 << 20 and settings[0]["port"] == 0
    assert set(settings[0]) == set(setting_names())
