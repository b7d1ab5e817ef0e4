"""Speculation and Drains (client/speculation.py) on their own: no daemon, no model, no MLX
computation. When auto stops and restarts speculating, how it weighs replays against the
waits they save, and how drains back off."""

import pytest

from expertd.client.speculation import (
    DRAIN_EVERY,
    MAX_DRAIN_EVERY,
    MAX_REPLAYS,
    MIN_WINDOW,
    PROBE_AT,
    RETRY_AFTER,
    SHADOW_STEPS,
    WINDOW,
    Drains,
    Speculation,
)


def hitting(speculation: Speculation) -> Speculation:
    """``speculation`` after SHADOW_STEPS steps waiting per layer that found every expert in
    its pool: the host copy may speculate."""
    for _ in range(SHADOW_STEPS):
        speculation.shadow(True)
    return speculation


def test_auto_stops_speculating_when_replays_are_frequent_and_tries_again():
    auto = Speculation("auto")

    def wanted():  # a device puller's: no shadow to wait for after a replay
        return auto.wanted(device=True)

    for _ in range(MAX_REPLAYS + 1):
        assert wanted()
        auto.record(True)
    assert not auto.active and auto.stopped == 1
    assert not any(wanted() for _ in range(RETRY_AFTER - 1))
    assert wanted()  # tries again
    for _ in range(MAX_REPLAYS + 1):  # and fails again: it waits twice as long
        auto.record(True)
    assert not any(wanted() for _ in range(2 * RETRY_AFTER - 1)) and wanted()
    for _ in range(WINDOW):  # a window that pays resets the wait
        auto.record(False)
    assert auto.retry_after == RETRY_AFTER
    on, off = Speculation("on"), Speculation("off")
    for _ in range(3 * MAX_REPLAYS):
        on.record(True)
    assert on.wanted() and not off.wanted()
    with pytest.raises(ValueError, match="speculate must be one of"):
        Speculation("sometimes")


def test_the_host_copy_speculates_only_once_steps_waiting_per_layer_would_have_hit():
    """With the host copy a speculative step that misses a pool is replayed: a whole step
    computed twice (2 s a token on this CPU at 1 MB experts). auto waits per layer until
    SHADOW_STEPS such steps in a row found every expert in its pool, and again after any
    replay; a step that moved a row starts the count over. A device puller pulls its misses
    (no replay), and ``on`` speculates as told."""
    auto = Speculation("auto")
    for _ in range(3 * SHADOW_STEPS):  # pools too small for the routing: never speculates
        assert not auto.wanted()
        auto.shadow(False)
    for _ in range(SHADOW_STEPS - 1):
        auto.shadow(True)
    assert not auto.wanted()
    auto.shadow(False)  # one step that moved a row: the count starts over
    for _ in range(SHADOW_STEPS - 1):
        auto.shadow(True)
    assert not auto.wanted()
    auto.shadow(True)
    assert auto.wanted() and auto.wanted(device=False)
    auto.record(False)
    assert auto.wanted()  # a speculative step that hit keeps it
    auto.record(True)  # a replay: back to waiting per layer until the shadow hits again
    assert not auto.wanted() and auto.active and auto.stopped == 0
    assert hitting(auto).wanted()
    assert Speculation("auto").wanted(device=True)  # a device puller: no shadow needed
    assert Speculation("auto").wanted(replays_misses=False)  # any puller pulls the misses
    assert Speculation("on").wanted()
    assert not hitting(Speculation("off")).wanted()
    # Where speculating was measured to save half a step or more (a GPU without a puller,
    # whose steps waiting per layer wait for the device 12 times), replays pay: no shadow.
    gpu = Speculation("auto")
    gpu.timed(False, 4.0)
    gpu.timed(True, 1.0)
    gpu.shadow(False)
    assert gpu.wanted() and not gpu.waiting(replays_misses=True)
    cpu = Speculation("auto")
    cpu.timed(False, 1.0)
    cpu.timed(True, 0.9)
    assert not cpu.waiting(replays_misses=True)  # no step waiting per layer told it yet
    cpu.shadow(False)
    assert not cpu.wanted() and cpu.waiting(replays_misses=True)


