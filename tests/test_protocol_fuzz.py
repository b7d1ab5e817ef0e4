"""Garbage on the wire never takes expertd down (design invariant 4).

One daemon serves the whole module (the real serving loop, in this process); a raw peer sends
it hand-written and hypothesis-generated malformed messages, and bytes that are not messages at
all. After each message the peer sends a STATS request and reads every reply up to its answer,
so the daemon has handled the message and every error reply it caused has arrived (one
connection's messages are handled in order).
"""

import os

import msgpack
import pytest
from harness import (
    SMALL_CACHE_GB,
    InProcessDaemon,
    RawClient,
    ZmtpPeer,
    expected_bytes,
    query_stats,
    wait_until,
)
from harness.zmtp import GREETING, frame, header
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertd.connection import Connection
from expertd.errors import ProtocolError
from expertd.protocol import (
    CLIENT_ID_BYTES,
    MAX_BODY,
    MAX_REQUEST_ID,
    PROTOCOL_VERSION,
    ErrorCode,
    Op,
    unpack,
)

SYNC_PREFIX = b"\xfe\xedsync"
OPS = {int(op) for op in Op}


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.fixture(scope="module")
def daemon(blobs, module_env):
    """One expertd for the module, in its own runtime and state directories."""
    with InProcessDaemon(blobs, "--cache-gb", SMALL_CACHE_GB) as d:
        yield d


class Peer:
    """A raw connection; ``sync`` collects the replies to everything sent before it."""

    def __init__(self, blob_dir, hello: bool = True):
        self.identity = os.urandom(CLIENT_ID_BYTES)
        self.conn = Connection(blob_dir, client_id=self.identity)
        self.n_sync = 0
        self.leases_released = 0
        if hello:
            body = {"version": PROTOCOL_VERSION, "client": self.identity, "pid": os.getpid()}
            self.send([b"hello", bytes([Op.HELLO]), _pack(body)])
            replies = self.sync()
            assert [r[2]["ok"] for r in replies if r[0] == b"hello"] == [True]

    def send(self, frames: list) -> None:
        self.conn.send_frames(frames)

    def sync(self, timeout: float = 10.0) -> list:
        """Send a STATS marker; return ``[(rid, op, body)]`` of every reply that came before it.

        Every reply must be well formed; leases granted to this peer are released at once.
        """
        self.n_sync += 1
        marker = SYNC_PREFIX + self.n_sync.to_bytes(4, "little")
        self.send([marker, bytes([Op.STATS]), _pack({})])
        replies = []
        while True:
            assert self.conn.poll(timeout), "expertd stopped answering"
            rid, op, body = self._receive()
            if rid == marker and body.get("ok") and "pid" in body:
                return replies
            replies.append((rid, op, body))

    def _receive(self) -> tuple:
        frames = self.conn.channel.recv()
        assert len(frames) == 3, frames
        rid, op, raw = frames
        assert len(rid) <= MAX_REQUEST_ID and len(op) == 1
        body = msgpack.unpackb(raw, raw=False)
        assert isinstance(body, dict) and type(body.get("ok")) is bool, body
        if body["ok"]:
            if "lease" in body:
                self.send([b"rel", bytes([Op.RELEASE]), _pack({"lease": body["lease"]})])
                self.leases_released += 1
        else:
            assert body["code"] in set(ErrorCode), body
            assert isinstance(body["error"], str) and body["error"], body
        return rid, op, body

    def call(self, op, body, rid: bytes = b"req", timeout: float = 10.0) -> dict:
        """Send one request and return its reply (a demand's may come after a later marker)."""
        self.send([rid, bytes([op]), body if isinstance(body, bytes) else _pack(body)])
        replies = wait_until(lambda: [r for r in self.sync() if r[0] == rid], timeout,
                             f"the reply to request {rid!r}", interval=0)
        return replies[0][2]

    def close(self) -> None:
        self.conn.close()


