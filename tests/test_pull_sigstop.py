"""A pulling client stopped with SIGSTOP (docs/ARCHITECTURE.md, "Epochs"), against real processes: a
daemon, the client (this file run as a script, see ``main``), and an evicting client in the test
process.

The client reads arena rows the way a device does: the slot table once, the rows later, with no
seqlock check (only the step's epoch keeps them still). It stops itself between the two, in the
last MoE layer of a decode step. While it is stopped, another client evicts every row it looked
up, and the daemon refills them with other experts once it no longer protects the step:

- past the lease bound, it marks the step lost; resumed, the client must replay it, and every
  step's logits stay resident mlx-lm's, bit for bit. The control run ignores the loss: its
  stopped step's logits differ, which shows the rows really were refilled under it;
- stopped between steps past the client timeout, the client is forgotten and its record freed;
  resumed, its next step (no request tells it) must not be trusted either;
- killed while stopped, it holds no refill back.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from client_helpers import ROWS_MEDIUM, client_flags, pool_gb, prompt_ids, routed_model
from harness import Daemon, RawClient, read_json_line, spawn_client, stop_process, wait_until
from test_prompt_pull import ROWS_EVERY

from expertd import native
from expertd.protocol import Op
from expertd.shm.layout import EPOCH_DTYPE, SlotState

PROMPT = 5
STEPS = 24  # decode steps; the client stops in the first one, from ARMED on, that qualifies
ARMED = 2
LEASE_TIMEOUT = 1.0  # the lease bound: how long a stopped step holds refills back
FIELDS = [EPOCH_DTYPE.fields[name][1] for name in ("step", "lost", "pid")]
PROMPT_TOKENS = 40  # a prompt (more than DECODE_IDS pairs at top-k 4), speculative after one
PROMPT_STEPS = 4  # that times the pulls


def record(client: RawClient, slot: int) -> tuple:
    """``(step, lost, pid)`` of epoch record ``slot``, read from the arena as the daemon does."""
    base = client.arena.geometry.epochs_offset + slot * EPOCH_DTYPE.itemsize
    return tuple(native.read_u64(client.raw, base + field) for field in FIELDS)


def process_state(pid: int) -> str:
    """The one-letter state of process ``pid`` (``T``: stopped), from /proc or ps."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2]
    except FileNotFoundError:
        if sys.platform.startswith("linux"):
            return "gone"
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return out.stdout.strip()[:1] or "gone"


def resident_logits(model_dir, steps: int, prompt: int = PROMPT) -> list:
    """mlx-lm's own greedy decoding of a prompt of ``prompt`` tokens: the logits of each step,
    float32."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from test_step import resident_model

    model = resident_model(model_dir)
    cache = make_prompt_cache(model)
    x = mx.array([prompt_ids(prompt, model.args.vocab_size)])
    out = []
    for _ in range(steps + 1):
        logits = model(x, cache=cache)[:, -1, :]
        mx.eval(logits)
        out.append((str(logits.dtype), np.array(logits.astype(mx.float32))))
        x = mx.argmax(logits, axis=-1)[:, None]
    return out


def compare(out: Path, model_dir, steps: int = STEPS, prompt: int = PROMPT) -> list:
    """The steps whose logits (in the client's ``out``) differ from resident mlx-lm's."""
    got = np.load(out)
    want = resident_logits(model_dir, steps, prompt)
    return [i for i, (dtype, logits) in enumerate(want)
            if got["dtypes"][i] != dtype or not np.array_equal(got["logits"][i], logits)]


def stopped(proc) -> dict:
    """The line a client printed before it stopped itself, once it is stopped."""
    line = read_json_line(proc, 120)
    wait_until(lambda: process_state(proc.pid) == "T", 30, "the client to be stopped")
    return line


def eviction_groups(other: RawClient, layer: int, keep: list) -> list:
    """``(layer, experts)`` demands of every key but ``keep`` (of ``layer``), that layer
    first, each as large as the daemon leases at once."""
    m = other.manifest
    groups = []
    for lay in [layer] + [x.index for x in m.layers if x.index != layer]:
        keys = [e for e in range(m.layers[lay].num_experts) if lay != layer or e not in keep]
        size = other.hello["max_demand"]
        groups += [(lay, keys[i:i + size]) for i in range(0, len(keys), size)]
    return groups


def evict_all(other: RawClient, layer: int, experts: list, slots: list) -> list:
    """Demand the other experts of ``layer`` (then of every layer) until none of ``slots``
    holds the key it held; ``(layer, expert, state)`` of each of them then. An eviction
    while the stopped client's step protects the rows waits for that step to lose its
    epoch."""
    groups = eviction_groups(other, layer, experts)
    turn = [0]

    def moved():
        lay, group = groups[turn[0] % len(groups)]
        turn[0] += 1
        other.fetch(lay, group)
        held = []
        for slot, expert in zip(slots, experts):
            rec = other.arena.slots[slot]
            if (int(rec["layer"]), int(rec["expert"])) == (layer, expert):
                return None
            held.append((int(rec["layer"]), int(rec["expert"]), int(rec["state"])))
        return held

    return wait_until(moved, 60, "every row the stopped client looked up to be refilled",
                      interval=0.0)


def evict_until_held(other: RawClient, layer: int, experts: list) -> bytes:
    """Demand the other keys until a demand's refill is held back (an eviction while the
    stopped client is inside its step); that demand's request id, its reply still to come."""
    before = other.request(Op.STATS)["deferred_fills"]
    for lay, group in eviction_groups(other, layer, experts) * 4:
        rid = other.conn.send(Op.DEMAND, {"layer": lay, "experts": group})
        if other.request(Op.STATS)["deferred_fills"] > before:  # answered after the demand
            return rid
        other.release(other.conn.wait(rid, 20)["lease"])
    raise AssertionError("no demand evicted a row while the client was inside its step")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("honour", [True, False], ids=["replayed", "control-ignoring-lost"])
