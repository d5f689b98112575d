"""Write the demo's ONNX model, `model.onnx`, next to this script (deterministic bytes).

An Iris flower classifier: nearest class centroid, written as one linear layer. For a
flower x (sepal length, sepal width, petal length, petal width, in cm) the score of
species k is -|x - mu_k|^2 = 2 mu_k . x - |mu_k|^2 - |x|^2; the last term is the same for
every species, so a MatMul + Add gives scores that order the species like the distances
do, Softmax turns them into probabilities and ArgMax picks the species. The centroids are
the per-species means of Fisher's Iris data set (50 flowers each).

    inputs:  features       FP32 [batch, 4]
    outputs: probabilities  FP32 [batch, 3]   setosa, versicolor, virginica
             species        INT64 [batch]     index of the most likely species

The manifest pins the file's sha256: regenerate with the pinned `onnx` and, if the bytes
change, update `spec.model.sha256` in inferencemodel.yaml.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SPECIES = ["setosa", "versicolor", "virginica"]
CENTROIDS = np.array([
    [5.006, 3.428, 1.462, 0.246],  # setosa
    [5.936, 2.770, 4.260, 1.326],  # versicolor
    [6.588, 2.974, 5.552, 2.026],  # virginica
], dtype=np.float32)


def build() -> onnx.ModelProto:
    weights = (2.0 * CENTROIDS.T).astype(np.float32)  # [4, 3]
    bias = (-(CENTROIDS ** 2).sum(axis=1)).astype(np.float32)  # [3]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "weights"], ["projected"]),
            helper.make_node("Add", ["projected", "bias"], ["scores"]),
            helper.make_node("Softmax", ["scores"], ["probabilities"], axis=1),
            helper.make_node("ArgMax", ["scores"], ["species"], axis=1, keepdims=0),
        ],
        "iris_centroids",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("species", TensorProto.INT64, ["batch"])],
        initializer=[numpy_helper.from_array(weights, "weights"),
                     numpy_helper.from_array(bias, "bias")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="kiln-demo", producer_version="1")
    model.ir_version = 8
    helper.set_model_props(model, {"labels": ",".join(SPECIES)})
    onnx.checker.check_model(model)
    return model


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0]) if argv else Path(__file__).with_name("model.onnx")
    out.write_bytes(build().SerializeToString())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