def reply_to(replies: list, rid: bytes) -> dict:
    mine = [body for got, _, body in replies if got == rid]
    assert mine, f"no reply with request id {rid!r} among {replies}"
    return mine[0]


@pytest.fixture(scope="module")
def peer(daemon):
    p = Peer(daemon.blob_dir)
    yield p
    p.close()


def _error(body: dict, code: ErrorCode) -> str:
    assert body["ok"] is False and body["code"] == code, body
    return body["error"]


# ---- hand-written cases ----------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_malformed_requests_get_error_replies(daemon, peer):
    demand = Op.DEMAND
    _error(peer.call(200, {"layer": 0, "experts": [1]}), ErrorCode.UNKNOWN_OP)
    assert "layer 3 out of range" in _error(peer.call(demand, {"layer": 3, "experts": [1]}),
                                            ErrorCode.OUT_OF_RANGE)
    assert "expert 16 out of range" in _error(peer.call(demand, {"layer": 0, "experts": [16]}),
                                              ErrorCode.OUT_OF_RANGE)
    _error(peer.call(demand, {"layer": 2**31 - 1, "experts": [0]}), ErrorCode.OUT_OF_RANGE)
    for bad in (b"\xc1", b"\x92\x01", b"", _pack([1, 2]), _pack({1: 2}), b"\xd9\x05ab"):
        _error(peer.call(demand, bad), ErrorCode.BAD_REQUEST)
    for body in ({"layer": -1, "experts": [0]}, {"layer": 2**40, "experts": [0]},
                 {"layer": 0, "experts": [1, 1]}, {"layer": 0, "experts": []},
                 {"layer": 0, "experts": [-3]}, {"layer": 0, "experts": [2**63]},
                 {"layer": "0", "experts": [0]}, {"layer": 0.0, "experts": [0]},
                 {"layer": True, "experts": [0]}, {"layer": 0, "experts": [[0]]},
                 {"layer": 0, "experts": {"0": 1}}, {"experts": [0]}):
        _error(peer.call(demand, body), ErrorCode.BAD_REQUEST)
    for op, body in ((Op.RELEASE, {"lease": -1}), (Op.PREFETCH, {"layer": 99, "experts": [0]}),
                     (Op.HEARTBEAT, {"client": b"short"}), (Op.PIN, {"layer": 0})):
        assert peer.call(op, body)["ok"] is False  # fire-and-forget ops too answer errors
    for core in (-1, 3, "1", 1.0, True, None):  # a PREFETCH's core: 0..len(experts)
        _error(peer.call(Op.PREFETCH, {"layer": 0, "experts": [4, 5], "core": core}),
               ErrorCode.BAD_REQUEST)
    _error(peer.call(Op.HELLO, {"version": PROTOCOL_VERSION + 1, "client": peer.identity,
                                "pid": 1}), ErrorCode.VERSION)
    # A larger message is never read (the daemon drops the peer at its length, see below);
    # the decoder refuses a larger body too.
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack(b"\x00" * (MAX_BODY + 1))

    # Frame-level damage: the request id comes back when it can be read.
    peer.send([b"two", b"frames"])
    _error(reply_to(peer.sync(), b"two"), ErrorCode.BAD_REQUEST)
    peer.send([b"four", bytes([Op.STATS]), _pack({}), b"extra"])
    _error(reply_to(peer.sync(), b"four"), ErrorCode.BAD_REQUEST)
    peer.send([b"r" * (MAX_REQUEST_ID + 1), bytes([Op.STATS]), _pack({})])
    _error(reply_to(peer.sync(), b""), ErrorCode.BAD_REQUEST)
    peer.send([b"op2", bytes([Op.STATS, 0]), _pack({})])
    _error(reply_to(peer.sync(), b"op2"), ErrorCode.BAD_REQUEST)

    stranger = Peer(daemon.blob_dir, hello=False)
    try:
        _error(stranger.call(demand, {"layer": 0, "experts": [1]}), ErrorCode.NOT_HELLO)
    finally:
        stranger.close()
    assert daemon.poll() is None


