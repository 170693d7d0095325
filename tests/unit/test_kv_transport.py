"""The TCP KV transport over small KV tensors and real loopback sockets (no model).

Exact bytes land in exact blocks; a wrong secret, a malformed header, an unknown lease or a
truncated stream is refused or fails cleanly, and the server keeps serving afterwards. The
handshake is mutual and bound to one transfer, and sockets that never authenticate cannot
keep a real peer out.
"""

import socket
import struct
import threading

import pytest
import torch

from hearth.kv_transfer.kv_memory import KVMemory, coalesce, coalesce_pairs
from hearth.kv_transfer.leases import LeaseManager
from hearth.kv_transfer.tcp_transport import TransferClient, TransferServer
from hearth.kv_transfer.wire import (CLIENT, HEADER_BYTES, SERVER, Header, MsgType, Status,
                                WireError, expect, proof, recv_exact, send_header)

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
    with client.connect("127.0.0.1", srv.port, "t1") as sock:
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
    with client.connect("127.0.0.1", srv.port, "t1") as sock:
        client.finish(sock, "t1", ack=False)
        assert leases.take_released() == [[1]]
        with pytest.raises(WireError) as err:
            client.pull(sock, "t1", [0], KVMemory(torch.zeros(SHAPE)).buffers([0]),
                        KVMemory(torch.zeros(SHAPE)).bytes_per_block)
        assert err.value.status == Status.UNKNOWN_TRANSFER
    with client.connect("127.0.0.1", srv.port, "never") as sock:
        with pytest.raises(WireError) as err:
            client.finish(sock, "never", ack=True)
        assert err.value.status == Status.UNKNOWN_TRANSFER


def test_wrong_secret_is_refused(server):
    srv, _, leases = server
    leases.create("t1", [1])
    with pytest.raises(WireError) as err:
        TransferClient("guess").connect("127.0.0.1", srv.port, "t1")
    assert err.value.status == Status.BAD_AUTH
    assert leases.num_active == 1  # nothing was read or released


def test_layout_mismatch_and_bad_positions_are_refused(server):
    srv, _, leases = server
    leases.create("t1", [1, 2])
    client = TransferClient("s3cret")
    memory = KVMemory(torch.zeros(SHAPE))
    with client.connect("127.0.0.1", srv.port, "t1") as sock:
        with pytest.raises(WireError) as err:
            client.pull(sock, "t1", [0], memory.buffers([0])[:1], memory.chunk_bytes)
        assert err.value.status == Status.LAYOUT_MISMATCH
        with pytest.raises(WireError) as err:
            client.pull(sock, "t1", [2], memory.buffers([0]), memory.bytes_per_block)
        assert err.value.status == Status.LAYOUT_MISMATCH
    assert leases.num_active == 1 and leases.take_released() == []  # read guards all returned


def authenticated_raw_socket(port: int, transfer_id: str = "t1") -> socket.socket:
    """A connection past the handshake, for sending hand-made bytes."""
    return TransferClient("s3cret", io_timeout=5).connect("127.0.0.1", port, transfer_id)


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
    with client.connect("127.0.0.1", srv.port, "t1") as good:
        memory = KVMemory(dst)
        client.pull(good, "t1", [0], memory.buffers([0]), memory.bytes_per_block)
    assert torch.equal(dst[:, :, 0], src[:, :, 4])


def test_truncated_data_fails_the_pull_cleanly():
    """A peer that dies mid-stream: the client raises, having written only its own buffers."""
    listener = socket.create_server(("127.0.0.1", 0))
    memory = KVMemory(torch.zeros(SHAPE))

    def half_then_die():  # it knows the secret, so it passes the handshake
        conn, _ = listener.accept()
        client_nonce = Header.unpack(recv_exact(conn, HEADER_BYTES)).auth
        send_header(conn, Header(MsgType.HELLO, transfer_id="t1", auth=b"n" * 32))
        recv_exact(conn, HEADER_BYTES)
        send_header(conn, Header(MsgType.OK, transfer_id="t1",
                                 auth=proof("any", SERVER, client_nonce, b"n" * 32, "t1")))
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
    with client.connect("127.0.0.1", listener.getsockname()[1], "t1") as sock:
        with pytest.raises(ConnectionError):
            client.pull(sock, "t1", [0, 1], memory.buffers([3, 4]), memory.bytes_per_block)
    thread.join()
    listener.close()


def test_close_drops_connections_and_ends_read_guards(server):
    srv, _, leases = server
    leases.create("t1", [5])
    client = TransferClient("s3cret")
    sock = client.connect("127.0.0.1", srv.port, "t1")
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


# ---- the handshake: mutual, bound to one transfer -------------------------------------------


