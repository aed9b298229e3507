"""The web console in a real browser against a real server: every page draws with no console
errors, a live tail shows what is appended after it opened, a group's page follows its lag and
pending list, admin actions ask first, and a token without rights sees a clear refusal."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from storage import AppendBatch
from tests.service.test_auth import ACL_TOML, TOKENS, TOKENS_TOML, write


@pytest.fixture
def stub_of():
    channels = []

    def stub(server) -> pb_grpc.StreamLogServiceStub:
        channel = grpc.insecure_channel(server.target)
        channels.append(channel)
        return pb_grpc.StreamLogServiceStub(channel)

    yield stub
    for channel in channels:
        channel.close()


def seed(stub: pb_grpc.StreamLogServiceStub) -> None:
    entries = [
        pb.Entry(payload=b'{"order": 1, "total": 9.5}', tag="o-1", headers={"source": b"web"}),
        pb.Entry(payload=b"plain text"),
        pb.Entry(payload=bytes(range(0, 256, 17))),
    ]
    stub.Append(pb.AppendRequest(stream="orders", entries=entries))
    stub.Append(pb.AppendRequest(stream="orders", payloads=[b"%d" % i for i in range(30)]))
    stub.CreateGroup(pb.CreateGroupRequest(stream="orders", group="billing", start=pb.START_POSITION_OLDEST))
    stub.Read(pb.ReadRequest(stream="orders", group="billing", consumer="w1", count=5))


def test_every_page_draws_with_no_console_errors(start_server, open_console, stub_of) -> None:
    server = start_server()
    seed(stub_of(server))
    tab = open_console(server)
    page = tab.visit("#/")
    assert page.locator("tr[data-stream=orders] td").nth(1).inner_text() == "33"
    page = tab.visit("#/stream/orders?offset=0")
    assert page.locator("tr[data-offset='0'] pre.json").inner_text().startswith('{\n  "order": 1')
    assert page.locator("tr[data-offset='0']").inner_text().count("source=web") == 1
    assert page.locator("tr[data-offset='2'] pre.hex").count() == 1  # not UTF-8: hex
    page.click("#next-page")
    page.wait_for_selector("tr[data-offset='20']")
    page = tab.visit("#/stream/orders?offset=0&format=hex")
    assert page.locator("tr[data-offset='1'] pre.hex").count() == 1
    page = tab.visit("#/group/orders/billing")
    assert page.locator("[data-fact=Lag]").inner_text() == "28"
    assert page.locator("tr[data-offset='4']").inner_text().split("\t")[1] == "w1"
    page = tab.visit("#/cluster")
    assert "single node" in page.locator("#single-node").inner_text()
    assert tab.errors == []


def test_gaps_show_as_gaps(start_server, open_console, stub_of) -> None:
    server = start_server()
    stub = stub_of(server)
    stub.Append(pb.AppendRequest(stream="s", payloads=[b"x"] * 10))
    stub.Trim(pb.TrimRequest(stream="s", trim_to_offset=4))
    tab = open_console(server)
    page = tab.visit("#/stream/s?offset=0")
    assert "offsets 0 to 3: 4 entries evicted" in page.locator("tr.gap").inner_text()
    assert page.locator("tr[data-offset='4']").count() == 1
    assert tab.errors == []


def test_the_live_tail_shows_an_entry_appended_after_the_page_opened(
    start_server, open_console, stub_of
) -> None:
    server = start_server()
    stub = stub_of(server)
    stub.Append(pb.AppendRequest(stream="orders", payloads=[b"before"]))
    tab = open_console(server)
    page = tab.visit("#/stream/orders")
    page.click("#tail-toggle")
    page.wait_for_selector("#tail tr.muted")  # following
    stub.Append(pb.AppendRequest(stream="orders", payloads=[b'{"late": true}']))
    row = page.wait_for_selector("#tail tr[data-offset='1']", timeout=10_000)
    assert '"late": true' in row.inner_text()
    assert page.locator("#tail tr[data-offset='0']").count() == 0  # only what came after
    assert tab.errors == []


def test_a_groups_lag_and_pending_follow_reads_and_acks(start_server, open_console, stub_of) -> None:
    server = start_server()
    stub = stub_of(server)
    stub.Append(pb.AppendRequest(stream="jobs", payloads=[b"j"] * 10))
    stub.CreateGroup(pb.CreateGroupRequest(stream="jobs", group="g", start=pb.START_POSITION_OLDEST))
    tab = open_console(server)
    page = tab.visit("#/group/jobs/g")
    assert (
        page.locator("[data-fact=Lag]").inner_text(),
        page.locator("[data-fact=Pending]").inner_text(),
    ) == (
        "10",
        "0",
    )
    stub.Read(pb.ReadRequest(stream="jobs", group="g", consumer="c", count=6))
    stub.Ack(pb.AckRequest(stream="jobs", group="g", offsets=[0, 1, 2, 3]))
    page = tab.visit("#/group/jobs/g")
    assert (
        page.locator("[data-fact=Lag]").inner_text(),
        page.locator("[data-fact=Pending]").inner_text(),
    ) == (
        "4",
        "2",
    )
    assert [row.get_attribute("data-offset") for row in page.locator("tbody tr[data-offset]").all()] == [
        "4",
        "5",
    ]
    assert tab.errors == []


def test_admin_actions_ask_first(start_server, open_console, stub_of) -> None:
    server = start_server()
    stub = stub_of(server)
    stub.Append(pb.AppendRequest(stream="s", payloads=[b"x"] * 5))
    tab = open_console(server)
    page = tab.visit("#/stream/s")
    page.fill("#create-group input[name=group]", "audit")
    page.click("#create-group button")
    page.click("#confirm-cancel")
    assert [g.name for g in stub.ListGroups(pb.ListGroupsRequest(stream="s")).groups] == []
    page.click("#create-group button")
    assert 'Create group "audit"' in page.locator("#confirm-text").inner_text()
    page.click("#confirm-ok")
    page.wait_for_selector("a[href='#/group/s/audit']")
    page = tab.visit("#/group/s/audit")
    page.click("#delete-group")
    page.click("#confirm-ok")
    page.wait_for_url(lambda url: url.endswith("#/stream/s"))
    assert stub.ListGroups(pb.ListGroupsRequest(stream="s")).groups == []
    assert tab.errors == []


def test_sign_in_and_a_token_without_rights_sees_a_clear_refusal(
    start_server, open_console, tmp_path: Path
) -> None:
    server = start_server(
        tokens_file=write(tmp_path / "tokens.toml", TOKENS_TOML),
        acl_file=write(tmp_path / "acl.toml", ACL_TOML),
    )
    server.server.engine.append("s1", AppendBatch([b"secret"]))
    tab = open_console(server)
    page = tab.visit("#/")
    assert "needs a token" in page.locator("#signin").inner_text()
    page.fill("#signin input[name=token]", TOKENS["stranger"])
    page.click("#signin button")
    page.wait_for_selector("main[aria-busy=false] h1:text('Streams')")
    assert page.locator("tr[data-stream]").count() == 0  # s1 is not listed to this token
    page = tab.visit("#/stream/s1")  # the token stays for the session
    refusal = page.locator(".refusal").inner_text()
    assert "Not allowed" in refusal and "'stranger' may not GetStreamInfo on stream 's1'" in refusal
    assert "secret" not in page.content()
    page.click("#signout")
    page.wait_for_selector("#signin")
    page.fill("#signin input[name=token]", TOKENS["reader"])
    page.click("#signin button")  # back on the page that was refused, now allowed
    assert "secret" in page.wait_for_selector("tr[data-offset='0']").inner_text()
