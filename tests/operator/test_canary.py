"""The canary rollout's state machine (`canary.advance`) over an injected clock, and the
analysis verdicts (`analysis.combine`): every transition, table by table."""

from __future__ import annotations

import datetime

import pytest

from kiln.operator import analysis as an
from kiln.operator import canary
from kiln.operator import signals as sig

T0 = datetime.datetime(2026, 1, 2, 3, 0, 0, tzinfo=datetime.timezone.utc)
POLICY = canary.Policy(steps=((10, 60.0), (50, 60.0)), interval=20.0, failure_limit=1, canary_min=1)
KEY, OLD = "newkey", "oldkey"


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def go(state=None, now=0.0, **kw) -> canary.Plan:
    args = dict(desired_key=KEY, version="2", engines_ready=True, state=state, rollback=None, canary_ready=1,
                canary_target=1, stable_done=False, outcome=None, action=None, now=at(now))
    args.update(kw)
    return canary.advance(POLICY, **args)


PASS = an.Outcome(an.PASSED, ({"name": "error-ratio", "query": "q", "value": 0.0, "min": None, "max": 0.05,
                               "result": an.PASSED},), "1 check(s) passed")
FAIL = an.Outcome(an.FAILED, ({"name": "error-ratio", "query": "q", "value": 0.4, "min": None, "max": 0.05,
                               "result": an.FAILED},), "failed: error-ratio")
NODATA = an.Outcome(an.INCONCLUSIVE, ({"name": "error-ratio", "query": "q", "value": None, "min": None,
                                       "max": 0.05, "result": an.INCONCLUSIVE},), "inconclusive: error-ratio")
DOWN = an.Outcome(an.ERROR, (), "error: Prometheus did not answer")


def reasons(plan: canary.Plan) -> list[str]:
    return [e[1] for e in plan.events]


def running(now=0.0, **over) -> dict:
    """A canary at step 1, its weight in effect since `now`, analysed at `now` (passed)."""
    s = {"version": "2", "engineKey": KEY, "phase": canary.PROGRESSING, "step": 0, "targetWeight": 10, "weight": 10,
         "startedAt": sig.format_time(at(now)), "stepStartedAt": sig.format_time(at(now)), "analysisFailures": 0,
         "lastAnalysis": {"time": sig.format_time(at(now)), "result": an.PASSED, "message": "", "checks": []}}
    s.update(over)
    return s


def test_nothing_moves_before_the_engines_exist():
    plan = go(engines_ready=False)
    assert (plan.canary_key, plan.state, plan.promote) == (None, None, False)


def test_start_then_the_steps_clock_waits_for_the_canary_pods():
    plan = go(canary_ready=0)
    assert plan.canary_key == KEY and reasons(plan) == ["RolloutStarted"]
    assert plan.state["weight"] == 0 and "stepStartedAt" not in plan.state  # not in effect yet
    plan = go(plan.state, now=5, canary_ready=1)
    assert plan.state["stepStartedAt"] == sig.format_time(at(5)) and plan.state["weight"] == 10
    assert plan.analyze  # the first evaluation of the step is due at once


def test_an_analysis_is_due_every_interval_and_the_step_ends_on_a_pass():
    plan = go(running(), now=10)
    assert not plan.analyze and plan.look_again == 10  # the next evaluation at 20 s
    assert go(running(), now=20).analyze
    plan = go(running(), now=60, outcome=PASS)
    assert plan.state["step"] == 1 and plan.state["targetWeight"] == 50 and reasons(plan) == ["RolloutStep"]
    assert "stepStartedAt" not in plan.state  # the next step's clock waits for its pods


def test_after_the_last_step_it_promotes_then_the_canary_goes():
    last = running(step=1, targetWeight=50, weight=50)
    plan = go(last, now=60, outcome=PASS)
    assert plan.promote and plan.state["phase"] == canary.PROMOTING and reasons(plan) == ["Promoting"]
    plan = go(plan.state, now=61)
    assert plan.promote and plan.canary_key == KEY  # the canary serves until stable has moved
    plan = go(plan.state, now=70, stable_done=True)
    assert (plan.canary_key, plan.state, reasons(plan)) == (None, None, ["Promoted"])


