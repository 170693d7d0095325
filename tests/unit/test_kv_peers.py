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


def test_a_peers_file_is_read_again_when_it_changes(tmp_path, caplog):
    from hearth.kv_transfer.peers import TrustedPeers

    path = tmp_path / "peers"
    path.write_text("# the cluster's nodes\n10.0.0.2\n")
    peers = TrustedPeers(("10.0.0.9:7000",), str(path))
    assert peers.allows("10.0.0.2", 1234) and peers.allows("10.0.0.9", 7000)
    assert not peers.allows("10.0.0.3", 1234) and not peers.allows("127.0.0.1", 1)
    path.write_text("10.0.0.2, 10.0.0.3\n")  # a node joined (size changed)
    assert peers.allows("10.0.0.3", 1234)
    tmp = tmp_path / "peers.tmp"
    tmp.write_text("10.0.0.4\n")
    tmp.replace(path)  # an atomic rewrite: a new inode, maybe the same size and mtime
    assert peers.allows("10.0.0.4", 1) and not peers.allows("10.0.0.2", 1)
    assert peers.allows("10.0.0.9", 7000)  # the static entries stay
    path.write_text("bad:port:entry:x:\n[oops\n")
    assert peers.allows("10.0.0.4", 1)  # malformed later: the last good list, logged once
    assert "keeping" in caplog.text
    path.unlink()
    assert peers.allows("10.0.0.4", 1)
    path.write_text("10.0.0.5\n")
    assert peers.allows("10.0.0.5", 1) and not peers.allows("10.0.0.4", 1)


def test_a_bad_peers_file_at_start_is_an_error(tmp_path):
    from hearth.kv_transfer.peers import TrustedPeers

    with pytest.raises(FileNotFoundError):
        TrustedPeers((), str(tmp_path / "missing"))
    (tmp_path / "bad").write_text("[::1\n")
    with pytest.raises(ValueError, match="kv peers"):
        TrustedPeers((), str(tmp_path / "bad"))
