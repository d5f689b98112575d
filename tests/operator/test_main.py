"""`kiln operator` flags -> the operator's configuration and kopf settings."""

from __future__ import annotations

import argparse

import pytest

from kiln.operator import main


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    main.configure(p)
    return p.parse_args(list(argv))


def test_defaults():
    args = parse()
    cfg = main.config_from_args(args)
    assert cfg.backend_versions == {"tensorrt": "10.13.0", "onnxruntime": "1.32.0",
                                    "onnxruntime-cuda": "1.31.1+cuda13.0"}
    assert cfg.backend_version("onnxruntime", "sm90") == "1.31.1+cuda13.0"
    assert cfg.default_targets == ("sm90",)
    assert cfg.cache_claim == "kiln-engine-cache"
    assert (args.liveness, args.standalone, args.peering, args.namespace) == (
        "http://0.0.0.0:8080/healthz", False, None, [])


def test_flags_as_the_chart_writes_them():
    cfg = main.config_from_args(parse("--backend-version=tensorrt=10.14.1", "--default-targets=sm90,sm80",
                                      "--default-target", "L4", "--builder-image=b:1", "--runtime-image=r:1",
                                      "--cache-claim=c", "--namespace=a", "--namespace=b"))
    assert cfg.backend_versions["tensorrt"] == "10.14.1" and cfg.backend_versions["onnxruntime"] == "1.32.0"
    assert cfg.default_targets == ("sm90", "sm80", "L4")
    assert (cfg.builder_image, cfg.runtime_image, cfg.cache_claim) == ("b:1", "r:1", "c")


def test_bad_flags_are_refused():
    with pytest.raises(SystemExit):
        parse("--backend-version", "tensorrt")
    with pytest.raises(SystemExit):
        parse("--standalone", "--peering", "p")
    with pytest.raises(SystemExit):
        parse("--namespace", "a", "--all-namespaces")
    assert main.run(parse("--default-target", "Z9000")) == 2


def test_kopf_settings():
    import logging

    import kopf

    s = main.settings()
    assert s.posting.level == logging.WARNING
    assert isinstance(s.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert s.persistence.finalizer == "kiln.dev/finalizer"
    assert s.watching.server_timeout == main.WATCH_SERVER_TIMEOUT
