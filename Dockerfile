# syntax=docker/dockerfile:1
# Kiln's two images, one file:
#   docker build --target operator -t ghcr.io/kiln-dev/kiln-operator:0.1.0 .
#   docker build --target runtime  -t ghcr.io/kiln-dev/kiln-runtime:0.1.0 .
# The runtime image builds engines (`kiln build`) and serves them (`kiln serve`). Its
# TensorRT version is part of every engine key: keep the chart's
# operator.backendVersions.tensorrt equal to what TENSORRT_IMAGE ships.

ARG PYTHON_IMAGE=python:3.11-slim
ARG TENSORRT_IMAGE=nvcr.io/nvidia/tensorrt:25.08-py3

# ------------------------------------------------------------------------------ operator
# kopf and the Kubernetes client only: no ONNX Runtime, no TensorRT.
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY . /src
RUN pip install "/src[operator]" && rm -rf /src
# A numeric non-root user (the chart sets runAsNonRoot and a read-only root filesystem).
USER 65532:65532
ENV HOME=/tmp
ENTRYPOINT ["kiln", "operator"]

# ------------------------------------------------------------------------------ runtime
# NVIDIA's TensorRT container: CUDA, TensorRT and its Python bindings; Kiln on top.
FROM ${TENSORRT_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1
COPY . /src
# [gpu], not [runtime]: onnxruntime-gpu (the CUDA provider, CPU engines too) instead of the
# CPU-only onnxruntime; both install the module `onnxruntime`.
RUN python3 -m pip install "/src[gpu]" && rm -rf /src \
    && python3 -c "import tensorrt; print('TensorRT', tensorrt.__version__)" \
    && python3 -c "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()"
USER 65532:65532
ENV HOME=/tmp
EXPOSE 8080
ENTRYPOINT ["kiln"]
CMD ["serve"]