def test_a_step_stopped_past_the_lease_bound_is_replayed_exactly(models, isolated_env, tmp_path,
                                                                 honour):
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    flags = client_flags(blob_dir, ROWS_MEDIUM, tmp_path / "s.json", client_timeout=120.0)
    out = tmp_path / "logits.npz"
    with Daemon(blob_dir, isolated_env, *flags, "--lease-timeout", LEASE_TIMEOUT), \
            RawClient(blob_dir) as other:
        proc = spawn_client("decode", blob_dir, out, *([] if honour else ["--ignore-lost"]),
                            script=Path(__file__))
        try:
            stop = stopped(proc)
            assert "stopped" in stop, f"the client never stopped inside a step: {stop}"
            slot, step = stop["record"], stop["step"]
            assert step % 2 == 1 and record(other, slot) == (step, 0, proc.pid)
            before = other.request(Op.STATS)
            held = evict_all(other, stop["layer"], stop["experts"], stop["slots"])
            assert all(state == SlotState.READY for _, _, state in held), held
            # The daemon gave up on the stopped step (it outlasted the lease bound) and said so.
            assert record(other, slot) == (step, step, proc.pid)
            stats = other.request(Op.STATS)
            assert stats["epochs_lost"] == before["epochs_lost"] + 1, stats
            assert stats["deferred_fills"] > before["deferred_fills"], stats
            assert process_state(proc.pid) == "T"  # nothing above was the client's doing
            os.kill(proc.pid, signal.SIGCONT)
            done = read_json_line(proc, 120)
            assert proc.wait(30) == 0, proc.stderr.read()
        finally:
            stop_process(proc)
        mismatches = compare(out, model_dir)
        counters = done["counters"]
        if honour:
            assert mismatches == [], f"steps {mismatches} differ from resident mlx-lm"
            assert counters["replays_epoch"] >= 1, counters
        else:
            # The control: a client that ignores the loss lets the refilled rows' logits out.
            assert mismatches[:1] == [stop["decode_step"]], mismatches
            assert counters["replays_epoch"] == 0, counters
        wait_until(lambda: record(other, slot)[2] == 0, 10,
                   "the record to be free (the client said goodbye)")


