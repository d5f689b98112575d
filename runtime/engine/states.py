"""A stateful model's state pairs (spec.runtime.sequences.states) against an engine's
tensors: checked when a build publishes the engine and again when a pod loads it."""

from __future__ import annotations

from typing import Sequence

from kiln.runtime.engine.backends.base import TensorSpec


def describe_tensor(spec: TensorSpec) -> str:
    """A tensor as messages show it: `FP32 [1, -1, 8]`."""
    return f"{spec.datatype} {list(spec.shape)}"


def check_pairs(states: Sequence[tuple[str, str]], inputs: Sequence[TensorSpec],
                outputs: Sequence[TensorSpec]) -> list[str]:
    """What is wrong with the state pairs for a model with these tensors; empty when nothing.

    Each pair's input must be a model input and its output a model output, of the same
    datatype and rank, each dimension equal or dynamic (-1) on either side. A model needs
    at least one input left for the client."""
    ins = {s.name: s for s in inputs}
    outs = {s.name: s for s in outputs}
    problems = []
    for i, (inp, out) in enumerate(states):
        where = f"spec.runtime.sequences.states[{i}]"
        a, b = ins.get(inp), outs.get(out)
        if a is None:
            problems.append(f"{where}: {inp!r} is not an input of the model; its inputs are: "
                            f"{', '.join(ins) or '(none)'}")
        if b is None:
            problems.append(f"{where}: {out!r} is not an output of the model; its outputs are: "
                            f"{', '.join(outs) or '(none)'}")
        if a is None or b is None:
            continue
        pair = f"{where}: input {inp!r} ({describe_tensor(a)}) and output {out!r} " \
               f"({describe_tensor(b)})"
        if a.datatype != b.datatype:
            problems.append(f"{pair} differ in datatype: the output becomes the next step's input")
        elif len(a.shape) != len(b.shape):
            problems.append(f"{pair} differ in rank: the output becomes the next step's input")
        else:
            for d, (x, y) in enumerate(zip(a.shape, b.shape)):
                if x >= 0 and y >= 0 and x != y:
                    problems.append(f"{pair} differ in dimension {d} ({x} vs {y}): the output "
                                    f"becomes the next step's input")
                    break
    state_inputs = {i for i, _ in states}
    if ins and not set(ins) - state_inputs:
        problems.append("spec.runtime.sequences.states: every input of the model is a state; "
                        "a step needs at least one input from the client")
    return problems
