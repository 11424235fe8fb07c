"""Which address ``X-Forwarded-For`` names as the client (:func:`umbra.api.http.forwarded_client`).

The rate limit of pairing redemptions counts attempts by that address, so two spellings of one
address are two budgets, and a trusted proxy not recognised as one makes every client behind it
share its budget.
"""

from __future__ import annotations

import ipaddress

import pytest

from umbra.api.http import address_block, forwarded_client

TRUSTED = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8"))


@pytest.mark.parametrize(
    "peer, forwarded, client",
    [
        # The usual: the nearest untrusted hop, whatever the client wrote to its left.
        ("10.0.0.1", ["6.6.6.6, 203.0.113.7"], "203.0.113.7"),
        ("10.0.0.1", ["6.6.6.6", "203.0.113.7, 10.0.0.2"], "203.0.113.7"),
        ("192.0.2.1", ["203.0.113.7"], "192.0.2.1"),  # an untrusted peer's header is its own word
        ("10.0.0.1", [], "10.0.0.1"),
        # A hop with its port (some proxies write it): the address, whatever the port.
        ("10.0.0.1", ["203.0.113.7:40001"], "203.0.113.7"),
        ("10.0.0.1", ["[2001:db8::7]:40001"], "2001:db8::7"),
        ("10.0.0.1", ["[2001:db8::7]"], "2001:db8::7"),
        ("10.0.0.1", ["203.0.113.7, 10.0.0.2:8080"], "203.0.113.7"),  # a trusted hop with a port is still trusted
        # One address, one spelling.
        ("10.0.0.1", ["2001:DB8:0::7"], "2001:db8::7"),
        ("10.0.0.1", ["::ffff:203.0.113.7"], "203.0.113.7"),
        # A trusted proxy seen as an IPv4-mapped IPv6 address (a dual-stack socket) is the trusted proxy.
        ("::ffff:10.0.0.1", ["203.0.113.7"], "203.0.113.7"),
        ("10.0.0.1", ["203.0.113.7, ::ffff:10.0.0.2"], "203.0.113.7"),
        # An untrusted peer is named in the same one spelling (an IPv4 client of a dual-stack socket).
        ("::ffff:192.0.2.1", ["203.0.113.7"], "192.0.2.1"),
        ("2001:DB8::1", [], "2001:db8::1"),
        # Every hop trusted: the farthest one.
        ("10.0.0.1", ["10.0.0.3:1234, 10.0.0.2"], "10.0.0.3"),
        # A hop that is no address is no trusted proxy, and is named as written.
        ("10.0.0.1", ["203.0.113.7, unknown"], "unknown"),
    ],
)
def test_the_client_is_the_nearest_untrusted_address(peer, forwarded, client):
    assert forwarded_client(peer, forwarded, TRUSTED) == client


@pytest.mark.parametrize(
    "address, prefix, block",
    [
        # An IPv6 client takes any address of its network at will: the network is what is counted.
        ("2001:db8:1:2:3:4:5:6", 64, "2001:db8:1:2::/64"),
        ("2001:db8:1:2::ffff", 64, "2001:db8:1:2::/64"),
        ("2001:db8:1:2:3:4:5:6", 56, "2001:db8:1::/56"),
        ("2001:db8:1:2ff:3:4:5:6", 56, "2001:db8:1:200::/56"),
        ("2001:db8:1:2:3:4:5:6", 128, "2001:db8:1:2:3:4:5:6"),
        ("fe80::1%eth0", 64, "fe80::/64"),
        # An IPv4 client is its address; an IPv4-mapped one too, not ::ffff:0:0/64 shared with every other.
        ("203.0.113.7", 64, "203.0.113.7"),
        ("::ffff:203.0.113.7", 64, "203.0.113.7"),
        # What names no address is itself.
        ("unknown", 64, "unknown"),
    ],
)
def test_a_client_is_counted_by_the_block_it_holds(address, prefix, block):
    assert address_block(address, prefix) == block