@pytest.mark.parametrize("outcome, result", [(NODATA, an.INCONCLUSIVE), (DOWN, an.ERROR)])
def test_no_data_or_no_prometheus_pauses_and_never_promotes(outcome, result):
    plan = go(running(), now=60, outcome=outcome)
    assert plan.state["phase"] == canary.PAUSED and plan.state["step"] == 0 and not plan.promote
    assert plan.state["lastAnalysis"]["result"] == result and reasons(plan) == ["RolloutPaused"]
    plan = go(plan.state, now=80, outcome=PASS)  # data again: the step ends
    assert plan.state["step"] == 1 and plan.state["phase"] == canary.PROGRESSING


def test_a_pass_from_before_the_step_does_not_end_it():
    s = running(now=0)
    s["stepStartedAt"] = sig.format_time(at(5))  # the last evaluation (at 0) predates the step
    plan = go(s, now=65)
    assert plan.analyze
    plan = go(s, now=65, outcome=NODATA)
    assert plan.state["phase"] == canary.PAUSED


def test_failures_within_the_limit_warn_then_one_more_rolls_back():
    plan = go(running(), now=20, outcome=FAIL)
    assert plan.state["analysisFailures"] == 1 and reasons(plan) == ["AnalysisFailed"]
    plan = go(plan.state, now=40, outcome=FAIL)
    assert (plan.canary_key, plan.state, reasons(plan)) == (None, None, ["RolledBack"])
    assert plan.rollback["engineKey"] == KEY and "error-ratio = 0.4" in plan.rollback["reason"]
    warning = plan.events[0]
    assert warning[0] == "Warning" and "max 0.05" in warning[2] and "from q" in warning[2]


def test_a_rolled_back_key_is_not_retried_until_the_spec_changes():
    rollback = {"engineKey": KEY, "version": "2", "time": sig.format_time(at(0)), "reason": "x"}
    plan = go(None, rollback=rollback)
    assert (plan.canary_key, plan.state, plan.rollback) == (None, None, rollback)
    plan = go(None, desired_key="thirdkey", rollback=rollback)
    assert plan.canary_key == "thirdkey" and plan.rollback is None


def test_by_hand_promote_and_abort():
    plan = go(running(), now=1, action=canary.PROMOTE)
    assert plan.promote and reasons(plan) == ["Promoting"]
    plan = go(running(), now=1, action=canary.ABORT)
    assert plan.canary_key is None and "by hand" in plan.rollback["reason"]


def test_a_canary_whose_pods_fail_their_warm_up_samples_is_rolled_back_before_any_traffic():
    waiting = go(None, canary_ready=0).state  # started: its pods are not Ready, no weight yet
    assert waiting["weight"] == 0
    why = 'sample 1 (of 1, spec.runtime.warmup.samples[0]): output "species" differs from the expected'
    plan = go(waiting, now=3, canary_ready=0, canary_failed=why)
    assert (plan.canary_key, plan.state, reasons(plan)) == (None, None, ["WarmupFailed", "RolledBack"])
    assert plan.rollback["reason"] == f"its pods failed their warm-up samples: {why}"
    assert why in plan.events[0][2] and plan.events[0][0] == "Warning"
    assert go(None, rollback=plan.rollback, canary_failed=why).canary_key is None  # not retried


def test_a_newer_key_supersedes_the_running_rollout():
    old = running(engineKey=OLD)
    plan = go(old, engines_ready=False)
    assert (plan.canary_key, plan.state, reasons(plan)) == (None, None, ["RolloutSuperseded"])
    plan = go(old, engines_ready=True)
    assert plan.canary_key == KEY and reasons(plan) == ["RolloutSuperseded", "RolloutStarted"]


@pytest.mark.parametrize("total, weight, minimum, want", [
    (4, 10, 1, 1), (4, 50, 1, 2), (4, 100, 1, 4), (10, 25, 1, 3), (2, 10, 3, 3), (1, 50, 1, 1)])
def test_canary_replicas_follow_the_weight(total, weight, minimum, want):
    assert canary.canary_replicas(total, weight, minimum) == want


# -- the verdicts --------------------------------------------------------------------------

