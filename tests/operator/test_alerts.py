"""The alert receiver's doors (issue 19): what a holder of its token can write, and that no
client's input is a 5xx or a traceback. conftest's `receiver`: the real receiver on loopback
(no kopf), its Kube against the emulated API server, watching the namespaces `watched*`.
The Hypothesis side is test_alerts_fuzz.py."""

from __future__ import annotations

import datetime
import json
import logging

import pytest

from kiln.operator import alerts, kube, signals as sig
from kiln.operator.kube import path_for
from kiln.operator.metrics import OperatorMetrics
from kiln.runtime.api.contract import API_VERSION, KIND

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


def raw_post(receiver, am, body: bytes, headers: dict[str, bytes | str]) -> tuple[int, dict]:
    """POST /alerts with header values sent byte for byte."""
    lines = {"Host": "kiln", "Content-Type": "application/json", **headers, "Content-Length": str(len(body))}
    head = b"".join(k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()) + b"\r\n" for k, v in lines.items())
    return am.send(receiver, b"POST /alerts HTTP/1.1\r\n" + head + b"\r\n" + body)


# -- item 1: only the named InferenceModel, only in a watched namespace ----------------------

@pytest.mark.parametrize("alertname", [sig.HIGH, sig.REFUSED])  # a scaling signal, and the health one
def test_labels_that_are_no_names_are_invalid_and_write_nothing(api, receiver, objects, am, caplog, alertname):
    attacks = [am.alert(NS, model, alertname, fingerprint=f"m{i}") for i, model in enumerate(MODEL_ATTACKS)]
    attacks += [am.alert(ns, model, alertname, fingerprint=f"n{i}") for i, (ns, model) in enumerate(NAMESPACE_ATTACKS)]
    before = counted(receiver, "invalid")
    answer = am.post(receiver, am.webhook(*attacks, am.alert(*TARGET[1:], alertname)))
    written = [victim for victim in VICTIMS if signals_on(api, *victim) is not None]
    assert written == [], f"a label that is no name wrote the signals onto {written}"
    # The rest of the payload still applies (a 400 would make Alertmanager drop all of it).
    assert answer == (200, {"invalid": len(attacks), "accepted": 1})
    assert alertname in signals_on(api, *TARGET)
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

def test_an_authorization_that_is_not_ascii_is_a_401(receiver, am, caplog):
    body = json.dumps(am.webhook(am.alert(*TARGET[1:], sig.HIGH))).encode()
    for value in (b"Bearer \xe9\xe9", b"Bearer \xff\xfe", "Bearer tést".encode(), b"\x80", b"Bearer \xed\xa0\x80"):
        status, doc = raw_post(receiver, am, body, {"Authorization": value})
        assert (status, doc) == (401, {"error": "a valid bearer token is required"}), value
    assert tracebacks(caplog) == []


def test_json_nested_too_deeply_is_a_400(receiver, am, caplog):
    deep = 100_000
    for body in ('{"a":' * deep + "0" + "}" * deep, "[" * deep + "]" * deep,
                 '{"version": "4", "alerts": ' + "[" * deep + "]" * deep + "}"):
        status, doc = raw_post(receiver, am, body.encode(), {"Authorization": "Bearer test-token"})
        assert status == 400 and "nested too deeply" in doc["error"], (status, doc)
    assert tracebacks(caplog) == []


def test_what_json_does_not_allow_is_a_400(receiver, am, caplog):
    good = json.dumps(am.webhook(am.alert(*TARGET[1:], sig.HIGH)))
    field = '"truncatedAlerts": 0'
    for literal, why in (("NaN", "NaN"), ("-Infinity", "Infinity"), ("9" * 5000, "digits"), ('"\xff"', "utf-8")):
        body = good.replace(field, f'"truncatedAlerts": {literal}').encode("latin-1")
        status, doc = raw_post(receiver, am, body, {"Authorization": "Bearer test-token"})
        assert status == 400 and "not JSON" in doc["error"] and why in doc["error"], (status, doc)
    assert tracebacks(caplog) == []


def test_alerts_over_the_bound_are_a_400(receiver, am):
    many = am.webhook(*[am.alert(NS, f"m{i}", sig.HIGH) for i in range(alerts.MAX_ALERTS + 1)])
    code, doc = am.post(receiver, many)
    assert code == 400 and f"at most {alerts.MAX_ALERTS}" in doc["error"]


def test_a_start_time_that_cannot_be_written_back_is_a_400(api, receiver, am, caplog):
    api.apply(obj(KIND, NS, "epoch"))  # no record yet: the alert would be written
    for starts in ("0001-01-01T00:00:00+01:00", "0001-01-01T00:30:00+23:59"):
        doc = am.webhook({**am.alert(NS, "epoch", sig.HIGH), "startsAt": starts})
        code, answer = am.post(receiver, doc)
        assert code == 400 and "alerts[0].startsAt" in answer["error"], (code, answer)
    assert signals_on(api, KIND, NS, "epoch") is None
    assert tracebacks(caplog) == []


def test_a_request_that_cannot_be_read_is_a_400(receiver, am, caplog):
    """What aiohttp's parser refuses, and a body it cannot decode: a JSON 400, no traceback."""
    head = b"POST /alerts HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer test-token\r\n"
    for rest in (b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"a":\r\nzz\r\n',  # a chunk size that is none
                 b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\nabcde",
                 b"Content-Encoding: gzip\r\nContent-Length: 5\r\n\r\nabcde"):  # gzip that is not
        status, doc = am.send(receiver, head + rest)
        assert status == 400 and isinstance(doc.get("error"), str), (rest, status, doc)
    assert tracebacks(caplog) == []


def test_an_expect_other_than_100_continue_is_a_417(receiver, am, caplog):
    """aiohttp's own refusal quoted the header into a body it could not encode: a 500."""
    body = json.dumps(am.webhook(am.alert(*TARGET[1:], sig.MISSING, fingerprint="expect"))).encode()
    for expect, answer in ((b"\x80", 417), (b"nothing", 417), (b"100-continue", 200)):
        status, doc = raw_post(receiver, am, body, {"Authorization": "Bearer test-token", "Expect": expect})
        assert status == answer and ("error" in doc if status == 417 else doc == {"accepted": 1}), (expect, doc)
    assert tracebacks(caplog) == []


def test_a_refused_share_that_is_no_number_is_recorded_without_it(api, receiver, am, caplog):
    """KilnRequestsRefused's value is a share the serving step repeats in status: NaN or
    Infinity is no value (recorded as none), and a firing alert is still recorded."""
    api.apply(obj(KIND, NS, "refusing"))
    for i, value in enumerate(("NaN", "+Inf", "-Inf", "0.9; rm -rf /", "")):
        alert = am.alert(NS, "refusing", sig.REFUSED, value=value, ago=100 - i, fingerprint=f"v{i}")
        assert am.post(receiver, am.webhook(alert)) == (200, {"accepted": 1}), value
        assert sig.parse({sig.ANN_SIGNALS: signals_on(api, KIND, NS, "refusing")})[sig.REFUSED].value is None, value
    assert tracebacks(caplog) == []
