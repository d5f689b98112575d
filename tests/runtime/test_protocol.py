"""The v2 tensor codec on its own: the cases the end-to-end tests do not reach."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.runtime.engine.backends.base import ShapeRange, TensorSpec
from kiln.runtime.serving.refusals import Kind, Refusal
from kiln.runtime.serving.protocol import decode_infer_response, encode_infer_request, encode_infer_response, parse_infer_request

INPUTS = [TensorSpec("mask", "BOOL", (-1, 2)), TensorSpec("half", "FP16", (-1, 2)),
          TensorSpec("small", "UINT8", (-1, 2))]
OUTPUTS = [TensorSpec("y", "FP32", (-1, 2))]


def parse(doc, binary: bytes = b"", profiles=None):
    header = json.dumps(doc).encode()
    return parse_infer_request(header + binary, len(header) if binary else None, INPUTS,
                               OUTPUTS, profiles)


def inputs(**changes):
    doc = [{"name": "mask", "shape": [1, 2], "datatype": "BOOL", "data": [True, False]},
           {"name": "half", "shape": [1, 2], "datatype": "FP16", "data": [0.5, 1.5]},
           {"name": "small", "shape": [1, 2], "datatype": "UINT8", "data": [0, 255]}]
    for entry in doc:
        entry.update(changes.get(entry["name"], {}))
    return {"inputs": doc}


def test_bool_fp16_uint8_json_and_binary_agree():
    arrays = {"mask": np.array([[True, False]]), "half": np.array([[0.5, 1.5]], np.float16),
              "small": np.array([[0, 255]], np.uint8)}
    body, n = encode_infer_request(arrays, binary=True)
    from_binary = parse_infer_request(body, n, INPUTS, OUTPUTS).inputs
    from_json = parse(inputs()).inputs
    for name, want in arrays.items():
        assert from_binary[name].dtype == want.dtype == from_json[name].dtype
        np.testing.assert_array_equal(from_binary[name], want)
        np.testing.assert_array_equal(from_json[name], want)


@pytest.mark.parametrize("doc,binary,message", [
    (inputs(mask={"data": [1, 0]}), b"", "input 'mask': BOOL data must be true or false"),
    (inputs(small={"data": [0, 256]}), b"", "input 'small': a value is out of range for UINT8"),
    (inputs(half={"data": ["a", "b"]}), b"", "input 'half': 'data' must hold numbers for FP16 "
     "(or the strings \"NaN\", \"Infinity\", \"-Infinity\")"),
    (inputs(small={"data": ["1", "2"]}), b"", "input 'small': 'data' must hold numbers for UINT8"),
    (inputs(half={"data": [[1.0], [2.0, 3.0]]}), b"",
     "input 'half': 'data' is a ragged nested list"),
    (inputs(half={"shape": [0, 2]}), b"",
     "input 'half': every dimension of shape [0, 2] must be positive"),
    (inputs(half={"parameters": {"shared_memory_region": "r"}}), b"",
     "input 'half': the shared-memory extension is not supported; send the tensor in the body "
     "(JSON data or binary_data_size)"),
    (inputs(half={"data": None, "parameters": {"binary_data_size": 4}}), bytes(4),
     "input 'half' has both 'data' and binary_data_size"),
    (inputs(), b"xyz", "the body has 3 bytes after the JSON header that no input's "
                       "binary_data_size accounts for"),
    ({**inputs(), "parameters": {"binary_data_output": "yes"}}, b"",
     "parameter 'binary_data_output' of the request must be true or false"),
    ({**inputs(), "id": 5}, b"", "'id' must be a string"),
])
def test_rejections(doc, binary, message):
    with pytest.raises(Refusal) as e:
        parse(doc, binary)
    assert (e.value.kind, e.value.message) == (Kind.INVALID, message)


def test_dimensions_outside_the_profile_are_refused():
    profiles = {"half": ShapeRange((1, 2), (4, 2), (8, 2))}
    parse(inputs(), profiles=profiles)
    wide = {"inputs": [dict(i, shape=[1, 3], data=[i["data"][0]] * 3)
                       for i in inputs()["inputs"]]}
    specs = [TensorSpec(s.name, s.datatype, (-1, -1)) for s in INPUTS]
    header = json.dumps(wide).encode()
    with pytest.raises(Refusal) as e:
        parse_infer_request(header, None, specs, OUTPUTS,
                            {"half": ShapeRange((1, 1), (4, 2), (8, 2))})
    assert e.value.message == ("input 'half' has shape [1, 3] but the engine's profile allows "
                               "dimension 1 only from 1 to 2 (min [1, 1], max [8, 2])")


def test_binary_output_default_and_per_output_override():
    request = parse({**inputs(), "parameters": {"binary_data_output": True},
                     "outputs": [{"name": "y", "parameters": {"binary_data": False}}]})
    assert [o.binary for o in request.outputs] == [False]
    request = parse({**inputs(), "parameters": {"binary_data_output": True}})
    y = np.arange(4, dtype=np.float32).reshape(2, 2)
    body, n = encode_infer_response("m", "1", request, {"y": y})
    assert n is not None and len(body) == n + y.nbytes
    np.testing.assert_array_equal(decode_infer_response(body, n)["outputs"][0]["data"], y)


@pytest.mark.parametrize("body,message", [
    (b"[" * 100_000, "the request's JSON is nested too deeply"),
    (b'{"inputs": [' + b"1" * 5000 + b"]}", "malformed JSON in the request body: Exceeds the "
                                           "limit (4300 digits) for integer string conversion"),
    (b'{"inputs": [NaN]}', "the request body holds NaN, which is not JSON"),
    (b'{"inputs": [-Infinity]}', "the request body holds -Infinity, which is not JSON"),
    (b'{"inputs": "\xff"}', "the request body is not UTF-8 JSON"),
])
def test_malformed_json_of_every_kind_is_a_400(body, message):
    with pytest.raises(Refusal) as e:
        parse_infer_request(body, None, INPUTS, OUTPUTS)
    assert e.value.kind is Kind.INVALID and e.value.message.startswith(message)


@pytest.mark.parametrize("datatype", [["FP16"], {"a": 1}, 16, None, True])
def test_a_datatype_that_is_not_a_string_is_a_400(datatype):
    with pytest.raises(Refusal) as e:
        parse(inputs(half={"datatype": datatype}))
    assert e.value.message.startswith("input 'half': 'datatype' must be a string such as FP16")


def test_client_values_are_echoed_shortened():
    name = "x" * 1_000_000
    for doc in (inputs(half={"name": name}), {**inputs(), "outputs": [{"name": name}]},
                inputs(half={"shape": [1] * 100_000})):
        with pytest.raises(Refusal) as e:
            parse(doc)
        assert len(e.value.message) < 300, e.value.message[:100]


def test_non_finite_floats_as_proto3_json_strings_both_ways():
    request = parse(inputs(half={"data": ["NaN", "-Infinity"]}))
    half = request.inputs["half"]
    assert np.isnan(half[0, 0]) and half[0, 1] == -np.inf
    y = np.array([[np.nan, np.inf], [-np.inf, 1.5]], np.float32)
    body, n = encode_infer_response("m", "1", request, {"y": y})
    assert n is None
    doc = json.loads(body)  # strict: a JSON client reads it
    assert doc["outputs"][0]["data"] == ["NaN", "Infinity", "-Infinity", 1.5]
    np.testing.assert_array_equal(decode_infer_response(body, None)["outputs"][0]["data"], y)


def test_request_bytes_bound():
    from kiln.runtime.serving.tensors import request_bytes_bound
    fixed = [TensorSpec("x", "FP32", (-1, 3, 2))]
    assert request_bytes_bound(fixed, {}, 8) == 64 * 1024 + 8 * 6 * 64
    assert request_bytes_bound(fixed, {}, None) is None  # a batch without a bound
    dynamic = [TensorSpec("x", "FP32", (-1, -1))]
    assert request_bytes_bound(dynamic, {}, 8) is None
    assert request_bytes_bound(dynamic, {"x": ShapeRange((1, 1), (1, 5), (4, 10))}, 8) == \
        64 * 1024 + 8 * 10 * 64


# -- the JSON codec (orjson), issue 12 item 1 ----------------------------------------------

def _stdlib_response(request, results) -> bytes:
    """What Kiln answered before orjson: tolist() and json.dumps."""
    from kiln.runtime.serving.protocol import json_values
    doc = {"model_name": "m", "model_version": "1",
           "outputs": [{"name": o.name, "datatype": "FP32" if results[o.name].dtype == np.float32
                        else "FP64", "shape": list(results[o.name].shape),
                        "data": json_values(results[o.name])} for o in request.outputs]}
    return json.dumps(doc, separators=(",", ":")).encode()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_finite_outputs_mean_what_the_standard_library_wrote(dtype):
    request = parse(inputs())
    rng = np.random.default_rng(7)
    y = np.concatenate([rng.standard_normal(500), rng.uniform(-1, 1, 500) * 1e30,
                        [0.0, -0.0, 1e-45, np.finfo(dtype).max, np.finfo(dtype).tiny]]
                       ).astype(dtype).reshape(-1, 5)
    body, n = encode_infer_response("m", "1", request, {"y": y})
    assert n is None
    ours, theirs = json.loads(body), json.loads(_stdlib_response(request, {"y": y}))
    got, want = ours["outputs"][0].pop("data"), theirs["outputs"][0].pop("data")
    assert ours == theirs  # the same structure, and names, shapes and datatypes
    assert all(isinstance(v, float) for v in got) and len(got) == len(want) == y.size
    np.testing.assert_array_equal(np.array(got, dtype), np.array(want, dtype))  # round-trips
    np.testing.assert_array_equal(decode_infer_response(body, None)["outputs"][0]["data"], y)


def test_non_finite_outputs_still_use_the_proto3_strings():
    request = parse(inputs())
    y = np.array([[np.nan, 0.25], [np.inf, -np.inf]], np.float32)
    body, _ = encode_infer_response("m", "1", request, {"y": y})
    assert b"null" not in body and b"NaN," not in body.replace(b'"NaN"', b"")
    assert body == _stdlib_response(request, {"y": y})  # byte for byte what json wrote
    assert json.loads(body)["outputs"][0]["data"] == ["NaN", 0.25, "Infinity", "-Infinity"]


@pytest.mark.parametrize("literal", ["18446744073709551616", "-9223372036854775809",
                                     "1" + "0" * 30])
def test_an_integer_literal_beyond_64_bits_in_float_data_is_still_refused(literal):
    # orjson reads it as a float; the standard library kept the int, which numpy cannot hold.
    body = json.dumps(inputs()).replace("[0.5, 1.5]", f"[0.5, {literal}]").encode()
    with pytest.raises(Refusal) as e:
        parse_infer_request(body, None, INPUTS, OUTPUTS)
    assert e.value.message == "input 'half': 'data' must hold numbers for FP16"


def test_what_only_the_standard_library_reads_is_still_read():
    # 1e400 (infinity) and a lone surrogate escape: orjson refuses both, json read them.
    body = json.dumps({**inputs(), "id": "\ud800"}).replace("[0.5, 1.5]", "[0.5, 1e400]")
    request = parse_infer_request(body.encode(), None, INPUTS, OUTPUTS)
    assert request.inputs["half"][0, 1] == np.inf and request.id == "\ud800"
    answer, _ = encode_infer_response("m", "1", request, {"y": np.zeros((1, 2), np.float32)})
    assert json.loads(answer)["id"] == "\ud800"  # written by json, as before