@pytest.mark.timeout(60)
def test_frames_over_the_size_limit_close_only_that_connection(daemon, peer):
    """A frame longer than any request's (MAXMSGSIZE), sent whole or only announced: libzmq
    closes the connection at the frame's length, before it keeps any of it, and the daemon
    parses none of it. A peer that keeps the rules is served meanwhile."""
    before = query_stats(daemon.blob_dir)
    with ZmtpPeer(daemon.blob_dir) as big:  # 1 MiB and a bit, whole
        big.send([b"big", bytes([Op.DEMAND]), b"\x00" * (1 << 20) + b"\x00" * 4096])
        assert big.closed()
    with ZmtpPeer(daemon.blob_dir) as huge:  # 4 GiB announced, none of it sent
        huge.send_raw(frame(b"r", more=True) + frame(bytes([Op.STATS]), more=True)
                      + header(4 << 30))
        assert huge.closed()
    assert peer.call(Op.STATS, {})["ok"]
    fresh = Peer(daemon.blob_dir)
    try:
        assert fresh.call(Op.DEMAND, {"layer": 0, "experts": [0, 1]})["ok"]
    finally:
        fresh.close()
    after = query_stats(daemon.blob_dir)
    assert after["bad_requests"] == before["bad_requests"]  # none of it was parsed
    assert after["peers_closed"] >= before["peers_closed"] + 2
    assert daemon.poll() is None


@pytest.mark.timeout(60)
def test_bytes_that_are_not_zmtp_close_only_that_connection(daemon, peer):
    """Bytes that are not a ZMTP greeting (which ZMTP 1.0 would take for frames: the ZAP
    domain makes libzmq refuse that version), a greeting of another mechanism, and half a
    greeting then silence: the first two cost their sender the connection, the last nothing
    but its descriptor until it closes, and the peers that keep the rules are served
    meanwhile."""
    before = query_stats(daemon.blob_dir)["handshakes_failed"]
    with ZmtpPeer(daemon.blob_dir, handshake=False) as http:
        http.send_raw(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)
        assert http.closed()
    with ZmtpPeer(daemon.blob_dir, handshake=False) as curve:
        curve.send_raw(GREETING.replace(b"NULL", b"CURV"))
        assert curve.closed()
    assert peer.call(Op.STATS, {})["ok"]
    wait_until(lambda: query_stats(daemon.blob_dir)["handshakes_failed"] == before + 1, 10,
               "the failed handshake to be counted")
    with ZmtpPeer(daemon.blob_dir, handshake=False) as silent:
        silent.send_raw(GREETING[:5])
        assert peer.call(Op.STATS, {})["ok"]
    assert daemon.poll() is None


@pytest.mark.timeout(60)
def test_requests_sent_back_to_back_on_a_raw_connection_are_answered_in_order(daemon, peer):
    """A raw ZMTP peer's messages: a request of one frame, a request of six, a good STATS; the
    first two get BAD_REQUEST replies carrying their request ids, and the stream stays in step."""
    with ZmtpPeer(daemon.blob_dir) as raw:
        raw.send([b"one"])
        raw.send([b"six", bytes([Op.STATS])] + [b"x"] * 4)
        raw.send([b"next", bytes([Op.STATS]), _pack({})])
        replies = [raw.reply() for _ in range(3)]
    assert [r[0] for r in replies] == [b"one", b"six", b"next"], replies
    assert [r[2]["ok"] for r in replies] == [False, False, True], replies
    assert replies[1][2]["error"] == "expected 3 frames, got more than 3", replies
    assert daemon.poll() is None


# ---- generated cases -------------------------------------------------------------------------

