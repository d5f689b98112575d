"""The autoscaler's rules, as pure functions over an injected clock: `scaling.decide` and
`next_state`, and the signal record's merge (what makes delivery idempotent)."""

from __future__ import annotations

import datetime

import pytest

from kiln.operator import scaling
from kiln.operator import signals as sig

T0 = datetime.datetime(2026, 1, 2, 3, 0, 0, tzinfo=datetime.timezone.utc)
TTL = 600.0
POLICY = scaling.Policy(min_replicas=1, max_replicas=8, target=0.5, max_step=2, up_cooldown=60,
                        down_cooldown=300, stabilization=120)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def firing(name: str, starts: float = 0, seen: float = 0, value: float | None = None) -> dict:
    return {name: sig.Signal(sig.FIRING, at(starts), at(seen), "fp", value)}


def decide(signals, current=2, ready=None, state=None, now=10.0, policy=POLICY):
    return scaling.decide(policy, current, current if ready is None else ready, signals, state or {}, at(now), TTL)


def test_no_signal_is_no_decision():
    assert decide({}) == scaling.Decision(2, None)


@pytest.mark.parametrize("value, want", [
    (0.6, 3),  # 2 x 0.6/0.5 = 2.4 -> 3
    (0.9, 4),  # 3.6 -> 4
    (1.0, 4),  # 4, the most one step may add (maxStep 2)
    (0.51, 3),  # at least one
    (None, 3),  # no value: one
])
def test_high_steps_by_the_excess_within_max_step(value, want):
    d = decide(firing(sig.HIGH, value=value))
    assert (d.replicas, d.reason, d.source) == (want, "UtilizationHigh", sig.HIGH)


def test_high_never_passes_max_replicas():
    assert decide(firing(sig.HIGH, value=1.0), current=7).replicas == 8
    d = decide(firing(sig.HIGH, value=1.0), current=8)
    assert (d.replicas, d.reason) == (8, "AtMaxReplicas")


def test_high_waits_for_the_last_steps_pods():
    d = decide(firing(sig.HIGH, value=0.9), current=4, ready=2)
    assert (d.replicas, d.reason) == (4, "WaitingForReplicas")


def test_high_within_the_cooldown_holds_and_says_when_to_look_again():
    state = {"replicas": 2, "lastScaleTime": sig.format_time(at(0))}
    d = decide(firing(sig.HIGH, seen=30, value=0.9), state=state, now=40)
    assert (d.replicas, d.reason, d.look_again) == (2, "CooldownActive", 20)
    assert decide(firing(sig.HIGH, seen=30, value=0.9), state=state, now=61).replicas == 4


def test_a_high_alert_that_keeps_firing_keeps_stepping_toward_its_goal_after_each_cooldown():
    # 1 replica at 0.9 against 0.2 asks for ceil(4.5) = 5; maxStep 2. Alertmanager repeats the
    # unchanged alert only every repeat_interval: the steps do not wait for it.
    policy = scaling.Policy(1, 8, 0.2, 2, up_cooldown=60, down_cooldown=300, stabilization=120)
    signals = firing(sig.HIGH, seen=0, value=0.9)
    d = decide(signals, current=1, now=1, policy=policy)
    assert (d.replicas, d.goal, d.message) == (3, 5, "utilization 0.90, target 0.20; goal 5")
    state, _ = scaling.next_state({}, 1, d, at(1))
    assert state["goal"] == 5
    d = decide(signals, current=3, ready=2, state=state, now=30, policy=policy)
    assert (d.replicas, d.reason, d.goal) == (3, "WaitingForReplicas", 5)
    d = decide(signals, current=3, state=state, now=30, policy=policy)
    assert (d.replicas, d.reason, d.look_again) == (3, "CooldownActive", 31)
    state, _ = scaling.next_state(state, 3, d, at(30))
    d = decide(signals, current=3, state=state, now=61, policy=policy)
    assert (d.replicas, d.reason) == (5, "UtilizationHigh")
    state, _ = scaling.next_state(state, 3, d, at(61))
    # The goal reached, old evidence asks for nothing more; a delivery since sets a new goal
    # from the count serving now (5 x 0.3 / 0.2 = 7.5 -> 8, two at a time).
    assert decide(signals, current=5, state=state, now=500, policy=policy) == scaling.Decision(5, None)
    d = decide(firing(sig.HIGH, seen=200, value=0.3), current=5, state=state, now=200, policy=policy)
    assert (d.replicas, d.goal) == (7, 8)


