"""The alert receiver's doors (issue 19): what a holder of its token can write, and that no
client's input is a 5xx or a traceback. conftest's `receiver`: the real receiver on loopback
(no kopf), its Kube against the emulated API server, watching the namespaces `watched*`.
The Hypothesis side is test_alerts_fuzz.py."""

from __future__ import annotations

import datetime
import http.client
import json
import logging

import pytest

from kiln.operator import alerts, kube, signals as sig
from kiln.operator.kube import path_for
from kiln.operator.metrics import OperatorMetrics
from kiln.runtime.contract import API_VERSION, KIND

NS, OTHER = "watched", "other"  # OTHER is not watched
# The objects a confused deputy reached before issue 19 (kind, namespace, name); `target` is
# the one model the alerts below may write to.
TARGET = (KIND, NS, "target")
VICTIMS = [(KIND, OTHER, "victim"), ("ConfigMap", OTHER, "cm"), (KIND, NS, "busy")]
# Labels that are no names, each with the object its unquoted path reached.
MODEL_ATTACKS = ["../../other/inferencemodels/victim", "../../../../../../api/v1/namespaces/other/configmaps/cm",
                 "busy?dryRun=All", "busy/status"]
NAMESPACE_ATTACKS = [("watched/../other", "victim")]  # passes the glob, reached other/victim


def obj(kind: str, ns: str, name: str) -> dict:
    api_version = API_VERSION if kind == KIND else "v1"
    return {"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": ns}, "spec": {}}


@pytest.fixture(scope="module")
def objects(api):
    for kind, ns, name in [TARGET, *VICTIMS]:
        api.apply(obj(kind, ns, name))


def signals_on(api, kind: str, ns: str, name: str) -> str | None:
    return (api.get(kind, ns, name)["metadata"].get("annotations") or {}).get(sig.ANN_SIGNALS)


def counted(receiver, result: str) -> float:
    return receiver.receiver.metrics.registry.get_sample_value("kiln_alerts_received_total", {"result": result}) or 0


def tracebacks(caplog) -> list[str]:
    """Log lines a client's input must never cause: errors and tracebacks."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def raw_post(receiver, body: bytes, headers: dict[str, bytes | str]) -> tuple[int, dict]:
    """POST /alerts with header values sent byte for byte (http.client writes bytes as they are)."""
    conn = http.client.HTTPConnection("127.0.0.1", receiver.port, timeout=10)
    try:
        conn.putrequest("POST", "/alerts", skip_accept_encoding=True)
        for name, value in {"Content-Type": "application/json", **headers, "Content-Length": str(len(body))}.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, {"not JSON": data[:200].decode(errors="replace")}


# -- item 1: only the named InferenceModel, only in a watched namespace ----------------------

def test_labels_that_are_no_names_are_invalid_and_write_nothing(api, receiver, objects, am, caplog):
    attacks = [am.alert(NS, model, sig.HIGH, fingerprint=f"m{i}") for i, model in enumerate(MODEL_ATTACKS)]
    attacks += [am.alert(ns, model, sig.HIGH, fingerprint=f"n{i}") for i, (ns, model) in enumerate(NAMESPACE_ATTACKS)]
    before = counted(receiver, "invalid")
    answer = am.post(receiver, am.webhook(*attacks, am.alert(*TARGET[1:], sig.HIGH)))
    written = [victim for victim in VICTIMS if signals_on(api, *victim) is not None]
    assert written == [], f"a label that is no name wrote the signals onto {written}"
    # The rest of the payload still applies (a 400 would make Alertmanager drop all of it).
    assert answer == (200, {"invalid": len(attacks), "accepted": 1})
    assert sig.HIGH in signals_on(api, *TARGET)
    assert counted(receiver, "invalid") - before == len(attacks)
    assert tracebacks(caplog) == []


async def test_nothing_is_written_to_an_object_that_is_not_the_named_model(api, cluster, objects, am, caplog):
    class Misrouting(kube.Kube):
        """A proxy or API server that answers another object at the model's path."""

        async def request(self, method, path, *args, **kwargs):
            wrong = path.replace(path_for(*TARGET), path_for("ConfigMap", OTHER, "cm"))
            return await super().request(method, wrong, *args, **kwargs)

    receiver = alerts.Receiver(Misrouting(kube.load_client(str(cluster.kubeconfig))), "t", OperatorMetrics(),
                               lambda: datetime.datetime.now(datetime.timezone.utc))
    tally = await receiver.record("g", [am.alert(*TARGET[1:], sig.LOW, fingerprint="misrouted")])
    assert signals_on(api, "ConfigMap", OTHER, "cm") is None
    assert tally == {"unknown_model": 1}
    assert [r.levelname for r in caplog.records if "is not the InferenceModel" in r.getMessage()] == ["WARNING"]


# -- item 2: a client's mistake is a 4xx, never a 500 -----------------------------------------

