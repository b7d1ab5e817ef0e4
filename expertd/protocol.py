"""The protocol between expertd and its clients, over the ZeroMQ wire of wire.py.

Frames, client to daemon: ``[request_id, op, body]``; the daemon's ROUTER knows the peer by its
DEALER's routing id (a client's is its client id).
Replies: ``[request_id, op, body]`` where body is a msgpack map with ``ok`` true, or ``ok``
false plus ``error`` (a message) and ``code``. ``prefetch``, ``release`` and ``goodbye`` are
fire-and-forget: they are answered only when they fail. Nothing from the wire is trusted: bodies
are decoded with size limits and turned into typed requests here, at the edge.
"""

import enum
from dataclasses import dataclass, fields

import msgpack

from .errors import ProtocolError

PROTOCOL_VERSION = 2
MAX_BODY = 64 * 1024
MAX_REQUEST_ID = 16
MAX_EXPERTS = 4096
REPLY_KEYS = 256  # a reply's map (STATS has some 65 keys)
# Experts a client reads ahead per expert a token routes to (client.predict); the daemon's
# default side rows are sized for it.
GUESS_WIDTH = 2


class Op(enum.IntEnum):
    """Operation codes; a value is never reused for another meaning."""

    HELLO = 1
    DEMAND = 2
    PREFETCH = 3
    RELEASE = 4
    PIN = 5
    UNPIN = 6
    STATS = 7
    SHUTDOWN = 8
    HEARTBEAT = 9
    GOODBYE = 10


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1
    BAD_REQUEST = 2
    VERSION = 3
    UNKNOWN_OP = 4
    OUT_OF_RANGE = 5
    CHECKSUM = 6
    IO = 7
    BUSY = 8
    SHUTTING_DOWN = 9
    NOT_HELLO = 10
    INTERNAL = 11  # a bug in the daemon; it logged it and keeps serving


@dataclass(frozen=True)
class Hello:
    version: int
    client: bytes
    pid: int
    pool_bytes: int = 0  # the client's own expert memory (its pools), for status


@dataclass(frozen=True)
class Experts:
    """Body of DEMAND, PREFETCH, PIN and UNPIN: one layer, distinct experts.

    A PREFETCH lists the experts to read best guess first and may say how many of them are its
    ``core`` (the rest is a wider guess the daemon reads only with workers to spare), and may
    ``claim`` others: guessed too, but resident when the client looked, so their side rows
    are kept for it and they are never read (the client's read-ahead budget did not pay)."""

    layer: int
    experts: tuple
    core: int | None = None
    claim: tuple = ()


@dataclass(frozen=True)
class Release:
    lease: int


@dataclass(frozen=True)
class Heartbeat:
    """Sent from the client's own heartbeat socket: the token from the hello proves who it is."""

    client: bytes
    token: bytes
    steps: int = 0  # the client's forward steps so far, and its host waits in them (status)
    host_waits: int = 0
    replays: int = 0  # its steps replayed, and the expert rows and bytes its device pulled
    pulled_rows: int = 0
    pulled_bytes: int = 0
    replays_absent: int = 0  # of its replays: a pulled row absent, the epoch lost, the
    replays_epoch: int = 0  # device's pull unlike the host copy
    replays_device: int = 0
    pull_us: int = 0  # microseconds of pulls timed under their own evaluation (a prompt's),
    pull_timed_bytes: int = 0  # and their bytes: the pull rate
    decode_tokens: int = 0  # its decode steps' sequences, and its steps of several (batches)
    batch_steps: int = 0
    routed_pairs: int = 0  # of its batch steps: pairs routed, and the distinct experts among
    union_experts: int = 0  # them (a layer each): how much a batch's pulls are shared


HEARTBEAT_COUNTS = tuple(f.name for f in fields(Heartbeat))[2:]  # after client and token


@dataclass(frozen=True)
class Empty:
    pass


def pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def unpack(raw: bytes, max_keys: int = 64) -> dict:
    """Decode a body with limits; raise ProtocolError on anything but a string-keyed map."""
    if len(raw) > MAX_BODY:
        raise ProtocolError(f"body of {len(raw)} bytes exceeds {MAX_BODY}")
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                               max_str_len=4096, max_bin_len=4096, max_array_len=MAX_EXPERTS,
                               max_map_len=max_keys, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"body is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(body, dict):
        raise ProtocolError("body must be a map")
    return body


