"""Property-based tests (Hypothesis) of the alert receiver's door (issue 19, item 7), as
tests/runtime/test_fuzz.py does for the runtime's: conftest's `receiver` (the real receiver
on loopback, its Kube against the emulated API server, namespaces `watched*`), driven over
raw sockets.

Strategies: webhook payloads whose labels are names, the confused-deputy paths of issue 19,
any text or other JSON types, with statuses, times, fingerprints and annotations of any kind,
their top level mutated; JSON no reader should take (deep, NaN, huge integers, bytes that
are no UTF-8); Authorization headers of any bytes; arbitrary header lines. For every
example: no 5xx; a 4xx has the body {"error": "<string>"}; the API server saw no write but
merge patches of InferenceModels that an alert of the payload names, in a watched
namespace. After each test: no error or traceback in the log, and a valid alert still
applies. The profiles: tests/support/fuzzing.py.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.operator import alerts, signals as sig
from kiln.runtime.api.contract import API_VERSION, GROUP, KIND, PLURAL

from support.fuzzing import deep_literals, dump, fuzz_settings, huge_literals, non_finite

pytestmark = pytest.mark.timeout(300)

# What exists in the emulator: models in watched namespaces, and what a confused deputy
# reached before issue 19 (a model in an unwatched namespace, a ConfigMap).
MODELS = [("watched", "target"), ("watched", "busy"), ("watched-b", "m"), ("other", "victim")]
DEPUTIES = ["../../other/inferencemodels/victim", "../../../../../../api/v1/namespaces/other/configmaps/cm",
            "busy?dryRun=All", "busy/status"]  # model labels that reached another object (issue 19)
ATTACKS = ["busy#x", "..", ".", "%2e%2e", "busy%2Fstatus", "Busy", "busy.", "watched/../other", "a" * 254, "b" * 64,
           "busy\n", " busy", "büsy"]
TOKEN = b"Bearer test-token"  # conftest's receiver's


@pytest.fixture(scope="module")
def door(api, receiver):
    for ns, name in MODELS:
        api.apply({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": ns}, "spec": {}})
    api.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "namespace": "other"}})
    return receiver


def writes_since(cluster, start: int) -> list:
    return [r for r in list(cluster.emu)[start:] if r.method in ("POST", "PUT", "PATCH", "DELETE")]


def stray_writes(door, cluster, start: int, payload) -> list[str]:
    """Writes the API server saw since `start` that no alert of `payload` asked for: only a
    merge patch of an InferenceModel that one of them names, in a watched namespace."""
    named = set()
    alerts_ = payload.get("alerts") if isinstance(payload, dict) else None
    for alert in alerts_ if isinstance(alerts_, list) else []:
        labels = alert.get("labels") if isinstance(alert, dict) else None
        ns, model = (labels.get("namespace"), labels.get("model")) if isinstance(labels, dict) else (None, None)
        if isinstance(ns, str) and isinstance(model, str) and fnmatch.fnmatchcase(ns, door.watched):
            named.add((ns, model))
    return [f"{r.method.value} {r.url.path_qs}" for r in writes_since(cluster, start)
            if not (r.method == "PATCH" and r.resource is not None and (r.resource.group, r.resource.plural)
                    == (GROUP, PLURAL) and r.subresource is None and not r.params and (r.namespace, r.name) in named)]


def judge(status: int, doc: dict, what: str) -> None:
    assert status < 500, f"a {status} for {what}: {doc}"
    if status >= 400:
        assert isinstance(doc.get("error"), str), f"a {status} without a string 'error' for {what}: {doc}"


def problems(caplog) -> list[str]:
    return [f"{r.name} {r.levelname}: {r.getMessage()[:200]}" for r in caplog.records
            if r.levelno >= logging.ERROR or r.exc_info]


def request(body: bytes, auth: bytes | None = TOKEN, head: bytes = b"") -> bytes:
    lines = b"Host: kiln\r\nContent-Type: application/json\r\n" + head
    if auth is not None:
        lines += b"Authorization: " + auth + b"\r\n"
    return b"POST /alerts HTTP/1.1\r\n" + lines + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def still_applies(door, am) -> None:
    """A valid alert after the hostile ones: accepted (a new episode: it starts now)."""
    status, doc = am.post(door, am.webhook(am.alert("watched", "target", sig.HIGH)))
    assert (status, doc) == (200, {"accepted": 1})


# -- payloads ---------------------------------------------------------------------------

def now_ago(seconds: int) -> str:
    at = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=seconds)
    return at.isoformat().replace("+00:00", "Z")


scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
           | huge_literals | non_finite)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                           max_leaves=6)
texts = st.text(max_size=24) | st.text(st.characters(codec="latin-1"), max_size=8)
# Each a quarter of the time or more: a watched namespace, a path that reached another object.
namespaces = st.one_of(st.sampled_from(["watched", "watched-b"]), st.sampled_from(["other", "watched-c", "Watched", ""]),
                       st.sampled_from(ATTACKS), st.from_regex(r"watched-[a-z0-9]{1,8}", fullmatch=True), texts)
models = st.one_of(st.sampled_from(["target", "busy", "m", "victim", "cm", "nosuch"]), st.sampled_from(DEPUTIES),
                   st.sampled_from(ATTACKS), st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,20}[a-z0-9])?", fullmatch=True),
                   texts)
odd_times = st.sampled_from([
    "0001-01-01T00:00:00Z", "0001-01-01T00:00:00+01:00", "0001-01-01T00:30:00+23:59",
    "9999-12-31T23:59:59-01:00", "9999-12-31T23:59:59.999999Z", "2024-02-30T00:00:00Z",
    "2024-01-01T00:00:00", "2024-01-01", "2024-01-01T00:00:00+25:00", "2024-01-01T00:00:00ZZ",
    "2024-01-01T00:00:00.123456789Z", "yesterday", ""]) | texts | json_values
values = st.sampled_from(["0.9", "0.05", "NaN", "inf", "-inf", "1e400", "-0", "", "1_0", "٣"]) | texts
long_label = st.just("x" * alerts.MAX_LABEL_BYTES)
# An alert's fields, and what may stand in for each.
ALERT_FIELDS = {("status",): json_values | texts, ("startsAt",): odd_times, ("fingerprint",): json_values,
                ("annotations",): json_values, ("annotations", "value"): json_values | long_label,
                ("labels",): json_values, ("labels", "alertname"): texts | json_values,
                ("labels", "namespace"): json_values | long_label, ("labels", "model"): json_values | long_label,
                ("labels", "extra"): texts | long_label, ("endsAt",): odd_times}
PAYLOAD_FIELDS = {"version": json_values, "groupKey": json_values | st.just(""), "alerts": json_values,
                  "truncatedAlerts": json_values, "commonLabels": json_values}


def mutate(doc: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        if not isinstance(doc.get(key), dict):
            return  # an earlier mutation replaced the way
        doc = doc[key]
    doc[path[-1]] = value


@st.composite
def alert_docs(draw):
    """An alert Alertmanager could send, naming anything; at times a field or two anything."""
    doc = {"status": draw(st.sampled_from([sig.FIRING, sig.RESOLVED])),
           "labels": {"alertname": draw(st.sampled_from(sig.ALERTS)), "namespace": draw(namespaces),
                      "model": draw(models), "kiln_autoscaling": "true"},
           "annotations": {"value": draw(values)}, "startsAt": now_ago(draw(st.integers(-100, 10_000))),
           "endsAt": "0001-01-01T00:00:00Z", "fingerprint": draw(st.text(max_size=16))}
    for path in draw(st.lists(st.sampled_from(sorted(ALERT_FIELDS)), max_size=2)):
        mutate(doc, path, draw(ALERT_FIELDS[path]))
    return doc


@st.composite
def payloads(draw):
    doc = {"version": "4", "groupKey": draw(st.text(min_size=1, max_size=16)), "truncatedAlerts": 0,
           "status": "firing", "receiver": "kiln", "alerts": draw(st.lists(alert_docs(), max_size=5))}
    for key in draw(st.lists(st.sampled_from(sorted(PAYLOAD_FIELDS)), max_size=1)):
        doc[key] = draw(PAYLOAD_FIELDS[key])
    return doc


def test_arbitrary_payloads(door, cluster, am, caplog):
    @fuzz_settings(500)
    @given(payloads() | json_values | deep_literals)
    def prop(payload):
        start = len(list(cluster.emu))
        body = dump(payload).encode()
        status, doc = am.send(door, request(body))
        judge(status, doc, f"the body {body[:300]!r}")
        assert stray_writes(door, cluster, start, payload) == [], f"for the body {body[:300]!r}"
    prop()
    assert problems(caplog) == []
    still_applies(door, am)


@st.composite
def byte_bodies(draw):
    valid = bytearray(dump(draw(payloads())).encode())
    kind = draw(st.sampled_from(["random", "flipped", "cut", "utf16"]))
    if kind == "random":
        return draw(st.binary(max_size=512))
    if kind == "flipped":
        for _ in range(draw(st.integers(1, 4))):
            valid[draw(st.integers(0, len(valid) - 1))] = draw(st.integers(0, 255))
        return bytes(valid)
    if kind == "cut":
        return bytes(valid[:draw(st.integers(0, len(valid) - 1))])
    return valid.decode().encode("utf-16")


def test_arbitrary_bytes(door, cluster, am, caplog):
    @fuzz_settings(300)
    @given(byte_bodies())
    def prop(body):
        start = len(list(cluster.emu))
        status, doc = am.send(door, request(body))
        judge(status, doc, f"the body {body[:300]!r}")
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            payload = None
        assert stray_writes(door, cluster, start, payload) == [], f"for the body {body[:300]!r}"
    prop()
    assert problems(caplog) == []
    still_applies(door, am)


def test_many_alerts_for_many_models(door, cluster, am, caplog):
    """Up to MAX_ALERTS alerts, each naming another model (a GET each), and one over."""
    for n, answer in ((alerts.MAX_ALERTS, 200), (alerts.MAX_ALERTS + 1, 400)):
        payload = am.webhook(*[am.alert("watched", f"many-{i}", sig.LOW, fingerprint=str(i)) for i in range(n)])
        start = len(list(cluster.emu))
        status, doc = am.send(door, request(json.dumps(payload).encode()))
        assert status == answer and (doc == {"unknown_model": n} if status == 200 else "at most" in doc["error"])
        assert stray_writes(door, cluster, start, payload) == []
    assert problems(caplog) == []


# -- headers ----------------------------------------------------------------------------

no_newlines = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
auths = (no_newlines | no_newlines.map(lambda b: b"Bearer " + b) | st.sampled_from([
    b"Bearer", b"Bearer ", TOKEN.lower(), TOKEN.replace(b" ", b"  "),
    TOKEN + b"\x00", TOKEN + b"x", TOKEN[:-1], b"Basic dGVzdA==", b"Bearer \xe9\xe9", b"Bearer \xed\xa0\x80",
    "Bearer tést".encode(), TOKEN + "é".encode()]) | st.none())


def test_arbitrary_authorization(door, cluster, am, caplog):
    body = json.dumps(am.webhook(am.alert("watched", "busy", sig.LOW))).encode()

    @fuzz_settings(300)
    @given(auths)
    def prop(auth):
        start = len(list(cluster.emu))
        status, doc = am.send(door, request(body, auth))
        judge(status, doc, f"Authorization {auth!r}")
        if auth != TOKEN:  # a 401; a 400 where the parser refuses the header line (a control character)
            assert status in (400, 401), f"Authorization {auth!r}: {status} {doc}"
            assert writes_since(cluster, start) == []
    prop()
    assert problems(caplog) == []


header_names = st.sampled_from(["Content-Type", "Content-Length", "Transfer-Encoding", "Expect",
                                "Connection", "Host", "Authorization", "Content-Encoding"]) \
    .map(str.encode) | no_newlines.map(lambda b: b[:16])
header_values = no_newlines | st.integers(8000, 9000).map(lambda n: b"v" * n) \
    | st.sampled_from([b"chunked", b"gzip", b"deflate", b"br", b"100-continue", b"close", b"-1", b"0",
                       b"application/json", b"text/plain; charset=utf-16"])


def test_arbitrary_header_lines(door, cluster, am, caplog):
    body = json.dumps(am.webhook(am.alert("watched", "busy", sig.LOW))).encode()

    @fuzz_settings(300)
    @given(st.lists(st.tuples(header_names, header_values), min_size=1, max_size=4))
    def prop(lines):
        head = b"".join(n + b": " + v + b"\r\n" for n, v in lines)
        start = len(list(cluster.emu))
        status, doc = am.send(door, request(body, head=head))
        judge(status, doc, f"the header lines {head[:300]!r}")
        assert stray_writes(door, cluster, start, json.loads(body)) == []
    prop()
    assert problems(caplog) == []
    still_applies(door, am)
