"""Warm-up with the user's sample requests (spec.runtime.warmup): the demo model (examples/demo)
built into a real cache, served by a real `ServedModel` on ONNX Runtime; every expected output
below is what ONNX Runtime answers run directly on the same file. What a user sees: the model
ready or not, its status message, the load-stage metric, and from the `kiln serve` process its
exit code and termination log."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from kiln.runtime.api.errors import SERVE_EXIT_REASONS, WarmupFailed
from kiln.runtime.api.spec import runtime_with_defaults
from kiln.runtime.engine.build import BuildRequest, build_engine
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.model import FAILED, READY, ServedModel

from support.metrics import metric_value

pytestmark = pytest.mark.timeout(60)

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo" / "model.onnx"
ROWS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], np.float32)  # a setosa, a virginica


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("warmup")
    result = build_engine(BuildRequest.from_dict({
        "namespace": "default", "name": "iris", "model": {"uri": DEMO.as_uri(), "version": "1"},
        "engine": {"backend": "onnxruntime", "precision": "fp32",
                   "profiles": [{"input": "features", "min": [1, 4], "opt": [8, 4], "max": [64, 4]}]},
        "target": "cpu"}), root / "cache", allow_local_files=True)
    return root / "cache", result.path


@pytest.fixture(scope="module")
def answers() -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(DEMO), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {"features": ROWS})))


def request(rows: np.ndarray = ROWS) -> list[dict]:
    return [{"name": "features", "shape": list(rows.shape), "datatype": "FP32", "data": rows.reshape(-1).tolist()}]


def good_sample(answers) -> dict:
    return {"id": "two-flowers", "inputs": request(),
            "outputs": [{"name": "probabilities", "shape": [2, 3], "datatype": "FP32",
                         "data": answers["probabilities"].reshape(-1).tolist()},
                        {"name": "species", "data": answers["species"].tolist()}]}


def load(demo, warmup: dict | None, samples_file: Path | None = None) -> tuple[ServedModel, str, ServerMetrics]:
    """The model after its load (then closed), and its state right after the load."""
    cache, entry = demo
    metrics = ServerMetrics()
    if samples_file is not None:  # as the operator passes spec.runtime.warmup.samplesFile
        warmup = {**(warmup or {}), "samplesFile": samples_file.name}
    runtime = runtime_with_defaults({"batching": {"maxBatchSize": 8}, **({"warmup": warmup} if warmup else {})})
    model = ServedModel("iris", "1", cache, {"cpu": entry}, runtime, metrics, target="cpu",
                        samples_file=str(samples_file) if samples_file else None)

    async def go() -> str:
        try:
            await model.load()
            return model.state
        finally:
            await model.close(1.0)
    return model, asyncio.run(go()), metrics


def failure_of(demo, warmup: dict | None, samples_file: Path | None = None) -> str:
    model, state, _ = load(demo, warmup, samples_file)
    assert state == FAILED and isinstance(model.failure, WarmupFailed), model.error
    assert model.status_message() == f"model 'iris' failed to load: {model.error}"
    return model.error


def test_samples_that_answer_as_expected_let_the_model_become_ready(demo, answers):
    model, state, metrics = load(demo, {"samples": [good_sample(answers), {"inputs": request(ROWS[:1])}]})
    assert state == READY and model.failure is None, model.error
    text = __import__("prometheus_client").generate_latest(metrics.registry).decode()
    assert metric_value(text, "kiln_engine_load_seconds", {"model": "iris", "stage": "samples"}) > 0


def test_an_output_other_than_expected_fails_the_warm_up_and_says_by_how_much(demo, answers):
    wrong = good_sample(answers)
    probabilities = answers["probabilities"].copy()
    probabilities[1, 2] -= 0.31  # the virginica's probability: far outside the tolerance
    wrong["outputs"][0]["data"] = probabilities.reshape(-1).tolist()
    message = failure_of(demo, {"samples": [{"inputs": request(ROWS[:1])}, wrong]})
    assert message == (
        'sample 2 (of 2, spec.runtime.warmup.samples[1], id "two-flowers"): output "probabilities" differs from '
        f'the expected: max abs difference 0.31 > tolerance (absolute 0.0001, relative 0.001); at [1, 2]: '
        f'{answers["probabilities"][1, 2]:.6g}, expected {probabilities[1, 2]:.6g}; 1 of 6 value(s) differ')


def test_the_tolerance_is_numpys_allclose(demo, answers):
    near = good_sample(answers)
    near["outputs"] = [{"name": "probabilities", "data": (answers["probabilities"] + 0.05).reshape(-1).tolist()}]
    assert "max abs difference 0.05" in failure_of(demo, {"samples": [near]})
    model, state, _ = load(demo, {"samples": [near], "tolerance": {"absolute": 0.06, "relative": 0}})
    assert state == READY, model.error
    exact = good_sample(answers)
    exact["outputs"] = [{"name": "species", "data": [0, 1]}]  # an integer output: 2 is not 1
    assert "output \"species\" differs from the expected: max abs difference 1 > tolerance" in failure_of(
        demo, {"samples": [exact], "tolerance": {"absolute": 0, "relative": 0}})


@pytest.mark.parametrize("sample, says", [
    ({"inputs": [{"name": "petals", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
     "sample 1 (of 1, spec.runtime.warmup.samples[0]): the request is refused: unknown input 'petals'; the model's inputs are: features"),
    ({"inputs": [{"name": "features", "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3, 4]}]},
     "the request is refused: input 'features' has datatype INT64 but the model expects FP32"),
    ({"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3]}]},
     "the request is refused: input 'features': shape [1, 4] needs 4 elements but 'data' has 3"),
    ({"inputs": request(), "outputs": [{"name": "logits", "data": [1]}]},
     "the request is refused: unknown output 'logits'; the model's outputs are: probabilities, species"),
    ({"inputs": request(), "outputs": [{"name": "species", "shape": [3], "data": [0, 2, 1]}]},
     "output \"species\" has shape [2], expected [3]"),
    ({"inputs": request(), "outputs": [{"name": "species", "datatype": "INT32", "data": [0, 2]}]},
     "output \"species\" has datatype INT64, expected INT32"),
    ({"inputs": request(), "outputs": [{"name": "species", "data": [0, 2, 1]}]},
     "expected output 'species': shape [2] needs 2 elements but 'data' has 3"),
    ({"inputs": request(), "outputs": [{"name": "species", "data": ["setosa", "virginica"]}]},
     "expected output 'species': 'data' must hold numbers for INT64"),
    ({"inputs": request(), "expected": []},
     "sample 1 (of 1, spec.runtime.warmup.samples[0]) has unknown field(s) \"expected\"; a sample has inputs, "
     "outputs, id and parameters"),
    ({"inputs": request(), "parameters": {"sequence_id": 7}},
     "model 'iris' is not stateful (no spec.runtime.sequences): drop the sequence_id parameter"),
    ({"inputs": request(np.zeros((65, 4), np.float32))}, "65"),  # over the profile's largest batch
])
def test_a_sample_that_cannot_run_or_names_what_the_model_lacks_says_why(demo, sample, says):
    assert says in failure_of(demo, {"samples": [sample]})


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "samples.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_a_samples_file_runs_after_the_inline_samples(demo, answers, tmp_path):
    wrong = good_sample(answers)
    wrong["outputs"] = [{"name": "species", "data": [0, 0]}]
    path = write(tmp_path, json.dumps({"samples": [good_sample(answers), wrong]}))
    message = failure_of(demo, {"samples": [{"inputs": request()}]}, path)
    assert message.startswith('sample 3 (of 3, samples.json[1], id "two-flowers"): output "species" differs')
    path = write(tmp_path, json.dumps({"samples": [good_sample(answers)]}))
    model, state, _ = load(demo, None, path)
    assert state == READY, model.error


@pytest.mark.parametrize("content, says", [
    ('{"samples": [', "samples file {path}: malformed JSON in the file: Expecting value: line 1 column 14"),
    ('{"samples": [NaN]}', "samples file {path}: the file holds NaN, which is not JSON"),
    (b"\xff\xfe{", "samples file {path}: the file is not UTF-8 JSON"),
    ("[]", 'samples file {path} must be a JSON object {{"samples": [...]}} with at least one sample'),
    ('{"samples": []}', 'samples file {path} must be a JSON object {{"samples": [...]}} with at least one sample'),
    ('{"samples": [3]}', "sample 1 (of 1, samples.json[0]) must be an object with inputs"),
    ('{"samples": [{"inputs": [], "outputs": {"species": [0]}}]}',
     "sample 1 (of 1, samples.json[0]): outputs must be a list of {{name, data}}"),
    ('{"samples": [{"inputs": 5}]}', "the request is refused: the request needs a non-empty 'inputs' list"),
    ("[" * 100000 + "]" * 100000, "samples file {path}: the file's JSON is nested too deeply"),
])
def test_a_malformed_samples_file_is_a_clear_failure_never_a_traceback(demo, tmp_path, content, says):
    path = write(tmp_path, content)
    assert says.format(path=path) in failure_of(demo, None, path)


def test_a_samples_file_that_is_missing_too_big_or_not_a_file_is_named(demo, tmp_path):
    missing = tmp_path / "nothing.json"
    assert failure_of(demo, None, missing) == (
        f"samples file {missing} does not exist: put it beside the model's ONNX file, or correct "
        f"spec.runtime.warmup.samplesFile")
    big = write(tmp_path, b" " * (16 * 2**20 + 1))
    assert failure_of(demo, None, big) == f"samples file {big} is larger than 16 MiB"
    assert "is a directory, not a regular file" in failure_of(demo, None, tmp_path)


def test_kiln_serve_exits_with_the_reason_in_its_termination_log(demo, answers, tmp_path):
    cache, entry = demo
    wrong = good_sample(answers)
    wrong["outputs"] = [{"name": "species", "data": [2, 2]}]
    log = tmp_path / "termination-log"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "kiln"), "serve", "--model-name", "iris", "--cache-dir", str(cache),
         "--engine", f"cpu={entry}", "--runtime-spec", json.dumps({"warmup": {"samples": [wrong]}}),
         "--host", "127.0.0.1", "--port", "0", "--no-grpc", "--workers", "1", "--termination-log", str(log)],
        capture_output=True, text=True, timeout=60)
    assert (proc.returncode, SERVE_EXIT_REASONS[proc.returncode]) == (9, "WarmupFailed"), proc.stderr
    assert log.read_text() == (
        'WarmupFailed: sample 1 (of 1, spec.runtime.warmup.samples[0], id "two-flowers"): output "species" '
        'differs from the expected: max abs difference 2 > tolerance (absolute 0.0001, relative 0.001); at [0]: '
        '0, expected 2; 1 of 2 value(s) differ')


def test_kiln_serve_with_a_samples_file_alone_runs_them_at_the_default_tolerance(
        demo, answers, tmp_path, kiln_process):
    cache, entry = demo
    path = write(tmp_path, json.dumps({"samples": [good_sample(answers)]}))
    p = kiln_process(["serve", "--model-name", "iris", "--cache-dir", str(cache), "--engine",
                      f"cpu={entry}", "--samples-file", str(path), "--host", "127.0.0.1",
                      "--port", "0", "--no-grpc", "--workers", "1"], tmp_path)
    p.wait_for(r"model iris: ready in .*samples", timeout=60)
    assert p.stop() == 0


def test_kiln_serve_refuses_a_tolerance_that_is_not_a_number(demo, tmp_path):
    cache, entry = demo
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "kiln"), "serve", "--model-name", "iris", "--engine", f"cpu={entry}",
         "--cache-dir", str(cache), "--runtime-spec",
         json.dumps({"warmup": {"samples": [], "tolerance": {"absolute": -1, "relative": 0}}})],
        capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr.strip()) == (
        2, "kiln serve: runtime.warmup.tolerance.absolute must be a non-negative number, got -1")