def _int(body: dict, key: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    value = body.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{key} must be an integer in [{lo}, {hi}]")
    return value


def _bytes(body: dict, key: str, size: int) -> bytes:
    value = body.get(key)
    if not isinstance(value, bytes) or len(value) != size:
        raise ProtocolError(f"{key} must be {size} bytes")
    return value


def _expert_list(body: dict, key: str) -> list:
    experts = body.get(key)
    if not isinstance(experts, list) or not experts:
        raise ProtocolError(f"{key} must be a non-empty list")
    if any(type(e) is not int or not 0 <= e < 2**31 for e in experts):
        raise ProtocolError(f"{key} must be non-negative integers")
    if len(set(experts)) != len(experts):
        raise ProtocolError(f"{key} must be distinct")
    return experts


def _experts(body: dict, claims: bool = False) -> Experts:
    layer = _int(body, "layer", 0, 2**31 - 1)
    experts = _expert_list(body, "experts")
    core = _int(body, "core", 0, len(experts)) if "core" in body else None
    claim = ()
    if claims and "claim" in body:
        claim = tuple(_expert_list(body, "claim"))
        if len(claim) + len(experts) > MAX_EXPERTS or set(claim) & set(experts):
            raise ProtocolError("claim must be other experts than those to read")
    return Experts(layer, tuple(experts), core, claim)


CLIENT_ID_BYTES = 16
HEARTBEAT_TOKEN_BYTES = 16


def parse_request(frames: list):
    """``[request_id, op, body]`` -> (request_id, Op, typed request).

    Raises:
        ProtocolError: with the request id when it could be read (else b"").
    """
    if len(frames) != 3:
        raise ProtocolError(f"expected 3 frames, got {len(frames)}")
    rid, op_raw, raw = frames
    if len(rid) > MAX_REQUEST_ID:
        raise ProtocolError("request id too long")
    if len(op_raw) != 1:
        raise ProtocolError("op must be one byte")
    try:
        op = Op(op_raw[0])
    except ValueError:
        raise ProtocolError(f"unknown op {op_raw[0]}", ErrorCode.UNKNOWN_OP) from None
    body = unpack(raw)
    if op is Op.HELLO:
        req = Hello(_int(body, "version"), _bytes(body, "client", CLIENT_ID_BYTES),
                    _int(body, "pid"),
                    _int(body, "pool_bytes", 0, 2**62) if "pool_bytes" in body else 0)
    elif op in (Op.DEMAND, Op.PREFETCH, Op.PIN, Op.UNPIN):
        req = _experts(body, claims=op is Op.PREFETCH)
    elif op is Op.RELEASE:
        req = Release(_int(body, "lease"))
    elif op is Op.HEARTBEAT:
        req = Heartbeat(_bytes(body, "client", CLIENT_ID_BYTES),
                        _bytes(body, "token", HEARTBEAT_TOKEN_BYTES),
                        *(_int(body, key) if key in body else 0
                          for key in HEARTBEAT_COUNTS))
    else:
        req = Empty()
    return rid, op, req


def request(rid: bytes, op: Op, body: dict) -> list:
    return [rid, bytes([op]), pack(body)]


def reply_ok(rid: bytes, op: Op, **fields) -> list:
    return reply_packed(rid, op, pack_ok(**fields))


def pack_ok(**fields) -> bytes:
    """The body of a success reply, packed once for several replies."""
    return pack({"ok": True, **fields})


def reply_packed(rid: bytes, op: Op, body: bytes) -> list:
    return [rid, bytes([op]), body]


def reply_error(rid: bytes, op_byte: bytes, code: ErrorCode, message: str) -> list:
    return [rid, op_byte[:1] or b"\0", pack({"ok": False, "code": int(code), "error": message})]


def parse_reply(frames: list) -> tuple:
    """``[request_id, op, body]`` -> (request_id, op byte value, body map)."""
    if len(frames) != 3:
        raise ProtocolError(f"reply has {len(frames)} frames, expected 3")
    rid, op_raw, raw = frames
    return rid, op_raw[0] if op_raw else 0, unpack(raw, REPLY_KEYS)