def test_auto_weighs_replays_against_the_waits_they_save():
    """Measured costs decide before the replay count does: where a replay costs a whole
    per-layer step and speculating saves little (a CPU), one replay in a few steps stops it;
    where it saves most of a step (a GPU), the same rate keeps it."""
    cheap_waits = Speculation("auto")
    cheap_waits.timed(True, 1.0)
    cheap_waits.timed(False, 1.1)  # waiting per layer costs 10% more than one wait
    for replayed in (False, False, False, True):  # 25% replays: 1.0 + 0.25 * 1.1 > 1.1
        cheap_waits.record(replayed)
    assert not cheap_waits.active and cheap_waits.stopped_by_cost == 1
    costly_waits = Speculation("auto")
    costly_waits.timed(True, 1.0)
    costly_waits.timed(False, 4.0)  # per-layer waits quadruple a step: 1.0 + 0.25 * 4 < 4
    for replayed in (False, False, False, True):
        costly_waits.record(replayed)
    assert costly_waits.active and costly_waits.pays()
    unmeasured = Speculation("auto")
    for replayed in (False, False, False, True):
        unmeasured.record(replayed)
    assert unmeasured.active  # the replay count alone, as before
    # Never replayed, but a speculative step costs what a per-layer one does: it stops as
    # soon as MIN_WINDOW steps are measured, not at the window's end. The per-layer cost is
    # measured by one probe step early in the window.
    level = hitting(Speculation("auto"))
    level.timed(True, 1.0)
    wanted = []
    while level.active and len(wanted) < WINDOW:
        wanted.append(level.wanted())
        if wanted[-1]:
            level.record(False)
        else:
            level.timed(False, 1.0)  # the probe: a step waiting in every layer
    assert wanted.count(False) == 1 and wanted.index(False) == PROBE_AT
    assert not level.active and level.stopped_by_cost == 1
    assert wanted.count(True) == MIN_WINDOW  # stopped at the first verdict it could make
    # Where the waits cost more than a speculative step, no replay: it goes on to the window.
    fast = Speculation("auto")
    fast.timed(True, 1.0)
    fast.timed(False, 3.0)
    for _ in range(WINDOW):
        fast.record(False)
    assert fast.active and fast.stopped == 0


def test_replays_on_absent_rows_weigh_in_the_cost_but_not_the_count():
    """A replay on rows absent from the arena: the reads were the step's anyway, so it does not
    count towards MAX_REPLAYS, but the step computed for nothing, so it weighs in the cost.
    Where the arena is too small for what the steps route to (most steps replayed), auto stops
    once waiting per layer was measured to cost less; where waiting per layer costs far more,
    it speculates on while rows are absent at a rate that still pays, even past MAX_REPLAYS."""
    def run(layer_s: float) -> Speculation:
        auto = Speculation("auto")
        auto.timed(True, 1.0)
        wanted = auto.wanted(device=True)
        assert wanted
        auto.record(True, absent=True)  # rows absent: the next step waits per layer, once
        assert not auto.wanted(device=True) and auto.window_replays == 0
        auto.timed(False, layer_s)
        for _ in range(MAX_REPLAYS + 3):  # every step replayed on absent rows
            if not (auto.active and auto.wanted(device=True)):
                break
            auto.record(True, absent=True)
        return auto

    slow = run(layer_s=1.5)  # 1.0 + 1.0 * 1.5 > 1.5: speculating costs more
    assert not slow.active and slow.stopped_by_cost == 1
    fast = run(layer_s=30.0)  # 1.0 + 1.0 * 30 > 30 as well: every step replayed never pays
    assert not fast.active
    some = Speculation("auto")  # a third of the steps replayed on absent rows, waits costly
    some.timed(True, 1.0)
    some.timed(False, 4.0)  # 1.0 + 0.33 * 4.0 < 4.0
    replayed = [step % 3 == 0 for step in range(WINDOW)]
    assert sum(replayed) > MAX_REPLAYS  # a window's worth that the count would stop at
    for _ in range(3):
        for r in replayed:
            assert some.wanted(device=True)
            some.record(r, absent=True)
    assert some.active and some.stopped == 0
    counted = Speculation("auto")  # the same replays of another cause: the count stops it
    counted.timed(True, 1.0)
    counted.timed(False, 4.0)
    for r in replayed:
        counted.record(r)
    assert not counted.active and counted.stopped_by_cost == 0


