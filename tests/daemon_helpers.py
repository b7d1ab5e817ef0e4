"""What client processes run, for the multi-process tests: ``python daemon_helpers.py MODE ...``.

Each client is its own process (started by ``harness.spawn_client``), so that a test can kill it
and so that ``EXPERTD_PURE_PYTHON`` can be set before it imports ``expertd.native``. Modes:

- ``leased BLOBS ITERATIONS SEED``: random DEMANDs; every copied row checked (JSON on stdout);
- ``lockfree BLOBS STOP_FILE SEED MAX_SECONDS``: rows read without the daemon (JSON on stdout);
- ``prefetch BLOBS SECONDS SEED --out FILE``: PREFETCH, then lock-free reads and demands;
- ``hold BLOBS LAYER EXPERTS wait|nowait``: one demand held while heartbeating, until killed;
- ``hoard BLOBS COUNT PINS``: COUNT one-expert leases and the PINS held, until killed;
- ``step BLOBS STEP``: STEP published in its epoch record (inside a step if odd), until killed;
- ``parity`` / ``generate``: an mlx-lm model through ``expertd.client.load`` (JSON to ``--out``).
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import xxhash
from harness import RawClient, query_stats, validate

# Daemon flags that make lease reclamation quick enough to test (test_daemon, test_daemon_recovery).
FAST_TIMEOUTS = ("--client-timeout", "1.5", "--heartbeat", "0.3")


def _checksum_ok(manifest, layer: int, expert: int, data) -> bool:
    info = manifest.layers[layer]
    return xxhash.xxh3_64_intdigest(data[:info.expert_bytes]) == info.checksums[expert]


def leased_worker(args) -> dict:
    """Demand random groups of 2-4 experts; every copied row must pass the seqlock and checksum."""
    rng = random.Random(args.seed)
    with RawClient(args.blobs) as client:
        m = client.manifest
        verified, errors = 0, []
        for _ in range(args.iterations):
            layer = rng.randrange(len(m.layers))
            experts = rng.sample(range(m.layers[layer].num_experts), rng.randint(2, 4))
            reply = client.demand(layer, experts)
            copies = [bytes(client.arena.row(row)) for row in reply["rows"]]
            if not validate(client.raw, client.slots_offset, reply["rows"], reply["versions"]):
                errors.append(f"leased rows {reply['rows']} changed during the copy")
            for e, data in zip(experts, copies):
                if _checksum_ok(m, layer, e, data):
                    verified += 1
                else:
                    errors.append(f"layer {layer} expert {e}: wrong bytes in a leased row")
            client.release(reply["lease"])
        return {"iterations": args.iterations, "verified": verified, "errors": errors[:20]}


def lockfree_worker(args) -> dict:
    """Read rows without the daemon (remap, copy, validate) until ``stop_file`` appears.

    The arena's name comes from the daemon's stats, as a client's comes from its hello. A copy
    whose seqlock check fails is discarded; every accepted copy must hold the right bytes.
    """
    from expertd import native
    from expertd.manifest import Manifest
    from expertd.shm.layout import Arena

    rng = random.Random(args.seed)
    m = Manifest.load(Path(args.blobs))
    arena = Arena.attach(query_stats(args.blobs)["arena"])
    g = arena.geometry
    raw = arena.raw
    accepted = discarded = lookups = 0
    errors = []
    deadline = time.monotonic() + args.max_seconds
    stride = g.stride
    whole_row = np.array([0], np.intp), np.array([stride], np.intp), np.array([0], np.intp)
    while True:
        if lookups % 64 == 0 and (os.path.exists(args.stop_file) or time.monotonic() > deadline):
            break
        lookups += 1
        layer = rng.randrange(len(m.layers))
        experts = np.array(sorted(rng.sample(range(m.layers[layer].num_experts), 4)), np.int32)
        slots = np.empty(4, np.int32)
        versions = np.empty(4, np.uint64)
        filling = np.empty(4, np.int32)
        native.remap(raw, g.slot_of_offset, g.slots_offset, g.n_experts, g.total_rows, layer,
                     experts, slots, versions, filling)
        found = slots >= 0
        if not found.any():
            continue
        rows, vers, keys = slots[found], versions[found], experts[found]
        dest = np.empty((len(rows), stride), np.uint8)
        native.copy_segments(raw, g.rows_offset, stride, np.ascontiguousarray(rows), *whole_row,
                             dest.reshape(-1))
        if not native.validate(raw, g.slots_offset, np.ascontiguousarray(rows),
                               np.ascontiguousarray(vers)):
            discarded += len(rows)
            continue
        for e, data in zip(keys, dest):
            if _checksum_ok(m, layer, int(e), data.tobytes()):
                accepted += 1
            else:
                errors.append(f"layer {layer} expert {int(e)}: accepted a row with wrong bytes")
    raw = None
    arena.close()
    return {"accepted": accepted, "discarded": discarded, "lookups": lookups,
            "errors": errors[:20]}


def prefetch_worker(args) -> dict:
    """For ``seconds``: predict 4 experts of a layer (PREFETCH), then use 4 experts of which 2
    were predicted: READY rows are read lock-free (copy, seqlock check, hit bump, as clients
    do), the rest demanded. Every accepted row's bytes must match its checksum."""
    from expertd import native
    from expertd.protocol import Op

    rng = random.Random(args.seed)
    verified = discarded = demanded = 0
    errors = []
    with RawClient(args.blobs) as client:
        m = client.manifest
        g = client.arena.geometry
        raw, stride = client.raw, g.stride
        whole_row = np.array([0], np.intp), np.array([stride], np.intp), np.array([0], np.intp)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            layer = rng.randrange(len(m.layers))
            n = m.layers[layer].num_experts
            predicted = rng.sample(range(n), 4)
            client.conn.send(Op.PREFETCH, {"layer": layer, "experts": predicted})
            others = [e for e in range(n) if e not in predicted[:2]]
            used = np.array(sorted(predicted[:2] + rng.sample(others, 2)), np.int32)
            slots = np.empty(4, np.int32)
            versions = np.empty(4, np.uint64)
            filling = np.empty(4, np.int32)
            native.remap(raw, g.slot_of_offset, g.slots_offset, g.n_experts, g.total_rows,
                         layer, used, slots, versions, filling)
            found = slots >= 0
            missing = [int(e) for e in used[~found]]
            if found.any():
                rows = np.ascontiguousarray(slots[found])
                dest = np.empty((len(rows), stride), np.uint8)
                native.copy_segments(raw, g.rows_offset, stride, rows, *whole_row,
                                     dest.reshape(-1))
                if native.validate(raw, g.slots_offset, rows, np.ascontiguousarray(
                        versions[found])):
                    native.bump_hits(raw, g.slots_offset, rows)
                    for e, data in zip(used[found], dest):
                        if _checksum_ok(m, layer, int(e), data.tobytes()):
                            verified += 1
                        else:
                            errors.append(f"layer {layer} expert {int(e)}: wrong bytes read "
                                          "lock-free")
                else:
                    discarded += len(rows)
                    missing += [int(e) for e in used[found]]
            if missing:
                reply = client.demand(layer, missing)
                copies = [bytes(client.arena.row(row)) for row in reply["rows"]]
                if not validate(raw, client.slots_offset, reply["rows"], reply["versions"]):
                    errors.append(f"leased rows {reply['rows']} changed during the copy")
                for e, data in zip(missing, copies):
                    if _checksum_ok(m, layer, e, data):
                        verified += 1
                        demanded += 1
                    else:
                        errors.append(f"layer {layer} expert {e}: wrong bytes in a leased row")
                client.release(reply["lease"])
        raw = None
    return {"verified": verified, "demanded": demanded, "discarded": discarded,
            "errors": errors[:20]}