@pytest.mark.timeout(240)
def test_a_client_forgotten_while_stopped_between_steps_replays_exactly(models, isolated_env,
                                                                        tmp_path):
    """The client stops between two steps for longer than the client timeout: the daemon
    forgets it and frees its record. Resumed, it makes no request before its next step pulls
    from the arena; that step is stopped too, and the rows it looked up are refilled. Its
    logits must still be resident mlx-lm's: a step the daemon does not protect must never be
    trusted (here the client notices its record is not its own and says hello again first)."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    flags = client_flags(blob_dir, ROWS_MEDIUM, tmp_path / "s.json", client_timeout=3.0)
    out = tmp_path / "logits.npz"
    with Daemon(blob_dir, isolated_env, *flags, "--lease-timeout", LEASE_TIMEOUT) as daemon:
        proc = spawn_client("decode", blob_dir, out, "--pause-at", ARMED, script=Path(__file__))
        other = None
        try:
            paused = stopped(proc)
            assert "paused" in paused, f"the client never paused between steps: {paused}"
            wait_until(lambda: daemon.stats()["epoch_clients"] == 0, 30,
                       "the daemon to forget the stopped client")
            other = RawClient(blob_dir)  # said hello now: alive while the test runs
            assert record(other, paused["record"]) == (0, 0, 0)  # free, zeroed
            os.kill(proc.pid, signal.SIGCONT)
            stop = stopped(proc)
            assert "stopped" in stop, f"the client never stopped inside a step: {stop}"
            evict_all(other, stop["layer"], stop["experts"], stop["slots"])
            os.kill(proc.pid, signal.SIGCONT)
            done = read_json_line(proc, 120)
            assert proc.wait(30) == 0, proc.stderr.read()
        finally:
            stop_process(proc)
            if other is not None:
                other.close()
    assert compare(out, model_dir) == [], "a step the daemon did not protect left the model"
    # It said hello again before the step (its record was not its own any more), and that
    # step, stopped past the lease bound, was replayed.
    counters = done["counters"]
    assert counters["reconnects"] >= 1 and counters["replays_epoch"] >= 1, counters


@pytest.mark.timeout(240)
def test_a_prompt_forgotten_while_stopped_inside_it_is_replayed_once(models, isolated_env,
                                                                    tmp_path):
    """A speculative prompt stopped inside its step for longer than the client timeout: the
    daemon forgets the client and frees its record, so the step is lost. Resumed, the client
    says hello again before it replays the prompt, so the replay holds an epoch of its own and
    is the only one; the prompt's logits and the decode steps' after it are resident's."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    flags = client_flags(blob_dir, ROWS_EVERY, tmp_path / "s.json", client_timeout=3.0)
    out = tmp_path / "logits.npz"
    with Daemon(blob_dir, isolated_env, *flags, "--lease-timeout", LEASE_TIMEOUT) as daemon:
        proc = spawn_client("decode", blob_dir, out, "--prompt", PROMPT_TOKENS, "--steps",
                            PROMPT_STEPS, "--armed", 0, script=Path(__file__))
        try:
            stop = stopped(proc)
            assert stop.get("decode_step") == 0, f"the client never stopped in its prompt: {stop}"
            wait_until(lambda: daemon.stats()["epoch_clients"] == 0, 30,
                       "the daemon to forget the stopped client")
            os.kill(proc.pid, signal.SIGCONT)
            done = read_json_line(proc, 120)
            assert proc.wait(30) == 0, proc.stderr.read()
        finally:
            stop_process(proc)
    assert compare(out, model_dir, PROMPT_STEPS, PROMPT_TOKENS) == []
    counters = done["counters"]
    assert counters["reconnects"] >= 1 and counters["replays_epoch"] == 1, counters