@pytest.mark.parametrize("values, result", [
    ([0.01, 1.2], an.PASSED),
    ([0.2, 1.2], an.FAILED),
    ([None, 1.2], an.INCONCLUSIVE),
    ([float("nan"), 1.2], an.INCONCLUSIVE),
    ([0.2, None], an.FAILED),  # a failure is a failure even where another check has no data
    ([RuntimeError("down"), 0.2], an.ERROR),
])
def test_combine(values, result):
    checks = [an.Check("error-ratio", "q1", max=0.05), an.Check("latency", "q2", min=1.0, max=2.0)]
    assert an.combine(checks, values).result == result


def test_builtin_and_user_checks_are_built_from_the_spec():
    spec = {"maxErrorRatio": 0.05, "maxRefusedRatioIncrease": 0.05, "maxLatencyRatio": 1.5,
            "metrics": [{"name": "gpu", "query": 'x{model="{{model}}",ns="{{namespace}}",v="{{version}}"}', "max": 1}]}
    names = [c.name for c in an.builtin_checks(spec, "ns", "m", "k2", "k1")]
    assert names == ["error-ratio", "refused-ratio-increase", "latency-p99-ratio"]
    [user] = an.user_checks(spec, "ns", "m", "2", "k2")
    assert user.query == 'x{model="m",ns="ns",v="2"}' and user.max == 1
    assert an.builtin_checks({"maxErrorRatio": None, "maxRefusedRatioIncrease": None, "maxLatencyRatio": None},
                             "ns", "m", "k2", "k1") == []


def test_a_shadow_step_comes_first_at_weight_zero_then_the_weighted_steps():
    spec = {"steps": [{"weight": 10, "pauseSeconds": 60}], "canaryMinReplicas": 1,
            "analysis": {"intervalSeconds": 20, "failureLimit": 1},
            "shadow": {"enabled": True, "pauseSeconds": 30}}
    policy = canary.Policy.from_spec(spec)
    assert policy.steps == ((0, 30.0), (10, 60.0)) and policy.shadow
    assert canary.Policy.from_spec({**spec, "shadow": {"enabled": False, "pauseSeconds": 30}}).steps == ((10, 60.0),)
    plan = canary.advance(policy, desired_key=KEY, version="2", engines_ready=True, state=None, rollback=None,
                          canary_ready=1, canary_target=1, stable_done=False, outcome=None, action=None, now=at(0))
    assert plan.state["targetWeight"] == 0 and "shadow step" in plan.events[0][2], plan.events
    assert policy.in_shadow_step(plan.state)
    # The shadow step passes like any other: on to the first weighted step, out of the shadow.
    plan = canary.advance(policy, desired_key=KEY, version="2", engines_ready=True, state=running(0, targetWeight=0, weight=0),
                          rollback=None, canary_ready=1, canary_target=1, stable_done=False, outcome=None, action=None,
                          now=at(31))
    assert plan.analyze
    plan = canary.advance(policy, desired_key=KEY, version="2", engines_ready=True, state=plan.state, rollback=None,
                          canary_ready=1, canary_target=1, stable_done=False, outcome=PASS, action=None, now=at(31))
    assert (plan.state["step"], plan.state["targetWeight"]) == (1, 10) and not policy.in_shadow_step(plan.state)


def test_a_failed_agreement_rolls_back_with_the_worst_output_in_the_reason():
    worst = an.Outcome(an.FAILED, ({"name": "agreement", "query": "q" * 900, "value": 0.3, "min": 0.99, "max": None,
                                    "result": an.FAILED, "detail": "output species: max absolute difference <= 1"},),
                       "failed: agreement")
    plan = go(running(analysisFailures=1), now=20, outcome=worst)
    assert plan.rollback is not None
    assert "agreement = 0.3 (min 0.99, max None), output species: max absolute difference <= 1" in plan.rollback["reason"]


def test_the_agreement_check_is_built_from_the_spec():
    check = an.agreement_check({"agreement": {"minRatio": 0.95, "minSamples": 7}}, "ns", "m", "k2")
    assert (check.name, check.min, check.max) == ("agreement", 0.95, None)
    assert 'canary="k2"' in check.query and ">= 7" in check.query and check.detail
    assert an.agreement_check({"agreement": None}, "ns", "m", "k2") is None
