"""Shadow copies (runtime/serving/shadow.py): the comparison, the config file, the sampling,
and two real servers over real HTTP, the stable one copying to the canary."""

from __future__ import annotations

import json
import os
import math
import time

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kiln.runtime.serving.shadow import Sampler, Shadow, ShadowConfig, compare, parse_config

from support.serving import NAME, Built, ServerThread, build_cpu_engine, json_inputs, sample

pytestmark = pytest.mark.timeout(90)

CLASSES = frozenset({"scores"})


def config(**over) -> ShadowConfig:
    return ShadowConfig(**{"canary": "k", "targets": ("127.0.0.1:1",), "percent": 100.0, "max_per_second": 10.0,
                           "timeout": 1.0, **over})


# ------------------------------------------------------------------------ compare

def test_the_operators_config_with_the_crds_defaults_is_what_the_runtime_reads():
    from kiln.operator import manifests
    from kiln.runtime.api.spec import apply_defaults

    spec = apply_defaults({"model": {"uri": "pvc://m/x.onnx", "version": "1"},
                           "rollout": {"shadow": {"enabled": True}}})
    text = manifests.shadow_settings("iris", spec, "key1", ["10.1.2.3:8080"])
    assert parse_config(text, "iris") == ShadowConfig("key1", ("10.1.2.3:8080",), 10.0, 20.0, 2.0)


def test_tiny_float_differences_agree_and_a_shifted_bias_does_not():
    """With the defaults (ShadowConfig's, the CRD's): absolute 1e-3, relative 1e-2."""
    defaults = config()
    rng = np.random.default_rng(1)
    stable = {"scores": rng.standard_normal((8, 3)).astype(np.float32), "pooled": rng.standard_normal((8, 4)).astype(np.float32),
              "label": np.arange(8) % 3}
    tiny = {k: (v * (1 + 1e-6)).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in stable.items()}
    rows = compare(stable, tiny, class_outputs=frozenset(), atol=defaults.atol, rtol=defaults.rtol)
    assert all(r.agreed for r in rows) and max(r.abs_difference for r in rows) < 1e-5

    shifted = {**stable, "pooled": stable["pooled"] + np.float32(0.5)}
    by_name = {r.name: r for r in compare(stable, shifted, class_outputs=frozenset(), atol=defaults.atol,
                                          rtol=defaults.rtol)}
    assert not by_name["pooled"].agreed and by_name["pooled"].abs_difference == pytest.approx(0.5, abs=1e-6)
    assert by_name["scores"].agreed and by_name["label"].agreed


def test_a_class_output_agrees_on_its_argmax_alone():
    stable = {"scores": np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]], np.float32)}
    same_class = {"scores": np.array([[0.0, 0.9, 0.1], [0.6, 0.2, 0.2]], np.float32)}
    other_class = {"scores": np.array([[0.0, 0.9, 0.1], [0.2, 0.6, 0.2]], np.float32)}
    [r] = compare(stable, same_class, class_outputs=CLASSES, atol=0, rtol=0)
    assert r.agreed and r.abs_difference == pytest.approx(0.2) and r.rel_difference == pytest.approx(1.0)
    [r] = compare(stable, other_class, class_outputs=CLASSES, atol=1, rtol=1)
    assert not r.agreed


def test_a_missing_output_another_shape_or_other_bytes_never_agree():
    stable = {"y": np.zeros((2, 3), np.float32), "names": np.array([b"a", b"b"], dtype=object)}
    rows = {r.name: r for r in compare(stable, {"y": np.zeros((3, 2), np.float32)}, class_outputs=frozenset(),
                                       atol=1, rtol=1)}
    assert not rows["y"].agreed and math.isinf(rows["y"].abs_difference)
    assert not rows["names"].agreed
    rows = {r.name: r for r in compare(stable, {"y": np.zeros((2, 3), np.float32),
                                                "names": np.array([b"a", b"c"], dtype=object)},
                                       class_outputs=frozenset(), atol=1, rtol=1)}
    assert rows["y"].agreed and not rows["names"].agreed


def test_nan_on_both_sides_agrees_and_on_one_side_does_not():
    stable = {"y": np.array([np.nan, 1.0], np.float32)}
    [r] = compare(stable, {"y": np.array([np.nan, 1.0], np.float32)}, class_outputs=frozenset(), atol=0, rtol=0)
    assert r.agreed and r.abs_difference == 0.0
    [r] = compare(stable, {"y": np.array([0.0, 1.0], np.float32)}, class_outputs=frozenset(), atol=1, rtol=1)
    assert not r.agreed and math.isinf(r.abs_difference)


# ------------------------------------------------------------------------ the config file

def good(**over) -> str:
    return json.dumps({"model": "iris", "canaryEngineKey": "abc123", "targets": ["10.0.0.7:8080", "[fd00::1]:8080"],
                       "percent": 10, "maxRequestsPerSecond": 20, "timeoutSeconds": 2,
                       "classOutputs": ["probabilities"], **over})


