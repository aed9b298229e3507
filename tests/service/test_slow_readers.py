"""Clients that stop reading cannot make a server hold more than its reply budget (issue 13).

The attack runs against a real `streamlog serve` (bench/slow_readers.py): raw
HTTP/2 connections open Reads and Subscribes of 8 MiB replies and never read a
byte. Before the reply budget, 12 Reads and 12 Subscribes on each of 4 such
connections took the server's resident memory up by more than 1 GB.
"""

from __future__ import annotations

from bench import slow_readers

BUDGET_MIB = 96
PER_CONNECTION_MIB = 16
CONNECTIONS = 4


def test_clients_that_stop_reading_hold_at_most_the_reply_budget_and_others_are_still_served() -> None:
    figures = slow_readers.run(
        connections=CONNECTIONS, calls=12, budget_mib=BUDGET_MIB, per_connection_mib=PER_CONNECTION_MIB
    )
    # A queued reply costs about twice its size (the reply and gRPC core's copy); the margin
    # covers the engine's cache of the 8 MiB stream and the allocator.
    grown = figures["rss_attack_mb"] - figures["rss_before_mb"]
    assert grown < 2 * BUDGET_MIB + 48, figures
    # The attack did fill every attacking connection's budget (and no more)...
    assert CONNECTIONS * (PER_CONNECTION_MIB - 8) <= figures["queued_reply_mb"] <= CONNECTIONS * 17, figures
    # ...while a client on another connection appended, read and subscribed at once. (`run` also
    # checked that the queued bytes and subscriptions went back to 0 once the attackers left.)
    assert figures["other_client_attack_s"] < 2.0, figures
