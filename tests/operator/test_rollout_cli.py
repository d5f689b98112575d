"""`kiln rollout` against the emulated API server, through `kiln`'s own entry point.

No operator runs: each test writes the status a rollout would have (through the status
subresource, as the operator does) and, where the story needs it, plays the operator
taking the annotation. What is asserted is what the user sees: the printed report, the
exit code, the annotation on the InferenceModel.
"""

from __future__ import annotations

import datetime
import re
import threading

import pytest

from kiln.cli import main
from kiln.operator import rollout_cli

ANN = rollout_cli.ANN_ACTION
NOW = datetime.datetime(2026, 1, 1, 0, 10, 0, tzinfo=datetime.timezone.utc)


def stamp(seconds_ago: float, now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return (now - datetime.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def model(ns: str, name: str) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel", "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"uri": f"https://models.example.com/{name}.onnx", "version": "2"},
                     "engine": {"backend": "tensorrt", "precision": "fp16", "targets": ["H100"]},
                     "runtime": {"replicas": 4},
                     "rollout": {"strategy": "Canary",
                                 "steps": [{"weight": 10, "pauseSeconds": 60}, {"weight": 50, "pauseSeconds": 120},
                                           {"weight": 100, "pauseSeconds": 0}],
                                 "analysis": {"failureLimit": 2, "metrics": [
                                     {"name": "tokens-per-second", "query": "sum(rate(kiln_tokens_total[1m]))",
                                      "min": 100}]}}}}


def rolling_status(now: datetime.datetime | None = None) -> dict:
    """The status the operator writes in the middle of a rollout: step 2 of 3, weight moving 10 -> 50."""
    return {"phase": "Progressing", "engineKey": "stablekey0001",
            "stable": {"version": "1", "engineKey": "stablekey0001", "weight": 90, "replicas": 3, "readyReplicas": 3},
            "canary": {"version": "2", "engineKey": "canarykey0002", "phase": "Progressing", "step": 1,
                       "targetWeight": 50, "weight": 10, "startedAt": stamp(300, now),
                       "stepStartedAt": stamp(65, now), "analysisFailures": 1,
                       "lastAnalysis": {"time": stamp(20, now), "result": "Failed",
                                        "message": "error-ratio above its max",
                                        "checks": [
                                            {"name": "error-ratio", "query": "kiln:error_ratio{version=\"2\"}",
                                             "value": 0.0731, "max": 0.05, "result": "Failed"},
                                            {"name": "p99-latency", "query": "kiln:p99_seconds{version=\"2\"}",
                                             "value": 0.21, "max": 0.5, "result": "Passed"},
                                            {"name": "tokens-per-second", "query": "sum(rate(kiln_tokens_total[1m]))",
                                             "value": None, "min": 100, "result": "Inconclusive"}]}}}


def rolled_back_status() -> dict:
    return {"phase": "Ready", "engineKey": "stablekey0001",
            "stable": {"version": "1", "engineKey": "stablekey0001", "weight": 100, "replicas": 4, "readyReplicas": 4},
            "rollback": {"version": "2", "engineKey": "canarykey0002", "time": stamp(30), "step": 0,
                         "reason": "error-ratio 0.0731 > max 0.05 (failure 2 of 2 tolerated)"}}


@pytest.fixture
def kiln(cluster):
    def run(*argv: str) -> int:
        return main(["rollout", *argv, "--kubeconfig", str(cluster.kubeconfig)])
    return run


def create(api, ns: str, name: str, status: dict | None) -> dict:
    api.apply(model(ns, name))
    if status is not None:
        api.patch("InferenceModel", ns, name, {"status": status}, subresource="status")
    return api.get("InferenceModel", ns, name)


def annotations(api, ns: str, name: str) -> dict:
    return api.get("InferenceModel", ns, name)["metadata"].get("annotations") or {}


# ------------------------------------------------------------------------------ status

def test_status_shows_step_weights_time_failures_and_every_check(api, kiln, capsys):
    create(api, "cli-status", "llm", rolling_status())
    assert kiln("status", "llm", "-n", "cli-status") == 0
    out = capsys.readouterr().out
    assert "InferenceModel cli-status/llm: Progressing" in out
    assert "Stable:   version 1  key stablekey0001  weight 90%, 3/3 ready" in out
    assert "Canary:   version 2  key canarykey0002  Progressing" in out
    assert "step:     2/3, weight 10% in effect, target 50%" in out
    assert re.search(r"in step:  1m0\ds \(since ", out), out
    assert "failures: 1 (tolerated: 2; one more rolls back)" in out
    assert "last analysis: Failed, 2" in out and "error-ratio above its max" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("    ") and ":" not in line}
    assert rows["CHECK"] == ["RESULT", "VALUE", "MIN", "MAX"]
    assert rows["error-ratio"] == ["Failed", "0.0731", "-", "0.05"]
    assert rows["p99-latency"] == ["Passed", "0.21", "-", "0.5"]
    assert rows["tokens-per-second"] == ["Inconclusive", "no", "data", "100", "-"]
    assert 'error-ratio: kiln:error_ratio{version="2"}' in out