def test_a_device_puller_waits_per_layer_only_once_a_step_was_replayed():
    """The per-layer probe costs a wait per MoE layer (12 on the bench's model: 0.11 of a wait
    per token over 96 tokens, measured on an H100). A device puller's speculative step never
    costs what waiting per layer does, so it probes only when a replay makes the cost matter;
    the host copy probes at PROBE_AT as before."""
    device = Speculation("auto")
    device.timed(True, 1.0)
    wanted = []
    for _ in range(3 * WINDOW):
        wanted.append(device.wanted(device=True))
        device.record(False)
    assert all(wanted) and device.active and device.layer_s == 0.0
    device.record(True)  # a replay: the next step waits per layer, once
    assert not device.wanted(device=True)
    device.timed(False, 4.0)  # that step, timed
    assert all(device.wanted(device=True) for _ in range(WINDOW))
    for _ in range(MIN_WINDOW):  # weighed now: 1.0 + 1/5 * 4.0 < 4.0
        device.record(False)
    assert device.pays() and device.active
    host = hitting(Speculation("auto"))
    host.timed(True, 1.0)
    for _ in range(PROBE_AT):
        assert host.wanted() and host.wanted(device=False)
        host.record(False)
    assert not host.wanted()  # the host copy's probe, replay or none


def test_one_slow_step_decides_nothing_and_a_restart_measures_afresh():
    """The first speculative step compiles the device's kernels (hundreds of milliseconds on
    CUDA): one such step must not stop a speculation that pays, and a stop must not outlive
    what caused it (on the H200 a moving average started by that step kept auto on the
    per-layer path for hundreds of steps: 0.19 x resident)."""
    first = hitting(Speculation("auto"))
    first.timed(True, 100.0)  # the compile
    first.timed(False, 3.0)
    for _ in range(WINDOW):
        assert first.wanted()
        first.timed(True, 1.0)
        first.record(False)
    assert first.active and first.stopped == 0 and first.spec_s == 1.0
    # A stop by cost (the speculative steps were slow then) is weighed again on fresh times.
    slow = hitting(Speculation("auto"))
    slow.timed(False, 3.0)
    for _ in range(MIN_WINDOW):
        slow.timed(True, 5.0)
        slow.record(False)
    assert not slow.active and slow.stopped_by_cost == 1
    assert not any(slow.wanted() for _ in range(RETRY_AFTER - 1)) and slow.wanted()
    assert slow.spec_s == 0.0  # the slow times are gone
    for _ in range(WINDOW):
        slow.timed(True, 1.0)
        slow.record(False)
    assert slow.active and slow.stopped == 1


def _interval(drains: Drains) -> int:
    """Steps from one drain to the next (the drained one included), as the loop sees them."""
    n = 1
    while not drains.due():
        drains.pipelined += 1
        n += 1
    return n


def test_drains_back_off_while_they_promote_nothing_and_return_when_one_does():
    """A drain that promoted nothing (the pools hold what the steps use) doubles the interval
    to the next, up to MAX_DRAIN_EVERY: each is an idle spell of the device. A drain that
    promoted brings it back to DRAIN_EVERY."""
    drains = Drains()
    assert _interval(drains) == DRAIN_EVERY
    seen = []
    while not seen or seen[-1] < MAX_DRAIN_EVERY:
        drains.drained(0)
        seen.append(_interval(drains))
    assert seen == [DRAIN_EVERY * 2**i for i in range(1, len(seen) + 1)]
    drains.drained(0)
    assert _interval(drains) == MAX_DRAIN_EVERY  # no further
    drains.drained(3)
    assert _interval(drains) == DRAIN_EVERY