def test_old_evidence_without_a_goal_moves_nothing():
    # Fired before the last step, nothing delivered since, no goal recorded (an older
    # operator's status): no step on old news, however long the wait.
    state = {"replicas": 4, "lastScaleTime": sig.format_time(at(50))}
    assert decide(firing(sig.HIGH, seen=40, value=0.9), current=4, state=state, now=500) == scaling.Decision(4, None)
    assert decide(firing(sig.LOW, seen=40, value=0.0), current=4, state=state, now=500) == scaling.Decision(4, None)


def test_a_low_alert_that_keeps_firing_keeps_stepping_down_toward_its_goal():
    d = decide(firing(sig.LOW, value=0.1), current=6, now=121)  # 6 x 0.1/0.5 -> 2, two at a time
    assert (d.replicas, d.goal) == (4, 2)
    state, _ = scaling.next_state({}, 6, d, at(121))
    d = decide(firing(sig.LOW, value=0.1), current=4, state=state, now=121 + 301)
    assert (d.replicas, d.reason) == (2, "UtilizationLow")
    # At minReplicas, the old evidence asks nothing more: no AtMinReplicas hold for old news.
    state = {"replicas": 1, "goal": 0, "lastScaleTime": sig.format_time(at(500))}
    assert decide(firing(sig.LOW, value=0.0), current=1, state=state, now=900) == scaling.Decision(1, None)


def test_a_high_alert_without_a_value_steps_by_one_per_cooldown_while_it_fires():
    state = {"replicas": 3, "lastScaleTime": sig.format_time(at(50))}
    d = decide(firing(sig.HIGH, seen=40), current=3, state=state, now=111)
    assert (d.replicas, d.reason, d.goal) == (4, "UtilizationHigh", 4)


def test_a_stale_signal_is_a_hold():
    assert decide(firing(sig.HIGH, value=0.9), now=TTL + 1) == scaling.Decision(2, None)
    assert decide(firing(sig.LOW, value=0.0), current=4, now=TTL + 1) == scaling.Decision(4, None)


def test_missing_metrics_hold_whatever_else_fires():
    d = decide({**firing(sig.HIGH, value=0.9), **firing(sig.MISSING)})
    assert (d.replicas, d.reason) == (2, "NoMetrics")


def test_high_and_low_from_the_same_moment_hold():
    d = decide({**firing(sig.HIGH, value=0.9), **firing(sig.LOW, value=0.1)})
    assert (d.replicas, d.reason) == (2, "ConflictingSignals")


def test_of_an_up_and_a_down_alert_the_newer_episode_decides():
    """Low's resolution reaches the operator a group interval after Prometheus resolved it:
    a load step at minReplicas is not held up by it, nor a load drop by a High still fading."""
    d = decide({**firing(sig.LOW, starts=0, value=0.1), **firing(sig.SURGE, starts=5, seen=5, value=0.9)}, now=6)
    assert (d.replicas, d.reason, d.source) == (4, "UtilizationHigh", sig.SURGE)
    d = decide({**firing(sig.HIGH, starts=0, value=0.9), **firing(sig.LOW, starts=5, seen=5, value=0.1)},
               current=6, now=200)
    assert (d.replicas, d.reason) == (4, "UtilizationLow")


def test_a_surge_scales_up_as_high_does_and_the_higher_value_sets_the_goal():
    d = decide(firing(sig.SURGE, value=1.5))
    assert (d.replicas, d.reason, d.source, d.goal) == (4, "UtilizationHigh", sig.SURGE, 6)
    d = decide({**firing(sig.HIGH, value=0.6), **firing(sig.SURGE, value=1.5)})
    assert (d.source, d.goal) == (sig.SURGE, 6)
    state = {"replicas": 2, "lastScaleTime": sig.format_time(at(0))}
    d = decide(firing(sig.SURGE, seen=30, value=1.5), state=state, now=40)
    assert (d.replicas, d.reason) == (2, "CooldownActive")  # the same cooldown as High's


def test_a_resolved_alert_is_no_signal():
    resolved = {sig.HIGH: sig.Signal(sig.RESOLVED, at(0), at(5), "fp", 0.9)}
    assert decide(resolved) == scaling.Decision(2, None)


def test_low_waits_for_its_stabilization_window_then_steps_down():
    d = decide(firing(sig.LOW, value=0.1), current=6, now=100)
    assert (d.replicas, d.reason, d.look_again) == (6, "Stabilizing", 20)
    d = decide(firing(sig.LOW, value=0.1), current=6, now=121)
    assert (d.replicas, d.reason) == (4, "UtilizationLow")  # 6 x 0.1/0.5 = 1.2 -> 2, at most 2 fewer


