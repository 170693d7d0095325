"""Which prefill KV servers a decode worker may connect to.

A KV descriptor arrives in the body of a decode hop, so whoever can POST one names the host
and port the decode worker connects to and authenticates with. The decode side therefore
connects only to peers on its allowlist (`--kv-peers`), checked before any socket is opened:

    entry "host:port"   that transfer server only ("[::1]:7000" for IPv6)
    entry "host"        any port on that host
    no entries          loopback only: 127.0.0.0/8, ::1 and "localhost", any port

`--kv-peers-file PATH` adds the entries of a file (comma- or line-separated, `#` comments),
read again whenever the file changes, so a deployment that gains nodes widens the list of a
running worker by rewriting the file (`hearth up --cluster` does, for every decode worker). A
file that cannot be read or parsed later keeps the last good list (logged); at start it is an
error.

Hosts are compared as written, never resolved: an IP literal matches the same address in any
spelling ("::1" == "0:0::1"), a name matches the same name (case-insensitive). A peer named by
a name is trusted as far as name resolution is.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from dataclasses import dataclass

log = logging.getLogger("hearth.kv_transfer")

LOOPBACK_NAMES = ("localhost",)


def normalize_host(host: str) -> str:
    """The comparable form of a host: a canonical IP literal, or the lower-cased name."""
    host = host.strip().strip("[]").lower()
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in LOOPBACK_NAMES


def _parse_entry(entry: str) -> tuple[str, int | None]:
    entry = entry.strip()
    if entry.startswith("["):  # [v6] or [v6]:port
        host, bracket, rest = entry[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
        if not bracket or (rest and port is None):
            raise ValueError(f"kv peers: cannot read {entry!r}")
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    else:  # a name, an IPv4 address, or a bare IPv6 address: any port
        host, port = entry, None
    if not host:
        raise ValueError(f"kv peers: {entry!r} has no host")
    if port is None:
        return normalize_host(host), None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"kv peers: {entry!r} has no valid port")
    return normalize_host(host), int(port)


@dataclass(frozen=True)
class PeerAllowlist:
    hosts: frozenset[str]  # any port on these
    addresses: frozenset[tuple[str, int]]  # exactly these host:port pairs

    @classmethod
    def parse(cls, entries: tuple[str, ...] | list[str]) -> PeerAllowlist:
        """From `KVTransferConfig.peers`; ValueError names a malformed entry."""
        parsed = [_parse_entry(e) for e in entries if e.strip()]
        return cls(frozenset(h for h, p in parsed if p is None),
                   frozenset((h, p) for h, p in parsed if p is not None))

    @property
    def loopback_only(self) -> bool:
        return not self.hosts and not self.addresses

    def allows(self, host: str, port: int) -> bool:
        host = normalize_host(host)
        if self.loopback_only:
            return _is_loopback(host)
        return host in self.hosts or (host, port) in self.addresses

    def describe(self) -> str:
        if self.loopback_only:
            return "loopback only (no --kv-peers given)"
        pairs = (f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.addresses)
        return ", ".join(sorted([*self.hosts, *pairs]))


def read_peers_file(path: str) -> list[str]:
    """The entries of a peers file; OSError if unreadable (ValueError comes from parsing)."""
    with open(path) as f:
        text = f.read()
    lines = (line.split("#", 1)[0] for line in text.splitlines())
    return [e.strip() for line in lines for e in line.split(",") if e.strip()]


class TrustedPeers:
    """A decode worker's allowlist: the static entries plus those of a peers file, re-read when
    the file's (mtime, size, inode) changes. Thread-safe (transfer threads ask it)."""

    def __init__(self, entries: tuple[str, ...] | list[str], path: str | None = None) -> None:
        self.entries, self.path = tuple(entries), path
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._list = PeerAllowlist.parse(self.entries)  # ValueError: a bad --kv-peers entry
        if path is not None:
            self._stamp = self._stat()
            self._list = PeerAllowlist.parse([*self.entries, *read_peers_file(path)])

    def _stat(self) -> tuple:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def current(self) -> PeerAllowlist:
        if self.path is None:
            return self._list
        with self._lock:
            try:
                stamp = self._stat()
                if stamp != self._stamp:
                    self._list = PeerAllowlist.parse([*self.entries, *read_peers_file(self.path)])
                    self._stamp = stamp
                    log.info("KV peers now: %s (from %s)", self._list.describe(), self.path)
            except (OSError, ValueError) as exc:
                if self._stamp is not None:  # say it once per change
                    log.warning("KV peers file %s: %s; keeping %s", self.path, exc,
                                self._list.describe())
                self._stamp = None
            return self._list

    def allows(self, host: str, port: int) -> bool:
        return self.current().allows(host, port)

    def describe(self) -> str:
        return self.current().describe()
