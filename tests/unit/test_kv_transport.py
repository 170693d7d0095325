"""The TCP KV transport over small KV tensors and real loopback sockets (no model).

Exact bytes land in exact blocks; a wrong secret, a malformed header, an unknown lease or a
truncated stream is refused or fails cleanly, and the server keeps serving afterwards.
"""

import socket
import struct
import threading

import pytest
import torch

from hearth.disagg.kv_memory import KVMemory, coalesce, coalesce_pairs
from hearth.disagg.leases import LeaseManager
from hearth.disagg.tcp_transport import TransferClient, TransferServer
from hearth.disagg.wire import (HEADER_BYTES, Header, MsgType, Status, WireError, expect,
                                recv_exact, send_header)

SHAPE = (3, 2, 10, 4, 2, 8)  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]


def make_kv(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def server():
    src = make_kv(0)
    leases = LeaseManager(30.0)
    srv = TransferServer("127.0.0.1", 0, "s3cret", leases, KVMemory(src), io_timeout=5.0)
    yield srv, src, leases
    srv.close()


def test_coalesce_runs():
    assert coalesce([4, 5, 6, 9, 2, 3]) == [(4, 3), (9, 1), (2, 2)]
    assert coalesce_pairs([1, 2, 3, 7], [5, 6, 9, 10]) == [(1, 5, 2), (3, 9, 1), (7, 10, 1)]


def test_header_round_trip_and_size():
    h = Header(MsgType.PULL, num_blocks=3, bytes_per_block=99, payload_bytes=12,
               transfer_id="xfer-é", auth=b"a" * 32)
    assert len(h.pack()) == HEADER_BYTES == 128
    assert Header.unpack(h.pack()) == h


def test_pull_lands_exact_blocks_and_ack_releases(server):
    srv, src, leases = server
    leases.create("t1", [7, 2, 3, 9])
    dst = torch.zeros(SHAPE)
    client = TransferClient("s3cret")
    with client.connect("127.0.0.1", srv.port) as sock:
        memory = KVMemory(dst)
        # positions 1, 2, 0 of the lease (blocks 2, 3, 7) into local blocks 5, 6, 1
        n = client.pull(sock, "t1", [1, 2, 0], memory.buffers([5, 6, 1]), memory.bytes_per_block)
        assert n == 3 * memory.bytes_per_block
        client.finish(sock, "t1", ack=True)
    for local, remote in ((5, 2), (6, 3), (1, 7)):
        assert torch.equal(dst[:, :, local], src[:, :, remote])
    untouched = [b for b in range(SHAPE[2]) if b not in (5, 6, 1)]
    assert not dst[:, :, untouched].any()
    assert leases.take_released() == [[7, 2, 3, 9]]


def test_reject_releases_and_unknown_transfer_is_refused(server):
    srv, _, leases = server
    leases.create("t1", [1])
    client = TransferClient("s3cret")
    with client.connect("127.0.0.1", srv.port) as sock:
        client.finish(sock, "t1", ack=False)
        assert leases.take_released() == [[1]]
        with pytest.raises(WireError) as err:
            client.pull(sock, "t1", [0], KVMemory(torch.zeros(SHAPE)).buffers([0]),
                        KVMemory(torch.zeros(SHAPE)).bytes_per_block)
        assert err.value.status == Status.UNKNOWN_TRANSFER
        with pytest.raises(WireError) as err:
            client.finish(sock, "never", ack=True)
        assert err.value.status == Status.UNKNOWN_TRANSFER


def test_wrong_secret_is_refused(server):
    srv, _, leases = server
    leases.create("t1", [1])
    with pytest.raises(WireError) as err:
        TransferClient("guess").connect("127.0.0.1", srv.port)
    assert err.value.status == Status.BAD_AUTH
    assert leases.num_active == 1  # nothing was read or released


def test_layout_mismatch_and_bad_positions_are_refused(server):
    srv, _, leases = server
    leases.create("t1", [1, 2])
    client = TransferClient("s3cret")
    memory = KVMemory(torch.zeros(SHAPE))
    with client.connect("127.0.0.1", srv.port) as sock:
        with pytest.raises(WireError) as err:
            client.pull(sock, "t1", [0], memory.buffers([0])[:1], memory.chunk_bytes)
        assert err.value.status == Status.LAYOUT_MISMATCH
        with pytest.raises(WireError) as err:
            client.pull(sock, "t1", [2], memory.buffers([0]), memory.bytes_per_block)
        assert err.value.status == Status.LAYOUT_MISMATCH
    assert leases.num_active == 1 and leases.take_released() == []  # read guards all returned


def authenticated_raw_socket(port: int) -> socket.socket:
    """A connection past the handshake, for sending hand-made bytes."""
    from hearth.disagg.wire import auth_tag

    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = expect(sock, MsgType.HELLO)
    send_header(sock, Header(MsgType.AUTH, auth=auth_tag("s3cret", hello.auth)))
    expect(sock, MsgType.OK)
    return sock


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\n" + b"x" * (HEADER_BYTES - 16),  # wrong magic
    struct.pack("!4sH", b"HKVX", 99) + b"\0" * (HEADER_BYTES - 6),  # future version
    Header(MsgType.DATA).pack(),  # a response type sent as a request
    Header(MsgType.PULL, num_blocks=1 << 30, payload_bytes=4).pack(),  # absurd count
])
def test_malformed_header_is_refused_and_server_keeps_serving(server, garbage):
    srv, src, leases = server
    sock = authenticated_raw_socket(srv.port)
    sock.sendall(garbage)
    with pytest.raises(WireError) as err:
        expect(sock, MsgType.OK)
    assert err.value.status == Status.BAD_REQUEST
    assert sock.recv(1) == b""  # the server hung up on that connection only
    sock.close()
    leases.create("t1", [4])
    dst = torch.zeros(SHAPE)
    client = TransferClient("s3cret")
    with client.connect("127.0.0.1", srv.port) as good:
        memory = KVMemory(dst)
        client.pull(good, "t1", [0], memory.buffers([0]), memory.bytes_per_block)
    assert torch.equal(dst[:, :, 0], src[:, :, 4])


