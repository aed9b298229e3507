"""The Node.js client (clients/node) against a real server: its tests, run with `node --test`.
(tests/cluster/test_node_client.py runs it against a cluster.)"""

from __future__ import annotations

from tests.clients.nodejs import needs_node, run_node_tests
from tests.service.helpers import ServerThread


@needs_node
def test_node_client_appends_reads_subscribes_and_acks(server: ServerThread) -> None:
    report = run_node_tests("test/client.test.js", {"STREAMLOG_ADDRESS": server.target})
    assert "# pass 14" in report, report  # every test ran