def test_the_config_file_is_checked_as_bytes_from_outside():
    c = parse_config(good(), "iris")
    assert (c.canary, c.targets, c.percent, c.max_per_second, c.class_outputs, c.atol, c.rtol) == (
        "abc123", ("10.0.0.7:8080", "[fd00::1]:8080"), 10.0, 20.0, frozenset({"probabilities"}), 1e-3, 1e-2)
    assert parse_config("", "iris") is None and parse_config(good(), "other") is None
    assert parse_config(good(targets=[]), "iris") is None
    for text, message in [("{", "not JSON"), ("[]", "not a JSON object"),
                          (good(canaryEngineKey="../x"), "canaryEngineKey"),
                          (good(targets=["http://evil/"]), "is not host:port"),
                          (good(targets=["a:99999"]), "is not host:port"),
                          (good(targets="a:1"), "targets must be a list"),
                          (good(percent=101), "percent must be a number in [0, 100]"),
                          (good(percent=True), "percent"),
                          (good(timeoutSeconds=0), "timeoutSeconds"),
                          (good(classOutputs=[1]), "classOutputs")]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_config(text, "iris")


# ------------------------------------------------------------------------ sampling

def test_the_sample_is_the_percentage_then_the_rate_bound():
    now = [0.0]
    draws = iter([0.05, 0.5, 0.05, 0.05, 0.05, 0.05])
    s = Sampler(lambda: now[0], lambda: next(draws))
    c = config(percent=10.0, max_per_second=2.0)
    assert [s.take(c), s.take(c), s.take(c), s.take(c)] == [True, False, True, False]  # 2 tokens, then none
    now[0] = 0.5  # half a second: one more token
    assert [s.take(c), s.take(c)] == [True, False]
    assert not Sampler(lambda: 0.0, lambda: 0.0).take(config(percent=0.0))


# ------------------------------------------------------------------------ two real servers

def shifted(model_bytes: bytes, by: float) -> bytes:
    """The test model with its last bias moved by `by`: a version that answers 200 with other numbers."""
    model = onnx.load_from_string(model_bytes)
    for i, init in enumerate(model.graph.initializer):
        if init.name == "b2":
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + np.float32(by), "b2"))
    return model.SerializeToString()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("shadow"))


