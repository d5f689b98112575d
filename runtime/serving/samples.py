"""The user's sample requests (spec.runtime.warmup): read, run before the model reports Ready,
their answers compared with the outputs expected. Any failure is a `WarmupFailed` whose
message names the sample and says what went wrong; `kiln serve` then exits with it.

A sample is an Open Inference Protocol (v2) JSON request (`inputs`, optionally `id` and
`parameters`) and optionally `outputs`, what it must answer, written as a v2 response
writes them (`name`, `data`, optionally `shape` and `datatype`). A request is decoded by the
protocol's own parser against the loaded model's tensors and run through `Model.infer`, as
one from the HTTP door is; an expected output's data by the same decoder. Samples come from
the spec (inline) and from `--samples-file` (JSON `{"samples": [...]}`, read from the model's
volume: hostile, bounded, never a traceback).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from kiln.runtime.api.errors import WarmupFailed
from kiln.runtime.api.localfile import NotARegularFile, open_regular
from kiln.runtime.engine.backends.base import DATATYPES

MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_SAMPLES = 1024  # inline and from the file together
_SAMPLE_KEYS = frozenset({"id", "parameters", "inputs", "outputs"})
_EXPECTED_KEYS = frozenset({"name", "shape", "datatype", "data"})


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """numpy.allclose's: |actual - expected| <= absolute + relative * |expected|."""

    absolute: float
    relative: float

    @classmethod
    def from_spec(cls, warmup: Mapping[str, Any]) -> "Tolerance":
        """From a defaulted spec.runtime.warmup (the CRD holds the defaults). ValueError when
        a value is not a finite, non-negative number."""
        from kiln.runtime.api.spec import require_keys

        tolerance = warmup.get("tolerance")
        if not isinstance(tolerance, Mapping):
            raise ValueError("runtime.warmup.tolerance must be an object with absolute and relative")
        require_keys(tolerance, ("absolute", "relative"), "runtime.warmup.tolerance")
        values = []
        for key in ("absolute", "relative"):
            v = tolerance[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"runtime.warmup.tolerance.{key} must be a non-negative number, got {v!r}")
            values.append(float(v))
        return cls(*values)

    def __str__(self) -> str:
        return f"absolute {self.absolute:g}, relative {self.relative:g}"


@dataclasses.dataclass(frozen=True)
class Sample:
    label: str  # "sample 2 (of 5, samples.json[0], id "setosa")": what a failure names
    request: dict[str, Any]  # the v2 request: inputs, and id and parameters when given
    expected: tuple[dict[str, Any], ...]  # the expected outputs, as written


@dataclasses.dataclass(frozen=True)
class Warmup:
    samples: tuple[Sample, ...]
    tolerance: Tolerance


def read_spec(warmup: Mapping[str, Any] | None, samples_file: str | None) -> Warmup | None:
    """spec.runtime.warmup's samples (inline first) and those of `samples_file`; None with
    neither. Blocking (the file is on a volume). Raises WarmupFailed for samples that cannot
    be read, ValueError for a spec that is not the CRD's (a hand-written Deployment)."""
    warmup = warmup or {}
    if not isinstance(warmup, Mapping):
        raise ValueError("runtime.warmup must be an object")
    inline = warmup.get("samples") or []
    if not isinstance(inline, list):
        raise ValueError("runtime.warmup.samples must be a list")
    if not inline and not samples_file:
        return None
    if "tolerance" not in warmup:  # `kiln serve --samples-file` alone: the CRD's default
        from kiln.runtime.api.spec import runtime_with_defaults

        warmup = runtime_with_defaults({"warmup": dict(warmup)})["warmup"]
    tolerance = Tolerance.from_spec(warmup)
    entries = [(f"spec.runtime.warmup.samples[{i}]", e) for i, e in enumerate(inline)]
    if samples_file:
        name = os.path.basename(samples_file)
        entries += [(f"{name}[{i}]", e) for i, e in enumerate(read_file(samples_file))]
    if len(entries) > MAX_SAMPLES:
        raise WarmupFailed(f"{len(entries)} samples, at most {MAX_SAMPLES} are run")
    return Warmup(tuple(_sample(where, entry, n, len(entries)) for n, (where, entry) in
                        enumerate(entries, 1)), tolerance)


