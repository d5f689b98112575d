"""The emulated API server's realism layer (tests/support/kubeemu.py), through the real client."""

from __future__ import annotations

import json

import pytest

from kiln.operator.kube import ApiError

CM = "/api/v1/namespaces/emu/configmaps"
IM = "/apis/kiln.dev/v1alpha1/namespaces/emu/inferencemodels"


def test_metadata_create_and_conflicts(api):
    created = api.request("POST", CM, {"metadata": {"name": "a"}, "data": {"k": "v"}})
    meta = created["metadata"]
    assert meta["namespace"] == "emu" and meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    assert created["kind"] == "ConfigMap"
    with pytest.raises(ApiError) as e:
        api.request("POST", CM, {"metadata": {"name": "a"}})
    assert (e.value.status, e.value.reason) == (409, "AlreadyExists")
    with pytest.raises(ApiError) as e:
        api.request("PATCH", f"{CM}/a", {"metadata": {"resourceVersion": "1"}, "data": {"k": "w"}},
                    "application/merge-patch+json")
    assert (e.value.status, e.value.reason) == (409, "Conflict")
    lst = api.request("GET", CM)
    assert lst["kind"] == "ConfigMapList" and lst["metadata"]["resourceVersion"]


def test_generation_and_subresources(api):
    body = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel", "metadata": {"name": "g"},
            "spec": {"model": {"uri": "https://x/m.onnx", "version": "1"}, "runtime": {"replicas": 1}}}
    obj = api.request("POST", IM, body)
    assert obj["metadata"]["generation"] == 1
    obj = api.request("PATCH", f"{IM}/g", {"metadata": {"labels": {"a": "b"}}, "status": {"phase": "Ready"}},
                      "application/merge-patch+json")
    assert obj["metadata"]["generation"] == 1 and "status" not in obj  # main resource ignores status
    obj = api.request("PATCH", f"{IM}/g/status", {"status": {"phase": "Ready"}, "spec": {"x": 1}},
                      "application/merge-patch+json")
    assert obj["status"] == {"phase": "Ready"} and "x" not in obj["spec"]
    assert obj["metadata"]["generation"] == 1
    scale = api.request("PATCH", f"{IM}/g/scale", {"spec": {"replicas": 4}}, "application/merge-patch+json")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 4
    obj = api.request("GET", f"{IM}/g")
    assert obj["spec"]["runtime"]["replicas"] == 4 and obj["metadata"]["generation"] == 2


def test_json_patch_test_failure_is_422(api):
    api.request("POST", CM, {"metadata": {"name": "j"}, "data": {"k": "v"}})
    with pytest.raises(ApiError) as e:
        api.request("PATCH", f"{CM}/j", [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
                                         {"op": "replace", "path": "/data/k", "value": "w"}],
                    "application/json-patch+json")
    assert e.value.status == 422
    ok = api.request("PATCH", f"{CM}/j", [{"op": "add", "path": "/data/n", "value": "1"}],
                     "application/json-patch+json")
    assert ok["data"] == {"k": "v", "n": "1"}


def test_selectors_and_namespaces(api):
    for name, tier in (("s1", "a"), ("s2", "b"), ("s3", "a")):
        api.request("POST", CM, {"metadata": {"name": name, "labels": {"tier": tier}}})
    names = lambda q: sorted(i["metadata"]["name"] for i in api.request("GET", CM + q)["items"])  # noqa: E731
    assert names("?labelSelector=tier%3Da") == ["s1", "s3"]
    assert names("?labelSelector=tier+in+(b)") == ["s2"]
    assert names("?labelSelector=tier%21%3Da") == [n for n in names("") if n != "s1" and n != "s3"]
    assert names("?fieldSelector=metadata.name%3Ds2") == ["s2"]
    nss = [n["metadata"]["name"] for n in api.request("GET", "/api/v1/namespaces")["items"]]
    assert "emu" in nss
    assert api.request("GET", "/api/v1/namespaces/emu")["metadata"]["name"] == "emu"


def test_finalizers_delay_deletion(api):
    api.request("POST", CM, {"metadata": {"name": "f", "finalizers": ["x/y"]}})
    api.request("DELETE", f"{CM}/f")
    assert api.request("GET", f"{CM}/f")["metadata"]["deletionTimestamp"]
    api.request("PATCH", f"{CM}/f", {"metadata": {"finalizers": None}}, "application/merge-patch+json")
    with pytest.raises(ApiError) as e:
        api.request("GET", f"{CM}/f")
    assert e.value.status == 404


def test_watch_from_a_resource_version(api, cluster):
    import urllib.request

    start = api.request("GET", CM)["metadata"]["resourceVersion"]
    api.request("POST", CM, {"metadata": {"name": "w1", "labels": {"watch": "me"}}})
    api.request("POST", CM, {"metadata": {"name": "w2"}})
    url = (f"http://{cluster.server.host}:{cluster.server.port}{CM}?watch=true&resourceVersion={start}"
           f"&labelSelector=watch%3Dme&timeoutSeconds=1")
    with urllib.request.urlopen(url, timeout=10) as resp:
        events = [json.loads(line) for line in resp.read().splitlines() if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "w1")]