def test_low_respects_the_scale_down_cooldown_and_min_replicas():
    state = {"replicas": 3, "lastScaleTime": sig.format_time(at(100))}
    d = decide(firing(sig.LOW, seen=150, value=0.0), current=3, state=state, now=200)
    assert (d.reason, d.look_again) == ("CooldownActive", 200)
    assert decide(firing(sig.LOW, seen=150, value=0.0), current=3, state=state, now=401).replicas == 1
    d = decide(firing(sig.LOW, value=0.0), current=1, now=500)
    assert (d.replicas, d.reason) == (1, "AtMinReplicas")


def test_someone_elses_scale_is_kept_and_starts_the_cooldown():
    d = decide(firing(sig.HIGH, value=0.9), current=5, state={"replicas": 2})
    assert (d.replicas, d.reason, d.source) == (5, "ScaledExternally", "scale")
    state, recorded = scaling.next_state({"replicas": 2}, 5, d, at(10))
    assert recorded and state["lastScaleTime"] == sig.format_time(at(10)) and state["replicas"] == 5


def test_outside_the_bounds_is_put_back():
    d = decide({}, current=12, state={"replicas": 4})
    assert (d.replicas, d.reason, d.source) == (8, "OutsideBounds", "scale")
    assert decide({}, current=0).replicas == 1


def test_history_records_changes_and_each_new_hold_once_and_stays_bounded():
    state: dict = {}
    hold = scaling.Decision(2, "CooldownActive", sig.HIGH, "x")
    state, recorded = scaling.next_state(state, 2, hold, at(0))
    assert recorded and state["lastDecision"] == "2->2 CooldownActive" and "lastScaleTime" not in state
    state, recorded = scaling.next_state(state, 2, hold, at(1))
    assert not recorded and len(state["history"]) == 1
    for i in range(15):
        state, recorded = scaling.next_state(state, 2 + i, scaling.Decision(3 + i, "UtilizationHigh", sig.HIGH), at(i))
        assert recorded
    assert len(state["history"]) == scaling.HISTORY and state["history"][-1]["to"] == 17
    assert state["lastScaleTime"] == sig.format_time(at(14))


# -- the signal record ---------------------------------------------------------------------

def signal(state=sig.FIRING, starts=0.0, seen=0.0, value=0.9):
    return sig.Signal(state, at(starts), at(seen), "fp", value)


def test_merge_is_idempotent_and_never_goes_back():
    first = signal()
    assert sig.merge(None, first) == first
    assert sig.merge(first, signal(seen=1)) is None  # a duplicate within the refresh
    assert sig.merge(first, signal(seen=sig.REFRESH_SECONDS)).seen == at(sig.REFRESH_SECONDS)  # fresh evidence
    assert sig.merge(first, signal(seen=1, value=0.95)).value == 0.95
    resolved = signal(sig.RESOLVED, seen=30)
    assert sig.merge(first, resolved) == resolved
    assert sig.merge(resolved, signal(seen=40)) is None  # a replayed firing does not revive it
    newer = signal(starts=100, seen=100)
    assert sig.merge(resolved, newer) == newer  # a new episode does
    assert sig.merge(newer, signal(starts=0, seen=200)) is None  # an older episode, replayed


def test_a_damaged_record_reads_as_no_signal():
    assert sig.parse({sig.ANN_SIGNALS: "{not json"}) == {}
    assert sig.parse({sig.ANN_SIGNALS: '{"KilnUtilizationHigh": {"state": "firing"}}'}) == {}
    good = {sig.HIGH: signal()}
    assert sig.parse({sig.ANN_SIGNALS: sig.dump(good)}) == good


def test_the_signal_is_what_the_rules_read_for_the_model():
    # kiln.utilizationExpr: concurrency when the chart sets it, else the GPU, else a CPU pod's bottleneck.
    assert scaling.utilization_signal(["cpu"], 0).startswith("cpu: per pod the highest of engine busy, front ends busy")
    assert scaling.utilization_signal(["sm90"], 0).startswith("gpu: ")
    assert scaling.utilization_signal(["cpu", "sm90"], 0).startswith("gpu: ")
    assert scaling.utilization_signal(["cpu"], 10) == scaling.utilization_signal(["sm90"], 10) == (
        "concurrency: requests in flight per pod / 10")
    assert scaling.utilization_signal(["cpu"], 2.5).endswith("/ 2.5")