def read_file(path: str) -> list[Any]:
    """The entries of a samples file, `{"samples": [...]}`. Raises WarmupFailed."""
    from kiln.runtime.serving import protocol
    from kiln.runtime.serving.refusals import Refusal

    try:
        with open_regular(path) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise WarmupFailed(f"samples file {path} does not exist: put it beside the model's ONNX file, "
                           f"or correct spec.runtime.warmup.samplesFile") from None
    except (OSError, NotARegularFile) as e:
        raise WarmupFailed(f"samples file {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise WarmupFailed(f"samples file {path} is larger than {MAX_FILE_BYTES // 2**20} MiB")
    try:
        doc = protocol.loads(data)  # strict JSON, as a request body is read
    except Refusal as e:
        # The words of a request body's refusal, about the file.
        said = e.message.replace("the request body", "the file").replace("the request's", "the file's")
        raise WarmupFailed(f"samples file {path}: {said}") from None
    samples = doc.get("samples") if isinstance(doc, dict) else None
    if not isinstance(samples, list) or not samples:
        raise WarmupFailed(f'samples file {path} must be a JSON object {{"samples": [...]}} with at least one sample')
    return samples


def _sample(where: str, entry: Any, n: int, total: int) -> Sample:
    at = f"sample {n} (of {total}, {where})"
    if not isinstance(entry, dict):
        raise WarmupFailed(f"{at} must be an object with inputs (and optionally outputs, id, parameters)")
    unknown = sorted(set(entry) - _SAMPLE_KEYS, key=str)
    if unknown:
        raise WarmupFailed(f"{at} has unknown field(s) {', '.join(map(_shown, unknown))}; a sample has "
                           f"inputs, outputs, id and parameters")
    if isinstance(entry.get("id"), str):
        at = f"sample {n} (of {total}, {where}, id {_shown(entry['id'])})"
    outputs = entry.get("outputs") or []
    if not isinstance(outputs, list):
        raise WarmupFailed(f"{at}: outputs must be a list of {{name, data}}")
    names: set[str] = set()
    for i, out in enumerate(outputs):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str) or "data" not in out:
            raise WarmupFailed(f"{at}: outputs[{i}] must be an object with a name and data")
        extra = sorted(set(out) - _EXPECTED_KEYS, key=str)
        if extra:
            raise WarmupFailed(f"{at}: outputs[{i}] has unknown field(s) {', '.join(map(_shown, extra))}; "
                               f"an expected output has name, data, shape and datatype")
        if out["name"] in names:
            raise WarmupFailed(f"{at}: output {_shown(out['name'])} is expected twice")
        names.add(out["name"])
        shape = out.get("shape")
        if shape is not None and not (isinstance(shape, list) and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise WarmupFailed(f"{at}: output {_shown(out['name'])}: shape must be a list of non-negative integers")
        if out.get("datatype") is not None and out["datatype"] not in DATATYPES:
            raise WarmupFailed(f"{at}: output {_shown(out['name'])}: unknown datatype {_shown(out['datatype'])}; "
                               f"one of {', '.join(DATATYPES)}")
    request = {k: entry[k] for k in ("inputs", "id", "parameters") if k in entry}
    return Sample(at, request, tuple(outputs))


# ------------------------------------------------------------------------ running them

async def warm_up(model: Any, warmup: Mapping[str, Any] | None, samples_file: str | None) -> bool:
    """Read the samples (the file on a daemon thread: its volume may hang) and run them
    through `model`; False when there are none. Raises WarmupFailed."""
    from kiln.runtime.serving.loading import on_daemon_thread

    found = await on_daemon_thread("kiln-samples", read_spec, warmup, samples_file)
    if found is None:
        return False
    await run(model, found)
    return True


async def run(model: Any, warmup: Warmup) -> None:
    """Run every sample through `model` (a loaded `ServedModel`: its tensors, `infer`), in
    order; the first that fails raises WarmupFailed."""
    from kiln.runtime.serving import protocol
    from kiln.runtime.serving.refusals import Refusal, scheduler_refusal
    from kiln.runtime.serving.scheduling.errors import SchedulerError
    from kiln.runtime.serving.tensors import check_output_name

    for sample in warmup.samples:
        try:
            request = protocol.parse_infer_request(protocol.dumps(sample.request), None, model.inputs,
                                                   model.outputs, model.profiles)
            for out in sample.expected:
                check_output_name(out["name"], model.outputs)
        except Refusal as e:
            raise WarmupFailed(f"{sample.label}: the request is refused: {e.message}") from None
        try:
            results = await model.infer(request.inputs, request.parameters)
        except SchedulerError as e:
            raise WarmupFailed(f"{sample.label}: {scheduler_refusal(model.name, e).message}") from None
        except Refusal as e:
            raise WarmupFailed(f"{sample.label}: the request is refused: {e.message}") from None
        for out in sample.expected:
            problem = check_output(out, results.get(out["name"]), warmup.tolerance)
            if problem:
                raise WarmupFailed(f"{sample.label}: {problem}")


def check_output(expected: Mapping[str, Any], actual: np.ndarray | None, tolerance: Tolerance) -> str | None:
    """What is wrong with `actual` against one expected output, None when it matches."""
    from kiln.runtime.serving import protocol
    from kiln.runtime.serving.refusals import Refusal
    from kiln.runtime.serving.tensors import datatype_of

    name = expected["name"]
    if actual is None:
        return f"the model answered no output {_shown(name)}"
    actual = np.asarray(actual)
    datatype = datatype_of(actual)
    if expected.get("datatype") is not None and expected["datatype"] != datatype:
        return f"output {_shown(name)} has datatype {datatype}, expected {expected['datatype']}"
    shape = expected.get("shape")
    if shape is not None and list(shape) != list(actual.shape):
        return f"output {_shown(name)} has shape {list(actual.shape)}, expected {list(shape)}"
    try:
        want = protocol.json_tensor(name, expected["data"], list(actual.shape), datatype, DATATYPES[datatype],
                                    what="expected output")
    except Refusal as e:
        return e.message
    return differs(name, actual, want, tolerance)


def differs(name: str, actual: np.ndarray, expected: np.ndarray, tolerance: Tolerance) -> str | None:
    """numpy.allclose(actual, expected, rtol, atol, equal_nan=True), and when it fails, the
    largest difference among the elements that are not close, where, and how many."""
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    close = np.isclose(a, e, rtol=tolerance.relative, atol=tolerance.absolute, equal_nan=True)
    if close.all():
        return None
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - e)
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN against a number: as far as can be
    worst = np.unravel_index(int(np.argmax(np.where(close, -1.0, diff))), a.shape)
    at = list(map(int, worst))
    return (f"output {_shown(name)} differs from the expected: max abs difference {diff[worst]:.3g} > tolerance "
            f"({tolerance}); at {at}: {_value(a[worst])}, expected {_value(e[worst])}; "
            f"{int((~close).sum())} of {close.size} value(s) differ")


def _value(v: float) -> str:
    return f"{v:.6g}"


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:79] + "…\""