N_LAYERS, N_EXPERTS = 3, 16  # the session's tiny model
EXPERT_OPS = (Op.DEMAND, Op.PREFETCH, Op.PIN, Op.UNPIN)
ANSWERED_AT_ONCE = (Op.HELLO, Op.STATS, Op.HEARTBEAT, Op.PIN, Op.UNPIN)


_ints = st.one_of(st.integers(-3, 40), st.integers(-2**63, 2**64 - 1))
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(), st.text(max_size=12),
                     st.binary(max_size=20))
_values = st.recursive(
    _scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                      st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10)
_fields = {
    "layer": st.one_of(st.integers(-2, 4), _ints, _values),
    "experts": st.one_of(st.lists(st.integers(0, 17), max_size=30),  # duplicates, too many
                         st.lists(_ints, max_size=6), _values),
    "lease": st.one_of(st.integers(0, 50), _ints, _values),
    "client": st.one_of(st.binary(min_size=CLIENT_ID_BYTES, max_size=CLIENT_ID_BYTES),
                        st.binary(max_size=20), _values),
    "token": st.one_of(st.binary(min_size=CLIENT_ID_BYTES, max_size=CLIENT_ID_BYTES),
                       st.binary(max_size=20), _values),
    "version": st.one_of(st.integers(0, 3), _values),
    "pid": st.one_of(_ints, _values),
}
# Nearly valid bodies: in and just out of range, duplicates, empty lists, a missing field.
_plausible = st.fixed_dictionaries(
    {"layer": st.integers(-1, 4), "experts": st.lists(st.integers(-1, 17), max_size=6)},
    optional={"lease": st.integers(-1, 30), "version": st.integers(0, 2),
              "client": st.binary(min_size=15, max_size=17), "pid": st.integers(-1, 100)})
_bodies = st.one_of(
    st.binary(max_size=48),  # random bytes
    _values.map(_pack),  # valid msgpack of the wrong shape
    st.fixed_dictionaries({}, optional=_fields).map(_pack),  # the right keys, wild values
    st.dictionaries(_ints, _scalars, min_size=1, max_size=3).map(_pack),  # non-string keys
    _plausible.map(_pack),
    _plausible.map(_pack),
)
_op_bytes = st.one_of(st.sampled_from([bytes([op]) for op in OPS]),
                      st.sampled_from([bytes([op]) for op in OPS]),
                      st.integers(0, 255).map(lambda b: bytes([b])), st.binary(max_size=3))
_structured = st.tuples(st.binary(max_size=MAX_REQUEST_ID + 4), _op_bytes, _bodies).map(list)
# Requests one step from valid, so the checks past decoding (ranges, leases, pins) run too.
_near_valid = st.tuples(
    st.binary(max_size=MAX_REQUEST_ID),
    st.sampled_from([bytes([op]) for op in (*EXPERT_OPS, Op.RELEASE, Op.HEARTBEAT, Op.HELLO)]),
    st.fixed_dictionaries(
        {"layer": st.integers(0, 3), "experts": st.lists(st.integers(0, 16), max_size=5),
         "lease": st.integers(0, 40), "version": st.integers(1, PROTOCOL_VERSION),
         "client": st.binary(min_size=CLIENT_ID_BYTES, max_size=CLIENT_ID_BYTES),
         "token": st.binary(min_size=CLIENT_ID_BYTES, max_size=CLIENT_ID_BYTES),
         "pid": st.integers(0, 100)}).map(_pack)).map(list)
_messages = st.one_of(_structured, _structured, _near_valid, _near_valid,
                      st.lists(st.binary(max_size=40), min_size=1, max_size=6)).filter(
    # SHUTDOWN and GOODBYE are legitimate requests (stop serving, forget this peer);
    # everything else must leave the daemon serving this peer.
    lambda frames: not (len(frames) == 3 and frames[1] in (bytes([Op.SHUTDOWN]),
                                                           bytes([Op.GOODBYE]))))