def test_truncated_data_fails_the_pull_cleanly():
    """A peer that dies mid-stream: the client raises, having written only its own buffers."""
    listener = socket.create_server(("127.0.0.1", 0))
    memory = KVMemory(torch.zeros(SHAPE))

    def half_then_die():
        conn, _ = listener.accept()
        send_header(conn, Header(MsgType.HELLO, auth=b"n" * 32))
        recv_exact(conn, HEADER_BYTES)
        send_header(conn, Header(MsgType.OK))
        pull = Header.unpack(recv_exact(conn, HEADER_BYTES))
        recv_exact(conn, pull.payload_bytes)
        size = pull.num_blocks * memory.bytes_per_block
        send_header(conn, Header(MsgType.DATA, num_blocks=pull.num_blocks,
                                 bytes_per_block=memory.bytes_per_block, payload_bytes=size))
        conn.sendall(b"\1" * (size // 2))
        conn.close()

    thread = threading.Thread(target=half_then_die)
    thread.start()
    client = TransferClient("any", io_timeout=5)
    with client.connect("127.0.0.1", listener.getsockname()[1]) as sock:
        with pytest.raises(ConnectionError):
            client.pull(sock, "t1", [0, 1], memory.buffers([3, 4]), memory.bytes_per_block)
    thread.join()
    listener.close()


def test_close_drops_connections_and_ends_read_guards(server):
    srv, _, leases = server
    leases.create("t1", [5])
    client = TransferClient("s3cret")
    sock = client.connect("127.0.0.1", srv.port)
    client.open(sock, "t1")  # holds the read guard
    assert leases.release("t1", "reject")
    assert leases.take_released() == []  # guarded
    srv.close()
    assert sock.recv(1) == b""
    sock.close()
    for _ in range(100):  # the connection thread ends the guard as it exits
        released = leases.take_released()
        if released:
            break
        threading.Event().wait(0.01)
    assert released == [[5]]