def fake_server(answer_ok):
    """A listener that plays the server's half of the handshake without knowing the secret:
    `answer_ok(client_nonce, server_nonce) -> bytes` is the proof it sends. Returns (port,
    join) where join() gives the headers it received after its OK (before the client left)."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = []

    def serve():
        conn, _ = listener.accept()
        with conn:
            hello = Header.unpack(recv_exact(conn, HEADER_BYTES))
            send_header(conn, Header(MsgType.HELLO, transfer_id=hello.transfer_id, auth=b"s" * 32))
            received.append(Header.unpack(recv_exact(conn, HEADER_BYTES)))  # the client's AUTH
            send_header(conn, Header(MsgType.OK, transfer_id=hello.transfer_id,
                                     auth=answer_ok(hello.auth, b"s" * 32)))
            while chunk := conn.recv(HEADER_BYTES):
                received.append(chunk)
        listener.close()

    thread = threading.Thread(target=serve)
    thread.start()
    return listener.getsockname()[1], lambda: (thread.join(), received)[1]


@pytest.mark.parametrize("forged", ["garbage", "client_proof_reflected", "other_transfer"])
def test_client_requests_nothing_from_a_server_that_cannot_prove_the_secret(forged):
    answers = {
        "garbage": lambda cn, sn: b"x" * 32,
        # the client's own proof sent back: the side label makes it worthless as the server's
        "client_proof_reflected": lambda cn, sn: proof("s3cret", CLIENT, cn, sn, "t1"),
        # a genuine server proof, but for another transfer
        "other_transfer": lambda cn, sn: proof("s3cret", SERVER, cn, sn, "t2"),
    }
    port, join = fake_server(answers[forged])
    with pytest.raises(WireError) as err:
        TransferClient("s3cret", io_timeout=5).connect("127.0.0.1", port, "t1")
    assert err.value.status == Status.BAD_AUTH
    auth, *after = join()
    assert auth.msg_type == MsgType.AUTH and after == []  # no PULL, OPEN, ACK or REJECT


def test_connection_serves_only_the_transfer_it_authenticated_for(server):
    srv, _, leases = server
    leases.create("t1", [1])
    leases.create("t2", [2])
    memory = KVMemory(torch.zeros(SHAPE))
    client = TransferClient("s3cret", io_timeout=5)
    with client.connect("127.0.0.1", srv.port, "t1") as sock:
        with pytest.raises(WireError) as err:
            client.pull(sock, "t2", [0], memory.buffers([0]), memory.bytes_per_block)
        assert err.value.status == Status.BAD_REQUEST
    assert not memory.tensor.any() and leases.num_active == 2 and leases.take_released() == []


def test_a_proof_for_one_connection_does_not_open_another(server):
    """Replaying an AUTH seen on the wire fails: the server's nonce is fresh each time."""
    srv, _, leases = server
    leases.create("t1", [1])
    seen = []

    def recording_proof(cn, sn):
        seen.append((cn, proof("s3cret", CLIENT, cn, sn, "t1")))
        return seen[-1][1]

    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as first:
        send_header(first, Header(MsgType.HELLO, transfer_id="t1", auth=b"c" * 32))
        hello = expect(first, MsgType.HELLO)
        send_header(first, Header(MsgType.AUTH, transfer_id="t1",
                                  auth=recording_proof(b"c" * 32, hello.auth)))
        expect(first, MsgType.OK)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as replay:
        send_header(replay, Header(MsgType.HELLO, transfer_id="t1", auth=b"c" * 32))
        expect(replay, MsgType.HELLO)
        send_header(replay, Header(MsgType.AUTH, transfer_id="t1", auth=seen[0][1]))
        with pytest.raises(WireError) as err:
            expect(replay, MsgType.OK)
        assert err.value.status == Status.BAD_AUTH
    assert leases.num_active == 1


# ---- slots: only authenticated connections count ----------------------------------------------


def test_idle_sockets_do_not_keep_a_real_transfer_out():
    src = make_kv(1)
    leases = LeaseManager(30.0)
    # A long handshake timeout: here it is the slot accounting that must let the transfer in.
    srv = TransferServer("127.0.0.1", 0, "s3cret", leases, KVMemory(src), io_timeout=60,
                         max_connections=4, handshake_timeout=60)
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(64)]
    try:
        leases.create("t1", [3])
        dst = torch.zeros(SHAPE)
        client = TransferClient("s3cret", io_timeout=10)
        with client.connect("127.0.0.1", srv.port, "t1") as sock:
            memory = KVMemory(dst)
            client.pull(sock, "t1", [0], memory.buffers([0]), memory.bytes_per_block)
            client.finish(sock, "t1")
        assert torch.equal(dst[:, :, 0], src[:, :, 3])
        # the oldest idle sockets from this peer made room: the server closed them
        assert idle[0].recv(1) == b""
        num_authenticated, num_pending = srv.num_connections()
        assert num_pending <= srv.max_unauthenticated_per_peer
    finally:
        for sock in idle:
            sock.close()
        srv.close()


def test_a_silent_socket_is_dropped_after_the_handshake_timeout():
    leases = LeaseManager(30.0)
    srv = TransferServer("127.0.0.1", 0, "s3cret", leases, KVMemory(make_kv(2)), io_timeout=60,
                         handshake_timeout=0.2)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as silent:
            assert silent.recv(1) == b""  # the server hung up, long before io_timeout
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as slow:
            slow.sendall(b"HK")  # a trickle does not extend the deadline
            assert slow.recv(1) == b""
    finally:
        srv.close()