def until(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def test_the_stable_server_copies_to_the_canary_and_counts_what_it_saw(built, tmp_path):
    """A canary with a shifted bias: every client answer is the stable model's, the copies
    are compared (scores differ, the argmax label mostly agrees), the config is read again
    when it changes, and a canary that is gone costs only its copies."""
    bad = build_cpu_engine(built.cache.parent, NAME, shifted(built.onnx, 3.0))
    stable = ServerThread(built.cache, {"cpu": built.rel})
    canary = ServerThread(built.cache, {"cpu": bad})
    path = tmp_path / "shadow.json"
    try:
        assert stable.wait_loaded() and canary.wait_loaded()
        stable.model.shadow = Shadow(str(path), NAME, stable.metrics, clock=time.monotonic)
        path.write_text(json.dumps({"model": NAME, "canaryEngineKey": "canary-1", "targets": [f"127.0.0.1:{canary.port}"],
                                    "percent": 100, "maxRequestsPerSecond": 1000, "timeoutSeconds": 5}))
        for seed in range(20):
            inputs = sample(2, seed)
            status, _, answer = stable.infer({"inputs": json_inputs(inputs)})
            expected = built.expected(inputs)
            assert status == 200
            np.testing.assert_allclose(np.array(next(o["data"] for o in answer["outputs"] if o["name"] == "scores")),
                                       expected["scores"].reshape(-1), rtol=1e-5)
        m = lambda name, **labels: stable.metric(name, model=NAME, canary="canary-1", **labels) or 0  # noqa: E731
        until(lambda: m("kiln_shadow_copies_total", outcome="compared") == 20)
        assert m("kiln_shadow_comparisons_total", output="scores", result="differ") == 20
        assert m("kiln_shadow_comparisons_total", output="pooled", result="agree") == 20
        assert m("kiln_shadow_abs_difference_count", output="scores") == 20
        assert m("kiln_shadow_abs_difference_bucket", output="scores", le="1.0") == 0  # a 3.0 shift
        assert m("kiln_shadow_abs_difference_bucket", output="scores", le="10.0") == 20
        assert canary.metric("kiln_requests_total", model=NAME, outcome="success") == 20  # each copy once

        # A changed file is read again; the canary now gone: the copies are lost, not the answers.
        gone = canary.port
        canary.close()
        time.sleep(1.1)  # the file is looked at once a second
        path.write_text(json.dumps({"model": NAME, "canaryEngineKey": "canary-2", "targets": [f"127.0.0.1:{gone}"],
                                    "percent": 100, "maxRequestsPerSecond": 1000, "timeoutSeconds": 1}))
        time.sleep(1.1)
        for seed in range(5):
            assert stable.infer({"inputs": json_inputs(sample(1, seed))})[0] == 200
        until(lambda: (stable.metric("kiln_shadow_copies_total", model=NAME, canary="canary-2",
                                     outcome="unavailable") or 0) == 5)

        # The file gone: nothing is copied.
        path.unlink()
        time.sleep(1.1)
        assert stable.infer({"inputs": json_inputs(sample(1, 0))})[0] == 200
        time.sleep(0.3)
        assert stable.metric("kiln_shadow_copies_total", model=NAME, canary="canary-2", outcome="unavailable") == 5
    finally:
        stable.close()
        if canary.thread.is_alive():
            canary.close()


def test_a_hostile_config_copies_nothing_and_serves_on(built, tmp_path):
    stable = ServerThread(built.cache, {"cpu": built.rel})
    path = tmp_path / "shadow.json"
    path.write_bytes(b"\xff\xfe not a config")
    try:
        assert stable.wait_loaded()
        stable.model.shadow = Shadow(str(path), NAME, stable.metrics, clock=time.monotonic)
        assert stable.infer({"inputs": json_inputs(sample(1, 0))})[0] == 200
        assert stable.model.shadow.config is None
        assert "kiln_shadow_copies_total{" not in stable.get("/metrics")[2]
    finally:
        stable.close()


@pytest.mark.timeout(60)  # a FIFO opened for a blocking read would stop the server's loop
@pytest.mark.parametrize("hostile", ["FIFO", "deep JSON"])
def test_a_config_replaced_by_a_fifo_or_deep_json_drops_the_old_one_and_never_blocks(
        built, tmp_path, hostile, caplog):
    stable = ServerThread(built.cache, {"cpu": built.rel})
    path = tmp_path / "shadow.json"
    path.write_text(json.dumps({"model": NAME, "canaryEngineKey": "canary-1",
                                "targets": ["127.0.0.1:9"], "percent": 100,
                                "maxRequestsPerSecond": 1000, "timeoutSeconds": 1}))
    try:
        assert stable.wait_loaded()
        stable.model.shadow = Shadow(str(path), NAME, stable.metrics, clock=time.monotonic)
        assert stable.infer({"inputs": json_inputs(sample(1, 0))})[0] == 200
        assert stable.model.shadow.config is not None
        path.unlink()
        if hostile == "FIFO":
            os.mkfifo(path)
        else:
            path.write_text("[" * 100_000 + "]" * 100_000)
        time.sleep(1.1)  # the file is looked at once a second
        started = time.monotonic()
        assert stable.infer({"inputs": json_inputs(sample(1, 1))})[0] == 200
        assert stable.get("/v2/health/live")[0] == 200 and time.monotonic() - started < 5
        assert stable.model.shadow.config is None  # the old config dropped: nothing copied
        says = ("is a FIFO (named pipe), not a regular file" if hostile == "FIFO"
                else "the JSON nests too deeply")
        assert any("shadow config ignored, nothing is copied" in r.message and says in r.message
                   for r in caplog.records), [r.message for r in caplog.records]
    finally:
        stable.close()


def smaller_embedding(model_bytes: bytes, rows: int) -> bytes:
    """The test model with only the first `rows` rows of its embedding: a version whose engine
    refuses (INVALID_ARGUMENT, a 400) the token ids the stable version answers."""
    model = onnx.load_from_string(model_bytes)
    for i, init in enumerate(model.graph.initializer):
        if init.name == "E":
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init)[:rows], "E"))
    return model.SerializeToString()


def test_a_canary_that_refuses_what_the_stable_side_answered_disagrees_on_every_output(built, tmp_path):
    """Issue 34: the canary's 400 to a request the stable side answered 200 is its failure,
    compared and counted as every output differing, not a failed copy the analysis ignores."""
    # Its own cache: the engine key is the model's URI and version, which the shifted test's share.
    refusing = build_cpu_engine(tmp_path, NAME, smaller_embedding(built.onnx, 5))
    stable = ServerThread(built.cache, {"cpu": built.rel})
    canary = ServerThread(tmp_path / "cache", {"cpu": refusing})
    path = tmp_path / "shadow.json"
    try:
        assert stable.wait_loaded() and canary.wait_loaded()
        stable.model.shadow = Shadow(str(path), NAME, stable.metrics, clock=time.monotonic)
        path.write_text(json.dumps({"model": NAME, "canaryEngineKey": "refusing", "targets": [f"127.0.0.1:{canary.port}"],
                                    "percent": 100, "maxRequestsPerSecond": 1000, "timeoutSeconds": 5}))
        for seed in range(10):
            inputs = sample(1, seed)
            inputs["token_ids"][:] = 7  # outside the canary's 5 rows, inside the stable's 10
            assert stable.infer({"inputs": json_inputs(inputs)})[0] == 200
        m = lambda name, **labels: stable.metric(name, model=NAME, canary="refusing", **labels) or 0  # noqa: E731
        until(lambda: m("kiln_shadow_copies_total", outcome="compared") == 10)
        for output in ("scores", "label", "pooled"):
            assert m("kiln_shadow_comparisons_total", output=output, result="differ") == 10, output
            assert m("kiln_shadow_comparisons_total", output=output, result="agree") == 0, output
        assert m("kiln_shadow_copies_total", outcome="error") == 0
        assert canary.metric("kiln_requests_total", model=NAME, outcome="refused") == 10
    finally:
        stable.close()
        canary.close()
