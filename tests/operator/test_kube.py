"""operator/kube.py's paths: one segment per name, whatever the name holds (issue 19)."""

from __future__ import annotations

import pytest

from kiln.operator.kube import path_for
from kiln.runtime.api.contract import API_VERSION, KIND


def test_path_for_quotes_every_segment_and_refuses_dot_segments_and_slashes():
    assert path_for("ConfigMap", "ns", "a%2Fb c?d#e") == "/api/v1/namespaces/ns/configmaps/a%252Fb%20c%3Fd%23e"
    assert path_for(KIND, "ns", "m", "status") == f"/apis/{API_VERSION}/namespaces/ns/inferencemodels/m/status"
    assert path_for(KIND, None) == f"/apis/{API_VERSION}/inferencemodels"
    for bad in ("", ".", "..", "a/b", "../x"):
        for args in ((bad, "m"), ("ns", bad), ("ns", "m", bad)):
            with pytest.raises(ValueError):
                path_for(KIND, *args)


def test_a_name_reaches_the_api_server_as_it_was_sent(api):
    """Through the kubernetes client's transport (which resolves '..' and splits off '?') to a
    server that decodes the path once, as the API server does: `%2F` stays no slash."""
    for name in ("a%2Fb", "a%2e%2e", "b?dryRun=All", "c#d", "e f", "%", "g;h"):
        api.request("POST", path_for("ConfigMap", "names"), {"metadata": {"name": name}, "data": {"name": name}})
        got = api.get("ConfigMap", "names", name)
        assert got is not None and got["data"] == {"name": name}, name