def hold_worker(args) -> None:
    """Demand ``experts`` of ``layer``, print READY, then heartbeat forever (until killed).

    With ``nowait`` the demand is sent and never read: the process is killed with the request
    still in the daemon (queued or leased).
    """
    from expertd.protocol import Op

    with RawClient(args.blobs) as client:
        body = {"layer": args.layer, "experts": [int(e) for e in args.experts.split(",")]}
        if args.reply == "wait":
            lease = client.request(Op.DEMAND, body, timeout=20.0)["lease"]
        else:
            client.conn.send(Op.DEMAND, body)
            lease = None
        print(json.dumps({"ready": True, "lease": lease}), flush=True)
        interval = client.hello["heartbeat_interval"]
        while True:
            client.heartbeat()
            time.sleep(interval)  # the heartbeat period the daemon asked for


def hoard_worker(args) -> None:
    """Lease ``count`` experts one by one (a lease each), pin ``pins`` ([[layer, [experts]]]
    JSON), print how many leases it holds, then heartbeat until killed."""
    from expertd.protocol import Op

    with RawClient(args.blobs) as client:
        keys = [(layer.index, e) for layer in client.manifest.layers
                for e in range(layer.num_experts)]
        leases = [client.demand(layer, [e])["lease"] for layer, e in keys[:args.count]]
        for layer, experts in json.loads(args.pins):
            client.request(Op.PIN, {"layer": layer, "experts": experts})
        print(json.dumps({"leases": len(leases)}), flush=True)
        while True:
            client.heartbeat()
            time.sleep(client.hello["heartbeat_interval"] / 2)


def step_worker(args) -> None:
    """Publish ``step`` in the epoch record the hello gave, as a client entering a step of
    device reads does; print the record; then heartbeat until killed."""
    from expertd import native
    from expertd.shm.layout import EPOCH_DTYPE

    with RawClient(args.blobs) as client:
        slot = client.hello["epoch_slot"]
        offset = client.arena.geometry.epochs_offset + slot * EPOCH_DTYPE.itemsize
        native.publish_u64(client.raw, offset + EPOCH_DTYPE.fields["step"][1], args.step)
        print(json.dumps({"slot": slot, "pid": os.getpid()}), flush=True)
        while True:
            client.heartbeat()
            time.sleep(client.hello["heartbeat_interval"] / 2)