def test_status_after_a_rollback_names_the_failed_version_and_why(api, kiln, capsys):
    create(api, "cli-rolledback", "llm", rolled_back_status())
    assert kiln("status", "llm", "-n", "cli-rolledback") == 0
    out = capsys.readouterr().out
    assert "Canary:   none (no rollout running)" in out
    assert re.search(r"Last rollback: version 2  key canarykey0002 at step 1/3, 3\ds ago", out), out
    assert "reason:   error-ratio 0.0731 > max 0.05" in out


def test_status_of_an_unknown_model_exits_1(api, kiln, capsys):
    assert kiln("status", "nope", "-n", "cli-status") == 1
    assert "InferenceModel cli-status/nope not found" in capsys.readouterr().err


def test_the_report_is_a_function_of_the_object_and_the_clock():
    obj = {**model("ns", "llm"), "status": rolling_status(NOW)}
    text = rollout_cli.describe(obj, NOW)
    assert "in step:  1m05s (since 2026-01-01T00:08:55Z)" in text
    assert "started:  5m00s (since 2026-01-01T00:05:00Z)" in text
    assert "last analysis: Failed, 20s ago (2026-01-01T00:09:40Z)" in text
    later = rollout_cli.describe(obj, NOW + datetime.timedelta(hours=2))
    assert "in step:  2h01m" in later


# ------------------------------------------------------------------------------ promote, abort

def test_promote_sets_the_annotation_and_says_what_will_happen(api, kiln, capsys):
    create(api, "cli-promote", "llm", rolling_status())
    assert kiln("promote", "llm", "-n", "cli-promote") == 0
    out = capsys.readouterr().out
    assert annotations(api, "cli-promote", "llm")[ANN] == "promote"
    assert f"cli-promote/llm: promote requested ({ANN}=promote)" in out
    assert "the canary version 2 (key canarykey0002) becomes stable" in out
    # The pending request shows in the status until the operator takes it.
    assert kiln("status", "llm", "-n", "cli-promote") == 0
    assert "Pending:  promote" in capsys.readouterr().out


def test_abort_replaces_a_pending_promote(api, kiln, capsys):
    create(api, "cli-replace", "llm", rolling_status())
    assert kiln("promote", "llm", "-n", "cli-replace") == 0
    assert kiln("abort", "llm", "-n", "cli-replace") == 0
    out = capsys.readouterr().out
    assert annotations(api, "cli-replace", "llm")[ANN] == "abort"
    assert "abort requested (replaces the pending 'promote')" in out
    assert "all traffic returns to the stable version 1 (key stablekey0001)" in out


def test_abort_without_a_rollout_exits_2_and_changes_nothing(api, kiln, capsys):
    before = create(api, "cli-norollout", "llm", rolled_back_status())
    assert kiln("abort", "llm", "-n", "cli-norollout") == 2
    assert kiln("promote", "llm", "-n", "cli-norollout", "--wait", "5") == 2
    err = capsys.readouterr().err
    assert "no rollout is running for cli-norollout/llm (status.canary is absent): nothing to abort" in err
    after = api.get("InferenceModel", "cli-norollout", "llm")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert ANN not in (after["metadata"].get("annotations") or {})


def test_promote_of_an_unknown_model_exits_1(api, kiln, capsys):
    assert kiln("promote", "nope", "-n", "cli-promote") == 1
    assert "InferenceModel cli-promote/nope not found" in capsys.readouterr().err


def test_wait_prints_the_status_the_operator_left(api, kiln, capsys):
    ns, name = "cli-wait", "llm"
    create(api, ns, name, rolling_status())
    taken = threading.Event()

    def play_the_operator() -> None:  # take the annotation, promote, write status
        api.wait(lambda: annotations(api, ns, name).get(ANN) == "promote", 10, "the request")
        promoted = {"phase": "Ready", "engineKey": "canarykey0002", "canary": None,
                    "stable": {"version": "2", "engineKey": "canarykey0002", "weight": 100, "replicas": 4,
                               "readyReplicas": 4}}
        api.patch("InferenceModel", ns, name, {"status": promoted}, subresource="status")
        api.patch("InferenceModel", ns, name, {"metadata": {"annotations": {ANN: None}}})
        taken.set()

    operator = threading.Thread(target=play_the_operator, daemon=True)
    operator.start()
    assert kiln("promote", name, "-n", ns, "--wait", "10") == 0
    operator.join(10)
    assert taken.is_set()
    out = capsys.readouterr().out
    assert "The operator took the request. Now:" in out
    assert "Stable:   version 2  key canarykey0002  weight 100%, 4/4 ready" in out
    assert "Canary:   none (no rollout running)" in out


def test_wait_is_bounded_and_leaves_the_request_in_place(api, kiln, capsys):
    create(api, "cli-timeout", "llm", rolling_status())
    assert kiln("abort", "llm", "-n", "cli-timeout", "--wait", "0.3") == 1
    err = capsys.readouterr().err
    assert "the operator did not take the request within 0.3s" in err
    assert annotations(api, "cli-timeout", "llm")[ANN] == "abort"


def test_promote_while_promoting_writes_nothing(api, kiln, capsys):
    status = rolling_status()
    status["canary"]["phase"] = "Promoting"
    before = create(api, "cli-promoting", "llm", status)
    assert kiln("promote", "llm", "-n", "cli-promoting") == 0
    assert "already being promoted" in capsys.readouterr().out
    after = api.get("InferenceModel", "cli-promoting", "llm")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
