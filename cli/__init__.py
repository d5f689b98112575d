"""Kiln: a Kubernetes operator for GPU inference."""

__version__ = "0.1.0"