def _is_int(value, hi: int = 2**63 - 1) -> bool:
    return type(value) is int and 0 <= value <= hi


def _is_client(value) -> bool:
    return isinstance(value, bytes) and len(value) == CLIENT_ID_BYTES


def expected_error(frames: list):
    """(request id, code) of the error reply ``frames`` must get, from a peer that said hello;
    None if the request is well formed (it may still be refused, e.g. a pin too many)."""
    if len(frames) != 3:
        return (frames[0] if len(frames[0]) <= MAX_REQUEST_ID else b""), ErrorCode.BAD_REQUEST
    rid, op, raw = frames
    if len(rid) > MAX_REQUEST_ID:
        return b"", ErrorCode.BAD_REQUEST
    if len(op) != 1:
        return rid, ErrorCode.BAD_REQUEST
    if op[0] not in OPS:
        return rid, ErrorCode.UNKNOWN_OP
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception:
        return rid, ErrorCode.BAD_REQUEST
    if not isinstance(body, dict):
        return rid, ErrorCode.BAD_REQUEST
    op = Op(op[0])
    if op is Op.HELLO:
        if not (_is_int(body.get("version")) and _is_client(body.get("client"))
                and _is_int(body.get("pid"))):
            return rid, ErrorCode.BAD_REQUEST
        if body["version"] != PROTOCOL_VERSION:
            return rid, ErrorCode.VERSION
    elif op is Op.HEARTBEAT and not (_is_client(body.get("client"))
                                     and _is_client(body.get("token"))):  # 16 bytes, like an id
        return rid, ErrorCode.BAD_REQUEST
    elif op is Op.RELEASE and not _is_int(body.get("lease")):
        return rid, ErrorCode.BAD_REQUEST
    elif op in EXPERT_OPS:
        layer, experts = body.get("layer"), body.get("experts")
        if not (_is_int(layer, 2**31 - 1) and isinstance(experts, list) and experts
                and all(_is_int(e, 2**31 - 1) for e in experts)
                and len(set(experts)) == len(experts)):
            return rid, ErrorCode.BAD_REQUEST
        if layer >= N_LAYERS or max(experts) >= N_EXPERTS:
            return rid, ErrorCode.OUT_OF_RANGE
    return None


@pytest.mark.timeout(120)
def test_fuzzed_messages_never_take_the_daemon_down(daemon, peer):
    checked, answered = [], []

    @settings(max_examples=3000, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(_messages)
    def send_one(frames):
        peer.send(frames)
        replies = peer.sync()
        want = expected_error(frames)
        if want is not None:
            rid, code = want
            errors = [body["code"] for got, _, body in replies
                      if got == rid and not body["ok"]]
            assert code in errors, (frames, replies)
            checked.append(code)
        elif frames[1][0] in ANSWERED_AT_ONCE:
            assert frames[0] in [got for got, _, _ in replies], (frames, replies)
            answered.append(frames[1][0])

    send_one()
    assert daemon.poll() is None
    # Every error the model predicts was seen, many times: the test cannot pass vacuously.
    assert set(checked) == {ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_OP,
                            ErrorCode.OUT_OF_RANGE, ErrorCode.VERSION}, set(checked)
    assert len(checked) > 1000 and len(answered) > 50, (len(checked), len(answered))

    # Replies to every demand came (the peer releases each lease it gets), and nothing leaked.
    wait_until(lambda: not peer.sync() and query_stats(daemon.blob_dir)["leases"] == 0, 10,
               "every fuzzed demand to be answered and released")
    stats = query_stats(daemon.blob_dir)
    assert stats["bad_requests"] >= len(checked)
    want = expected_bytes(daemon.blob_dir)
    with RawClient(daemon.blob_dir) as c:
        for layer in range(3):
            experts = [layer, 15 - layer, 7]
            assert c.fetch(layer, experts) == [want[(layer, e)] for e in experts]
    assert daemon.poll() is None
