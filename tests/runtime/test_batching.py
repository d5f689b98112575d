"""Batch formation and tensor join/split, as pure functions (Triton's dynamic batcher rules)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.api.spec import runtime_with_defaults
from kiln.runtime.serving.scheduling.batching import BatchingConfig, concat, plan, request_rows, signature, split


def take(rows, waited=0.0, max_rows=8, preferred=(), max_delay=0.001, flush=False):
    return plan(iter(rows), waited, max_rows=max_rows, preferred=preferred, max_delay=max_delay,
                flush=flush)


class TestPlan:
    def test_waits_while_below_every_size_and_within_the_delay(self):
        assert take([1, 2]) == 0

    def test_full_batch_goes_at_once(self):
        assert take([4, 4, 1]) == 2

    def test_batch_goes_when_the_next_request_would_not_fit(self):
        assert take([3, 3, 3]) == 2  # 6 rows; a third request would make 9 > 8

    def test_delay_reached_takes_everything_that_fits(self):
        assert take([1, 2], waited=0.001) == 2

    def test_largest_reachable_preferred_size_goes_at_once(self):
        assert take([1, 1, 2, 1], preferred=(2, 4)) == 3  # 1+1+2 = 4
        assert take([2, 1], preferred=(2, 4)) == 1  # 2, then 3: the prefix reaching 2 goes
        assert take([1, 2], preferred=(2, 4)) == 0  # 1, then 3: no preferred size is reached

    def test_flush_takes_what_is_queued(self):
        assert take([1], flush=True) == 1

    def test_reads_only_as_far_as_a_batch_can_reach(self):
        def endless():
            while True:
                yield 1
        assert plan(endless(), 0.0, max_rows=8, max_delay=1.0) == 8

    def test_rejects_a_nonsense_maximum(self):
        with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
            take([1], max_rows=0)


def batching_spec(batching: dict) -> dict:
    """spec.runtime.batching with the CRD's defaults applied, as `kiln serve` reads it."""
    return runtime_with_defaults({"batching": batching})["batching"]


class TestConfig:
    def test_defaults_are_the_documented_ones(self):
        c = BatchingConfig.from_spec(batching_spec({}))
        assert c == BatchingConfig(enabled=True, max_batch_size=32, preferred_batch_sizes=(),
                                   max_queue_delay=0.0, max_queue_size=1024,
                                   max_admission_wait=0.1)

    def test_reads_the_manifest_keys(self):
        c = BatchingConfig.from_spec(batching_spec({"enabled": False, "maxBatchSize": 64,
                                                    "preferredBatchSizes": [32, 16, 32],
                                                    "maxQueueDelayMicroseconds": 2500, "maxQueueSize": 10}))
        assert c == BatchingConfig(False, 64, (16, 32), 0.0025, 10, 0.1)

    def test_a_key_the_crd_defaults_is_required(self):
        # The defaults come from the CRD once (`kiln serve` applies them), never from here.
        with pytest.raises(ValueError, match=r"^runtime\.batching\.maxQueueSize is missing: "):
            BatchingConfig.from_spec({k: v for k, v in batching_spec({}).items() if k != "maxQueueSize"})
        with pytest.raises(ValueError, match=r"runtime\.batching\.enabled, .* are missing"):
            BatchingConfig.from_spec(None)


class TestTensors:
    def test_concat_then_split_gives_each_request_its_rows(self):
        a = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
        b = {"x": np.arange(6, 9, dtype=np.float32).reshape(1, 3)}
        joined = concat([a, b])
        np.testing.assert_array_equal(joined["x"], np.arange(9, dtype=np.float32).reshape(3, 3))
        parts = split({"y": joined["x"] * 2}, [2, 1])
        np.testing.assert_array_equal(parts[0]["y"], a["x"] * 2)
        np.testing.assert_array_equal(parts[1]["y"], b["x"] * 2)

    def test_split_refuses_outputs_that_do_not_add_up(self):
        with pytest.raises(ValueError, match="output 'y' has batch dimension 4 for a batch of 3 rows"):
            split({"y": np.zeros((4, 2))}, [2, 1])

    def test_signature_ignores_dim0_only(self):
        x = np.zeros((2, 3), np.float32)
        assert signature({"x": x}) == signature({"x": np.ones((5, 3), np.float32)})
        assert signature({"x": x}) != signature({"x": np.zeros((2, 4), np.float32)})
        assert signature({"x": x}) != signature({"x": np.zeros((2, 3), np.float64)})

    def test_request_rows_needs_one_batch_size(self):
        assert request_rows({"a": np.zeros((3, 2)), "b": np.zeros((3,))}) == 3
        with pytest.raises(ValueError, match="input 'a' is a scalar"):
            request_rows({"a": np.float32(1.0) * np.ones(())})
