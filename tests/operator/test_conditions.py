"""Conditions the Kubernetes way, with an injected clock."""

from __future__ import annotations

import datetime

import pytest

from kiln.operator import conditions as c


class Clock:
    def __init__(self) -> None:
        self.now = datetime.datetime(2026, 3, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)

    def __call__(self) -> datetime.datetime:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += datetime.timedelta(seconds=seconds)


class TestSetCondition:
    def test_new_condition_has_every_field(self):
        clock = Clock()
        [cond] = c.set_condition([], "EngineReady", False, "Building", "building sm90", 4, clock)
        assert cond == {"type": "EngineReady", "status": "False", "observedGeneration": 4,
                        "lastTransitionTime": "2026-03-01T12:00:00Z", "reason": "Building",
                        "message": "building sm90"}

    def test_transition_time_moves_only_on_a_flip(self):
        clock = Clock()
        conds = c.set_condition([], "Available", False, "Deploying", "starting", 1, clock)
        clock.tick(30)
        conds = c.set_condition(conds, "Available", False, "NoReadyReplicas", "0/2 ready", 2, clock)
        cond = c.get_condition(conds, "Available")
        assert cond["lastTransitionTime"] == "2026-03-01T12:00:00Z"  # same status: time kept
        assert (cond["reason"], cond["message"], cond["observedGeneration"]) == ("NoReadyReplicas", "0/2 ready", 2)
        clock.tick(30)
        conds = c.set_condition(conds, "Available", True, "MinimumReplicasAvailable", "2/2 ready", 2, clock)
        assert c.get_condition(conds, "Available")["lastTransitionTime"] == "2026-03-01T12:01:00Z"

    def test_other_conditions_untouched_and_order_stable(self):
        clock = Clock()
        conds = c.set_condition([], "Degraded", False, "AsExpected", "", 1, clock)
        conds.append({"type": "Scaling", "status": "True", "reason": "Hold", "message": "",
                      "observedGeneration": 1, "lastTransitionTime": "2026-01-01T00:00:00Z"})
        conds = c.set_condition(conds, "EngineReady", True, "EnginesReady", "", 1, clock)
        assert [x["type"] for x in conds] == ["EngineReady", "Degraded", "Scaling"]
        assert c.get_condition(conds, "Scaling")["lastTransitionTime"] == "2026-01-01T00:00:00Z"

    def test_input_is_not_mutated(self):
        conds = c.set_condition([], "Progressing", True, "Building", "", 1, Clock())
        before = [dict(x) for x in conds]
        c.set_condition(conds, "Progressing", False, "RolloutComplete", "", 2, Clock())
        assert conds == before

    @pytest.mark.parametrize("type_,reason,status", [("engine_ready", "Ok", True), ("EngineReady", "not ok", True),
                                                     ("EngineReady", "Ok", "Maybe")])
    def test_rejects_non_kubernetes_shapes(self, type_, reason, status):
        with pytest.raises(ValueError):
            c.set_condition([], type_, status, reason, "", 1, Clock())


class TestHelpers:
    def test_is_true_and_transitions(self):
        clock = Clock()
        old = c.set_condition([], "Available", False, "Deploying", "", 1, clock)
        new = c.set_condition(old, "Available", True, "MinimumReplicasAvailable", "", 1, clock)
        new = c.set_condition(new, "Degraded", False, "AsExpected", "", 1, clock)
        assert c.is_true(new, "Available") and not c.is_true(old, "Available")
        assert [x["type"] for x in c.transitions(old, new)] == ["Available", "Degraded"]
        assert c.transitions(new, new) == []
