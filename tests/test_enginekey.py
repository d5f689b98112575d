"""The engine key: same inputs, same key; any input that changes the engine, a new key."""

import pytest

from kiln.runtime.api import enginekey

MODEL = {"uri": "pvc://models/resnet50/model.onnx", "version": "1.0"}
ENGINE = {
    "backend": "tensorrt",
    "precision": "fp16",
    "workspaceMiB": 4096,
    "profiles": [
        {"input": "images", "min": [1, 3, 224, 224], "opt": [8, 3, 224, 224], "max": [32, 3, 224, 224]},
    ],
}


def key(model=MODEL, engine=ENGINE, target="sm90", version="10.13.0"):
    return enginekey.key_inputs(model, engine, target, version).key


class TestKey:
    def test_stable_and_short(self):
        k = key()
        assert k == key()
        assert len(k) == enginekey.KEY_LENGTH and int(k, 16) >= 0

    @pytest.mark.parametrize("change", [
        {"model": {**MODEL, "version": "1.1"}},
        {"model": {**MODEL, "sha256": "a" * 64}},
        {"engine": {**ENGINE, "precision": "fp32"}},
        {"engine": {**ENGINE, "backend": "onnxruntime"}},
        {"engine": {**ENGINE, "workspaceMiB": 8192}},
        {"engine": {**ENGINE, "builderFlags": {"sparsity": True}}},
        {"engine": {**ENGINE, "profiles": [{**ENGINE["profiles"][0], "max": [64, 3, 224, 224]}]}},
        {"target": "sm80"},
        {"version": "10.14.0"},
    ])
    def test_every_input_changes_the_key(self, change):
        assert key(**change) != key()

    def test_pinned_digest_identifies_by_content(self):
        pinned = {**MODEL, "sha256": "AB" * 32}
        moved = {**pinned, "uri": "s3://bucket/elsewhere.onnx", "version": "renamed"}
        assert key(model=pinned) == key(model=moved)

    def test_profile_order_does_not_matter(self):
        a = {"input": "a", "min": [1], "opt": [2], "max": [3]}
        b = {"input": "b", "min": [1], "opt": [4], "max": [8]}
        assert key(engine={**ENGINE, "profiles": [a, b]}) == key(engine={**ENGINE, "profiles": [b, a]})

    def test_products_map_to_their_architecture(self):
        assert key(target="H100") == key(target="sm90") == key(target="9.0")
        assert key(target="NVIDIA-H100-80GB-HBM3") == key(target="sm90")


class TestTargets:
    @pytest.mark.parametrize("given, expected", [
        ("cpu", "cpu"), ("SM86", "sm86"), ("8.9", "sm89"), ("L4", "sm89"),
        ("A100", "sm80"), ("NVIDIA-A10G", "sm86"), ("H200", "sm90"),
    ])
    def test_normalize(self, given, expected):
        assert enginekey.normalize_target(given) == expected

    def test_unknown_target_says_what_is_accepted(self):
        with pytest.raises(ValueError, match=r"unknown target 'Z80'.*'sm90'.*H100"):
            enginekey.normalize_target("Z80")