def parity_client(args) -> dict:
    """Streamed against resident logits (``client_helpers.compare_runs``)."""
    import mlx_lm
    from client_helpers import compare_runs

    from expertd import native
    from expertd.client import load

    resident, _ = mlx_lm.load(args.model)
    streamed, tokenizer = load(args.blobs, prefetch=args.prefetch,
                               copy_ahead_bytes=args.copy_ahead_bytes)
    runs = compare_runs(resident, streamed, tokenizer.vocab_size)
    session = streamed.expertd_session
    result = dict(implementation=native.IMPLEMENTATION, runs=runs,
                  counters=session.all_counters(), max_group=session.session.max_group,
                  prediction=session.prediction())
    session.close()
    return result


def generate_client(args) -> dict:
    """Greedy decoding of a fixed prompt, one token per line appended to ``--tokens-file``."""
    import mlx.core as mx
    from client_helpers import prompt_ids
    from mlx_lm.generate import generate_step

    from expertd import native
    from expertd.client import load

    model, tokenizer = load(args.blobs, reconnect_timeout=args.reconnect_timeout,
                            prefetch=args.prefetch, copy_ahead_bytes=args.copy_ahead_bytes)
    session = model.expertd_session
    prompt = prompt_ids(args.prompt_len, tokenizer.vocab_size, args.seed)
    if args.barrier:
        # Tell the test we are loaded, then wait for everyone to be: no sleep, a file.
        barrier = Path(args.barrier)
        (barrier / f"ready-{os.getpid()}").touch()
        deadline = time.monotonic() + 120
        while not (barrier / "go").exists():
            if time.monotonic() > deadline:
                raise SystemExit("the test never said go")
            time.sleep(0.005)
    tokens = []
    out = open(args.tokens_file, "w") if args.tokens_file else None
    error = None
    try:
        # mlx-lm's own decoding loop, without the stop at end-of-sequence: a fixed length.
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=args.max_tokens):
            tokens.append(int(token))
            if out:
                out.write(f"{int(token)}\n")
                out.flush()
    except Exception as exc:  # reported to the test, which decides
        error = dict(type=type(exc).__name__, message=str(exc))
    finally:
        if out:
            out.close()
    result = dict(tokens=tokens, implementation=native.IMPLEMENTATION, error=error,
                  counters=session.all_counters())
    if error is None:
        session.close()
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("leased", help="random demands, every row checked")
    p.add_argument("blobs")
    p.add_argument("iterations", type=int)
    p.add_argument("seed", type=int)
    p.set_defaults(func=leased_worker)
    p = sub.add_parser("lockfree", help="rows read without the daemon")
    p.add_argument("blobs")
    p.add_argument("stop_file")
    p.add_argument("seed", type=int)
    p.add_argument("max_seconds", type=float)
    p.set_defaults(func=lockfree_worker)
    p = sub.add_parser("prefetch", help="prefetches, lock-free reads and demands, all checked")
    p.add_argument("blobs")
    p.add_argument("seconds", type=float)
    p.add_argument("seed", type=int)
    p.add_argument("--out", required=True)
    p.set_defaults(func=prefetch_worker)
    p = sub.add_parser("hold", help="hold one demand, heartbeating, until killed")
    p.add_argument("blobs")
    p.add_argument("layer", type=int)
    p.add_argument("experts", help="comma-separated expert numbers")
    p.add_argument("reply", choices=["wait", "nowait"])
    p.set_defaults(func=hold_worker)
    p = sub.add_parser("hoard", help="hold many one-expert leases and pins until killed")
    p.add_argument("blobs")
    p.add_argument("count", type=int)
    p.add_argument("pins", help='JSON [[layer, [experts]], ...]')
    p.set_defaults(func=hoard_worker)
    p = sub.add_parser("step", help="stay inside one step (its epoch record) until killed")
    p.add_argument("blobs")
    p.add_argument("step", type=int)
    p.set_defaults(func=step_worker)
    p = sub.add_parser("parity", help="compare streamed and resident logits")
    p.add_argument("--blobs", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prefetch", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--copy-ahead-bytes", type=int)
    p.set_defaults(func=parity_client)
    p = sub.add_parser("generate", help="greedy generation, tokens written as they come")
    p.add_argument("--blobs", required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--tokens-file")
    p.add_argument("--barrier")
    p.add_argument("--reconnect-timeout", type=float, default=60.0)
    p.add_argument("--prefetch", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--copy-ahead-bytes", type=int)
    p.add_argument("--out", required=True)
    p.set_defaults(func=generate_client)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    result = args.func(args)
    if result is None:  # hold, hoard, step: killed by the test, never here in practice
        return 0
    if getattr(args, "out", None):
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, args.out)
        return 0
    print(json.dumps(result), flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
