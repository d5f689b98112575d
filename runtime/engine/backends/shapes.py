"""Checks shared by the backends: do the requested shape profiles fit the model's inputs?"""

from __future__ import annotations

from typing import Mapping

from kiln.runtime.engine.backends.base import InvalidProfileError, ShapeRange


def validate_profiles(model_inputs: Mapping[str, tuple[int, ...]],
                      profiles: Mapping[str, ShapeRange], *, require_dynamic: bool) -> None:
    """Raise InvalidProfileError unless every profile names a model input and fits its shape.

    `model_inputs` maps input names to shapes with -1 for dynamic dimensions. With
    `require_dynamic`, every input with a dynamic dimension must have a profile (TensorRT
    cannot build without one).
    """
    known = ", ".join(sorted(model_inputs)) or "(none)"
    for name, r in profiles.items():
        if name not in model_inputs:
            raise InvalidProfileError(
                f"profile for input {name!r}, but the model's inputs are: {known}")
        shape = model_inputs[name]
        for label, dims in (("min", r.min), ("opt", r.opt), ("max", r.max)):
            if len(dims) != len(shape):
                raise InvalidProfileError(
                    f"input {name!r} has rank {len(shape)} {list(shape)}, but the profile's "
                    f"{label} {list(dims)} has rank {len(dims)}")
        for i, (lo, opt, hi, dim) in enumerate(zip(r.min, r.opt, r.max, shape)):
            if not 0 < lo <= opt <= hi:
                raise InvalidProfileError(
                    f"input {name!r} dimension {i}: need 0 < min <= opt <= max, got "
                    f"min {lo}, opt {opt}, max {hi}")
            if dim >= 0 and not lo == opt == hi == dim:
                raise InvalidProfileError(
                    f"input {name!r} dimension {i} is fixed at {dim} in the model, but the "
                    f"profile asks for min {lo}, opt {opt}, max {hi}")
    if require_dynamic:
        for name, shape in model_inputs.items():
            if any(d < 0 for d in shape) and name not in profiles:
                raise InvalidProfileError(
                    f"input {name!r} has dynamic shape {list(shape)}; add a profile for it "
                    f"(engine.profiles: input, min, opt, max)")