@pytest.mark.timeout(240)
def test_a_client_killed_while_stopped_inside_a_step_holds_nothing_back(models, isolated_env,
                                                                        tmp_path):
    """SIGKILL to the client stopped inside its step, a refill held back for it (the lease
    bound far away): the refill proceeds at once, its record is free with the step revoked,
    and the daemon serves the others."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    flags = client_flags(blob_dir, ROWS_MEDIUM, tmp_path / "s.json", client_timeout=120.0)
    with Daemon(blob_dir, isolated_env, *flags, "--lease-timeout", 120), \
            RawClient(blob_dir) as other:
        proc = spawn_client("decode", blob_dir, tmp_path / "logits.npz", script=Path(__file__))
        try:
            stop = stopped(proc)
            assert "stopped" in stop, f"the client never stopped inside a step: {stop}"
            slot, step = stop["record"], stop["step"]
            before = other.request(Op.STATS)
            rid = evict_until_held(other, stop["layer"], stop["experts"])
            assert not other.conn.poll(0)
            proc.kill()
            proc.wait(30)
            other.release(other.conn.wait(rid, 20)["lease"])  # well within the lease bound
        finally:
            stop_process(proc)
        assert record(other, slot) == (0, step, 0)  # its step revoked, the record free
        stats = other.request(Op.STATS)
        assert stats["clients_disconnected"] == before["clients_disconnected"] + 1, stats
        assert (stats["epoch_clients"], stats["epochs_lost"]) == (1, 0), stats
        assert other.fetch(0, [0, 1, 2, 3])


# ---- the client process -----------------------------------------------------------------------

def decode_client(args) -> None:
    """Greedy decoding through a pulling client; stops itself (SIGSTOP) once inside a step,
    and with ``--pause-at`` once before that step too.

    Prints ``{"paused": ...}`` or ``{"stopped": ...}`` (its epoch record, the step, the rows it
    looked up) just before stopping, then ``{"done": ...}`` (its counters) at the end; the
    logits of every step go to ``args.out``.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from expertd.client import load
    from expertd.client import pulling as pulling_module
    from expertd.client.arena_view import StepEpoch
    from expertd.client.pull import ABSENT, HostPuller, decode_status
    from expertd.manifest import Manifest

    if args.ignore_lost:
        end = StepEpoch.end

        def ignoring(self) -> bool:  # the control: a client that never replays a lost step
            end(self)
            return False

        StepEpoch.end = ignoring

    state = dict(armed=False, decode_step=-1, absent_step=None, fired=False)
    box = {}

    class DeviceLikePuller(HostPuller):
        """The host puller reading as a device kernel does: the slot table, then the rows,
        with no seqlock check; between the two it may stop this process."""

        def assemble(self, layer, ids, pool):
            arrays, status = super().assemble(layer, ids, pool)
            wanted = np.array(ids).reshape(-1) >= 0  # a prompt's stack leaves the rest unset
            if ((decode_status(np.array(status))[2] == ABSENT) & wanted).any():
                state["absent_step"] = box["session"].step_epoch.step
            return arrays, status

        def _copy(self, layer, experts):
            found = self.view.lookup(layer, experts)
            self._maybe_stop(layer, experts, found)
            return self._rows(layer, found, checked=False)

        def _maybe_stop(self, layer, experts, found) -> None:
            session = box["session"]
            epoch = session.step_epoch
            # The last MoE layer of a speculative decode step that found every row: nothing
            # later in the step can send it to a replay of its own (an absent row would).
            if not (state["armed"] and not state["fired"] and session.steps.mode.speculative
                    and epoch.inside and layer == box["last_layer"]
                    and state["absent_step"] != epoch.step and (found.slots >= 0).all()):
                return
            state["fired"] = True
            print(json.dumps(dict(stopped=True, record=session.session.hello["epoch_slot"],
                                  step=epoch.step, decode_step=state["decode_step"],
                                  layer=int(layer), experts=experts.tolist(),
                                  slots=found.slots.tolist())), flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def make_puller(mode, view, layers):
        assert mode == "host"
        return DeviceLikePuller(view, layers)

    pulling_module.make_puller = make_puller  # the module that makes the puller at attach
    top_k = Manifest.load(args.blobs).top_k
    model, _ = load(args.blobs, pool_backing="device", pull="host", speculate="on",
                    prefetch="off", pool_gb=pool_gb(args.blobs, top_k))
    session = box["session"] = model.expertd_session
    box["last_layer"] = max(layer.index for layer in session.manifest.layers)
    assert isinstance(session.puller, DeviceLikePuller)
    x = mx.array([prompt_ids(args.prompt, model.args.vocab_size)])
    if args.armed == 0:  # a prompt that speculates: after one that waits per layer (it times
        session.steps.speculate_prompts = True  # the pulls), with the host copy too
        mx.eval(model(x, cache=make_prompt_cache(model)))
    cache = make_prompt_cache(model)
    logits_all, dtypes = [], []
    for step in range(args.steps + 1):
        state["decode_step"], state["armed"] = step, step >= args.armed
        if step == args.pause_at:  # between two steps: the record shows an even step
            print(json.dumps(dict(paused=True, record=session.session.hello["epoch_slot"],
                                  step=session.step_epoch.step)), flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        logits = model(x, cache=cache)[:, -1, :]
        mx.eval(logits)
        dtypes.append(str(logits.dtype))
        logits_all.append(np.array(logits.astype(mx.float32)))
        x = mx.argmax(logits, axis=-1)[:, None]
    np.savez(args.out, logits=np.stack(logits_all), dtypes=np.array(dtypes))
    counters = session.all_counters()
    session.close()
    print(json.dumps(dict(done=True, fired=state["fired"], counters=counters)), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("decode", help="greedy decoding that stops itself inside a step")
    p.add_argument("blobs")
    p.add_argument("out")
    p.add_argument("--ignore-lost", action="store_true")
    p.add_argument("--pause-at", type=int, default=-1, help="stop before this decode step")
    p.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens")
    p.add_argument("--steps", type=int, default=STEPS, help="decode steps")
    p.add_argument("--armed", type=int, default=ARMED,
                   help="stop inside a step from this one on (0: the prompt, speculative)")
    p.set_defaults(func=decode_client)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
