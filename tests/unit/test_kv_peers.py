"""The decode side's KV peer allowlist: which transfer servers a descriptor may name."""

import pytest

from hearth.kv_transfer.peers import PeerAllowlist


def test_default_is_loopback_only_on_any_port():
    peers = PeerAllowlist.parse(())
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "0:0:0:0:0:0:0:1", "localhost",
                 "LocalHost"):
        assert peers.allows(host, 7000), host
    for host in ("10.0.0.7", "0.0.0.0", "::", "example.com", "169.254.169.254", "::ffff:10.0.0.1"):
        assert not peers.allows(host, 7000), host


def test_listed_peers_only():
    peers = PeerAllowlist.parse(("10.0.0.7:7000", "[fd00::2]:7001", "kv-host", "10.0.0.9"))
    assert peers.allows("10.0.0.7", 7000) and not peers.allows("10.0.0.7", 7001)
    assert peers.allows("fd00:0::2", 7001) and not peers.allows("fd00::2", 7000)
    assert peers.allows("KV-HOST", 1234) and peers.allows("10.0.0.9", 1)
    # an explicit list replaces the loopback default
    assert not peers.allows("127.0.0.1", 7000) and not peers.allows("10.0.0.8", 7000)


@pytest.mark.parametrize("entry", ["10.0.0.7:", "10.0.0.7:0", "10.0.0.7:70000", ":7000",
                                   "[fd00::2", "[fd00::2]x", "host:port"])
def test_malformed_entries_are_refused(entry):
    with pytest.raises(ValueError, match="kv peers"):
        PeerAllowlist.parse((entry,))
