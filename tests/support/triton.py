"""What the tests that drive Kiln with Triton's own client (tritonclient.grpc) share."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as tritonclient


def triton_inputs(inputs: dict[str, np.ndarray]) -> list:
    out = []
    for name, array in inputs.items():
        i = tritonclient.InferInput(name, list(array.shape),
                                    {np.float32: "FP32", np.int64: "INT64"}[array.dtype.type])
        i.set_data_from_numpy(array)
        out.append(i)
    return out
