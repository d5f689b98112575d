"""The scheduler over the real ONNX Runtime backend: what a caller of `submit()` sees.

Models are generated with onnx.helper (fixed seeds) and every output is compared with an
ONNX Runtime session run directly on the same model. Batch formation is driven by an
injected clock that only moves when a test moves it, so no test depends on timing.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.runtime.api.spec import runtime_with_defaults
from kiln.runtime.engine.backends import get_backend
from kiln.runtime.engine.backends.base import BackendError, BuildOptions, ShapeRange
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.scheduling.errors import ExecutionFailed, InvalidBatch, Overloaded, ShuttingDown
from kiln.runtime.serving.scheduling.scheduler import UNHEALTHY_AFTER, Scheduler

pytestmark = pytest.mark.timeout(60)

FOREVER = 3600.0  # a queue delay the fake clock never reaches unless a test moves it


# -- models and engines ------------------------------------------------------------------

def _model(nodes, inputs, outputs, initializers=()) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def mlp_model(seed: int = 0) -> bytes:
    """y = relu(x @ W1 + b1) @ W2, x: [N, 8] -> y: [N, 4]."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "W1")
    b1 = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "W2")
    return _model(
        [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["a"]),
         helper.make_node("Relu", ["a"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [w1, b1, w2])


def elementwise_model() -> bytes:
    """y = relu(x) * 2, x: [N, D] with D dynamic too (requests may differ past dim 0)."""
    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    return _model(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "two"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "D"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "D"])], [two])


def column_sum_model() -> bytes:
    """y = sum over the batch: an output without a batch dimension, cannot be split."""
    axes = numpy_helper.from_array(np.array([0], dtype=np.int64), "axes")
    return _model(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])], [axes])


def embedding_model() -> bytes:
    """y = E[ids], ids: [N, 2] INT64 into 10 rows -> y: [N, 2, 4]; an id past 9 is refused."""
    e = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "E")
    return _model([helper.make_node("Gather", ["E", "ids"], ["y"], axis=0)],
                  [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 2])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 4])], [e])


def load_engine(onnx_bytes: bytes, profiles=None):
    backend = get_backend("onnxruntime")
    return backend.load(backend.build(onnx_bytes, BuildOptions()), profiles or {})


def ort_direct(onnx_bytes: bytes, inputs: dict) -> dict:
    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


class FlakyEngine:
    """Test-only: wraps a real ONNX Runtime engine; its contexts fail on demand.

    `fail_next` failures are raised by the next runs (any context); `poison` fails every
    run of a batch holding that value. Counts contexts created, to show that recovery
    recreates contexts and never reloads the engine.
    """

    def __init__(self, engine):
        self.engine = engine
        self.inputs, self.outputs, self.profiles = engine.inputs, engine.outputs, engine.profiles
        self.fail_next = 0
        self.poison: float | None = None
        self.gate: threading.Event | None = None  # when set, runs wait for it to open
        self.contexts_created = 0

    def create_context(self):
        self.contexts_created += 1
        return _FlakyContext(self, self.engine.create_context())

    def close(self):
        self.engine.close()


class _FlakyContext:
    def __init__(self, owner: FlakyEngine, ctx):
        self.owner, self.ctx, self.closed = owner, ctx, False

    def run(self, inputs):
        if self.closed:
            raise BackendError("context used after close")
        if self.owner.gate is not None:
            self.owner.gate.wait(timeout=30)
        if self.owner.fail_next > 0:
            self.owner.fail_next -= 1
            raise BackendError("injected failure: device lost")
        if self.owner.poison is not None and any((a == self.owner.poison).any() for a in inputs.values()):
            raise BackendError("injected failure: poisoned batch")
        return self.ctx.run(inputs)

    def close(self):
        self.closed = True
        self.ctx.close()


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rows(n: int, seed: int, width: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def sample(metrics: ServerMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model": "m", **labels}) or 0.0


def batch_sizes(metrics: ServerMetrics) -> tuple[float, float]:
    """(number of batches, total rows) from the kiln_batch_size histogram."""
    return sample(metrics, "kiln_batch_size_count"), sample(metrics, "kiln_batch_size_sum")


async def settle(times: int = 20) -> None:
    """Let the event loop and the context threads make progress."""
    for _ in range(times):
        await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def mlp():
    return mlp_model()


async def started(engine, spec, clock=None, key="key-a") -> tuple[Scheduler, ServerMetrics]:
    metrics = ServerMetrics()
    kwargs = {"clock": clock} if clock is not None else {}
    s = Scheduler(engine, runtime_with_defaults(spec), metrics, "m", key, **kwargs)
    await s.start()
    return s, metrics


# -- correctness under concurrency --------------------------------------------------------

async def test_concurrent_mixed_batch_sizes_match_ort_direct(mlp):
    s, metrics = await started(load_engine(mlp), {
        "contextsPerGPU": 2,
        "batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 5000}})
    requests = [rows(1 + i % 6, seed=i) for i in range(60)]
    results = await asyncio.gather(*(s.submit({"x": x}) for x in requests))
    for x, got in zip(requests, results):
        assert got["y"].shape == (len(x), 4)
        np.testing.assert_allclose(got["y"], ort_direct(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-6)
    count, total = batch_sizes(metrics)
    assert total == sum(len(x) for x in requests)
    assert count < len(requests)  # requests were batched together
    assert sample(metrics, "kiln_executions_total", outcome="success") == count
    assert sample(metrics, "kiln_inflight_requests") == 0
    assert sample(metrics, "kiln_queue_depth") == 0
    await s.close(5)


async def test_requests_differing_past_dim0_never_share_a_batch():
    model = elementwise_model()
    clock = FakeClock()
    s, metrics = await started(load_engine(model), {
        "batching": {"maxBatchSize": 8, "maxQueueDelayMicroseconds": 10_000}}, clock)
    narrow = [rows(2, seed=i, width=3) for i in range(3)]
    wide = [rows(1, seed=10 + i, width=5) for i in range(3)]
    tasks = [asyncio.create_task(s.submit({"x": x})) for pair in zip(narrow, wide) for x in pair]
    await settle(2)
    assert not any(t.done() for t in tasks)
    clock.now += 1.0  # past the queue delay: each group goes as one batch
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    inputs = [x for pair in zip(narrow, wide) for x in pair]
    for x, got in zip(inputs, results):
        np.testing.assert_array_equal(got["y"], ort_direct(model, {"x": x})["y"])
    count, total = batch_sizes(metrics)
    assert (count, total) == (2, 6 + 3)  # narrow (6 rows), wide (3 rows)
    await s.close(5)


async def test_batching_disabled_runs_each_request_alone(mlp):
    s, metrics = await started(load_engine(mlp), {"batching": {"enabled": False}})
    requests = [rows(n, seed=n) for n in (1, 3, 2, 5)]
    results = await asyncio.gather(*(s.submit({"x": x}) for x in requests))
    for x, got in zip(requests, results):
        np.testing.assert_allclose(got["y"], ort_direct(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-6)
    assert batch_sizes(metrics) == (4, 11)
    await s.close(5)


# -- batch formation -----------------------------------------------------------------------

async def test_batch_forms_when_rows_reach_max_batch_size(mlp):
    clock = FakeClock()  # never moves: only the size can dispatch
    s, metrics = await started(load_engine(mlp), {
        "batching": {"maxBatchSize": 4, "maxQueueDelayMicroseconds": 10_000_000}}, clock)
    first = [asyncio.create_task(s.submit({"x": rows(1, seed=i)})) for i in range(3)]
    await settle()
    assert not any(t.done() for t in first)
    assert sample(metrics, "kiln_queue_depth") == 3
    last = await s.submit({"x": rows(1, seed=3)})
    await asyncio.gather(*first)
    assert last["y"].shape == (1, 4)
    assert batch_sizes(metrics) == (1, 4)
    await s.close(5)


async def test_batch_forms_when_oldest_request_waited_max_queue_delay(mlp):
    clock = FakeClock()
    s, metrics = await started(load_engine(mlp), {
        "batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 2_000_000}}, clock)
    a = asyncio.create_task(s.submit({"x": rows(2, seed=1)}))
    await settle()
    assert not a.done()  # 2 of 16 rows, and no time has passed
    clock.now += 1.5
    b = asyncio.create_task(s.submit({"x": rows(1, seed=2)}))
    await settle()
    assert not a.done() and not b.done()  # 1.5 s of a 2 s delay
    clock.now += 0.5
    await asyncio.wait_for(asyncio.gather(a, b), timeout=10)  # the batcher re-checks the clock
    assert batch_sizes(metrics) == (1, 3)
    # queue time comes from the injected clock: a waited 2 s, b 0.5 s
    assert sample(metrics, "kiln_queue_duration_seconds_sum") == pytest.approx(2.5)
    await s.close(5)


async def test_preferred_batch_size_dispatches_without_waiting(mlp):
    clock = FakeClock()
    s, metrics = await started(load_engine(mlp), {
        "batching": {"maxBatchSize": 16, "preferredBatchSizes": [4, 8],
                     "maxQueueDelayMicroseconds": 10_000_000}}, clock)
    three = [asyncio.create_task(s.submit({"x": rows(1, seed=i)})) for i in range(3)]
    await settle()
    assert not any(t.done() for t in three)  # 3 rows: neither preferred nor full
    await s.submit({"x": rows(1, seed=3)})  # 4 rows: preferred
    await asyncio.gather(*three)
    assert batch_sizes(metrics) == (1, 4)
    await s.submit({"x": rows(8, seed=4)})  # one request of a preferred size goes at once
    assert batch_sizes(metrics) == (2, 12)
    await s.close(5)


async def test_batch_is_clipped_to_the_engine_profile_max(mlp):
    clock = FakeClock()
    engine = load_engine(mlp, {"x": ShapeRange(min=(1, 8), opt=(2, 8), max=(3, 8))})
    s, metrics = await started(engine, {
        "batching": {"maxBatchSize": 16, "maxQueueDelayMicroseconds": 10_000_000}}, clock)
    assert s.max_rows == 3
    results = await asyncio.gather(*(s.submit({"x": rows(1, seed=i)}) for i in range(6)))
    assert len(results) == 6
    assert batch_sizes(metrics) == (2, 6)  # two full batches of 3 rows
    with pytest.raises(InvalidBatch, match="exceeds the engine's largest profiled batch 3"):
        await s.submit({"x": rows(4, seed=0)})
    await s.close(5)


# -- utilization ---------------------------------------------------------------------------

async def test_busy_seconds_rate_is_the_fraction_of_contexts_in_use(mlp):
    """kiln_engine_busy_seconds_total: the autoscaler's signal on every backend. One of two
    contexts busy for 10 s adds 5 s (half the capacity); both busy for 10 s add 10 s."""
    clock, engine = FakeClock(), FlakyEngine(load_engine(mlp))
    metrics = ServerMetrics()
    s = Scheduler(engine, runtime_with_defaults({"batching": {"enabled": False}, "contextsPerGPU": 2}), metrics,
                  "m", "key-a", clock=clock, version="7")
    await s.start()
    busy = lambda: metrics.registry.get_sample_value("kiln_engine_busy_seconds_total",  # noqa: E731
                                                     {"model": "m", "version": "7"})
    assert busy() == 0.0
    for concurrent, added in ((1, 5.0), (2, 10.0)):
        engine.gate = threading.Event()
        before = busy()
        pending = [asyncio.ensure_future(s.submit({"x": rows(1, seed=i)})) for i in range(concurrent)]
        await settle()
        clock.now += 10
        engine.gate.set()
        await asyncio.gather(*pending)
        assert busy() - before == pytest.approx(added)
    await s.close(5)


# -- refusals ------------------------------------------------------------------------------

async def test_request_above_max_batch_size_is_invalid(mlp):
    s, _ = await started(load_engine(mlp), {"batching": {"maxBatchSize": 4}})
    with pytest.raises(InvalidBatch, match="batch of 5 rows exceeds maxBatchSize 4"):
        await s.submit({"x": rows(5, seed=0)})
    await s.close(5)


async def test_inputs_that_disagree_on_batch_size_are_invalid():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])
    model = _model([helper.make_node("Add", ["x", "z"], ["y"])], [x, z], [y])
    s, _ = await started(load_engine(model), {})
    with pytest.raises(InvalidBatch, match=r"disagree on the batch size \(dimension 0\): x: 2, z: 3"):
        await s.submit({"x": rows(2, 0, 2), "z": rows(3, 1, 2)})
    await s.close(5)


async def test_full_queue_answers_overloaded_with_retry_after(mlp):
    clock = FakeClock()
    s, metrics = await started(load_engine(mlp), {
        "batching": {"maxBatchSize": 16, "maxQueueSize": 2,
                     "maxQueueDelayMicroseconds": 10_000_000}}, clock)
    waiting = [asyncio.create_task(s.submit({"x": rows(1, seed=i)})) for i in range(2)]
    await settle()
    with pytest.raises(Overloaded) as raised:
        await s.submit({"x": rows(1, seed=2)})
    assert raised.value.retry_after > 0
    assert "too many requests waiting" in str(raised.value)
    # Shutting down drains the queue: both waiting requests are answered.
    await s.close(5)
    assert [len(t.result()["y"]) for t in waiting] == [1, 1]
    with pytest.raises(ShuttingDown, match="shutting down"):
        await s.submit({"x": rows(1, seed=3)})
    assert not s.healthy


# -- failures ------------------------------------------------------------------------------

async def test_failed_batch_fails_only_its_own_requests(mlp):
    engine = FlakyEngine(load_engine(mlp))
    engine.poison = 999.0
    clock = FakeClock()
    s, metrics = await started(engine, {
        "contextsPerGPU": 1,
        "batching": {"maxBatchSize": 2, "maxQueueDelayMicroseconds": 10_000_000}}, clock)
    poisoned = rows(1, seed=0)
    poisoned[0, 0] = 999.0
    inputs = [poisoned, rows(1, seed=1), rows(1, seed=2), rows(1, seed=3)]  # batches [0,1], [2,3]
    results = await asyncio.gather(*(s.submit({"x": x}) for x in inputs), return_exceptions=True)
    for r in results[:2]:
        assert isinstance(r, ExecutionFailed)
        assert str(r) == ("execution failed after 3 attempts: BackendError: "
                          "injected failure: poisoned batch")
    for x, r in zip(inputs[2:], results[2:]):
        np.testing.assert_allclose(r["y"], ort_direct(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-6)
    assert sample(metrics, "kiln_executions_total", outcome="retried") == 2
    assert sample(metrics, "kiln_executions_total", outcome="failed") == 1
    assert sample(metrics, "kiln_executions_total", outcome="success") == 1
    assert s.healthy  # one failed batch is not an unhealthy model
    await s.close(5)


async def test_failed_execution_recreates_the_context_and_retries(mlp):
    """A context fails once (injected, test-only wrapper over the real engine): the request
    still gets the right answer, from a recreated context of the same loaded engine."""
    engine = FlakyEngine(load_engine(mlp))
    s, metrics = await started(engine, {"contextsPerGPU": 2})
    assert engine.contexts_created == 2
    engine.fail_next = 1
    x = rows(3, seed=7)
    got = await s.submit({"x": x})
    np.testing.assert_allclose(got["y"], ort_direct(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-6)
    assert sample(metrics, "kiln_context_recreations_total") == 1
    assert engine.contexts_created == 3  # one new context; the engine was loaded once
    assert sample(metrics, "kiln_executions_total", outcome="retried") == 1
    assert sample(metrics, "kiln_executions_total", outcome="success") == 1
    assert sample(metrics, "kiln_context_recovery_seconds_count") == 1
    assert s.last_recovery_seconds is not None and s.last_recovery_seconds > 0
    assert s.healthy
    await s.close(5)


async def test_health_turns_false_after_consecutive_failed_batches_and_back(mlp):
    engine = FlakyEngine(load_engine(mlp))
    s, metrics = await started(engine, {"contextsPerGPU": 1, "batching": {"enabled": False}})
    engine.fail_next = 3 * 3 - 1  # three batches x three attempts, less one
    for _ in range(2):
        with pytest.raises(ExecutionFailed):
            await s.submit({"x": rows(1, seed=0)})
    await s.submit({"x": rows(1, seed=0)})  # its third attempt succeeds
    assert s.healthy
    engine.fail_next = 9
    for _ in range(3):
        with pytest.raises(ExecutionFailed, match="injected failure: device lost"):
            await s.submit({"x": rows(1, seed=0)})
    assert not s.healthy
    x = rows(2, seed=5)
    got = await s.submit({"x": x})  # a later success: healthy again
    np.testing.assert_allclose(got["y"], ort_direct(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-6)
    assert s.healthy
    assert sample(metrics, "kiln_executions_total", outcome="failed") == 5
    await s.close(5)


async def test_inputs_the_engine_refuses_fail_their_own_request_and_not_the_health():
    """Issue 19, item 4: the engine refusing a request's data (an id outside the embedding)
    is that request's 400 (InvalidBatch), not retried on fresh contexts, never counted
    toward health; the requests batched with it are run again without it."""
    model = embedding_model()
    clock = FakeClock()
    s, metrics = await started(load_engine(model), {
        "contextsPerGPU": 1,
        "batching": {"maxBatchSize": 3, "maxQueueDelayMicroseconds": 10_000_000}}, clock)
    ids = [np.array([[1, 2]]), np.array([[3, 10]]), np.array([[9, 0]])]  # one batch of three
    results = await asyncio.gather(*(s.submit({"ids": i}) for i in ids), return_exceptions=True)
    assert isinstance(results[1], InvalidBatch), results[1]
    assert str(results[1]).startswith("ONNX Runtime refused the inputs: ") and \
        "indices element out of data bounds, idx=10" in str(results[1])
    for i in (0, 2):
        np.testing.assert_array_equal(results[i]["y"], ort_direct(model, {"ids": ids[i]})["y"])
    assert sample(metrics, "kiln_executions_total", outcome="refused") == 2
    await s.close(5)

    s, metrics = await started(load_engine(model), {"contextsPerGPU": 1})
    for _ in range(2 * UNHEALTHY_AFTER):
        with pytest.raises(InvalidBatch, match="idx=10"):
            await s.submit({"ids": ids[1]})
    assert s.healthy
    assert sample(metrics, "kiln_context_recreations_total") == 0
    assert sample(metrics, "kiln_executions_total", outcome="failed") == 0
    await s.close(5)


async def test_output_without_batch_dimension_cannot_be_split():
    clock = FakeClock()
    s, _ = await started(load_engine(column_sum_model()), {
        "batching": {"maxBatchSize": 2, "maxQueueDelayMicroseconds": 10_000_000}}, clock)
    results = await asyncio.gather(*(s.submit({"x": rows(1, seed=i)}) for i in range(2)),
                                   return_exceptions=True)
    for r in results:
        assert isinstance(r, ExecutionFailed)
        assert str(r) == ("output 'y' has batch dimension 8 for a batch of 2 rows from "
                          "2 requests; cannot split it back")
    await s.close(5)


# -- cancellation and shutdown -------------------------------------------------------------

async def test_cancelled_request_leaves_the_queue_before_batching(mlp):
    clock = FakeClock()
    s, metrics = await started(load_engine(mlp), {
        "batching": {"maxBatchSize": 2, "maxQueueDelayMicroseconds": 10_000_000}}, clock)
    gone = asyncio.create_task(s.submit({"x": rows(1, seed=0)}))
    await settle()
    gone.cancel()  # the client disconnected
    await settle()
    assert sample(metrics, "kiln_requests_total", outcome="cancelled") == 1
    assert sample(metrics, "kiln_queue_depth") == 0
    assert sample(metrics, "kiln_inflight_requests") == 0
    xs = [rows(1, seed=1), rows(1, seed=2)]
    results = await asyncio.gather(*(s.submit({"x": x}) for x in xs))
    for x, got in zip(xs, results):
        np.testing.assert_allclose(got["y"], ort_direct(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-6)
    assert batch_sizes(metrics) == (1, 2)  # the cancelled row never ran
    await s.close(5)


async def test_close_fails_what_the_drain_timeout_leaves(mlp):
    engine = FlakyEngine(load_engine(mlp))
    s, _ = await started(engine, {"contextsPerGPU": 1, "batching": {"enabled": False}})
    engine.gate = threading.Event()  # the only context is stuck in its first batch
    running = asyncio.create_task(s.submit({"x": rows(1, seed=0)}))
    queued = asyncio.create_task(s.submit({"x": rows(1, seed=1)}))
    await settle()
    await s.close(0.05)
    with pytest.raises(ExecutionFailed, match="shut down before the batch finished"):
        await running
    with pytest.raises(ShuttingDown):
        await queued
    engine.gate.set()
    await settle()


# -- result cache --------------------------------------------------------------------------

async def test_result_cache_answers_repeated_inputs_without_executing(mlp):
    s, metrics = await started(load_engine(mlp), {"resultCache": {"enabled": True}})
    x = rows(2, seed=3)
    first = await s.submit({"x": x})
    first["y"][:] = 0  # a caller scribbling on its result must not reach the cache
    second = await s.submit({"x": x.copy()})
    np.testing.assert_allclose(second["y"], ort_direct(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-6)
    assert sample(metrics, "kiln_executions_total", outcome="success") == 1
    assert sample(metrics, "kiln_result_cache_requests_total", result="hit") == 1
    assert sample(metrics, "kiln_result_cache_requests_total", result="miss") == 1
    assert sample(metrics, "kiln_result_cache_bytes") == 2 * 4 * 4
    await s.close(5)


# -- configuration -------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ({"contextsPerGPU": 0}, "contextsPerGPU must be an integer from 1 to 16, got 0"),
    ({"batching": {"maxBatchSize": 0}}, "batching.maxBatchSize must be from 1 to 4096, got 0"),
    ({"batching": {"maxBatchSize": 4, "preferredBatchSizes": [8]}},
     r"batching.preferredBatchSizes\[\] must be from 1 to 4, got 8"),
    ({"batching": {"maxQueueDelayMicroseconds": -1}},
     "batching.maxQueueDelayMicroseconds must be >= 0, got -1"),
    ({"batching": {"maxQueueSize": True}}, "batching.maxQueueSize must be an integer, got True"),
    ({"batching": {"maxBatch": 4}}, r"runtime.batching has unknown keys \['maxBatch'\]"),
    ({"resultCache": {"maxMiB": 0}}, "resultCache.maxMiB must be a positive integer, got 0"),
])
def test_bad_runtime_spec_is_refused_with_a_clear_message(mlp, spec, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(load_engine(mlp), runtime_with_defaults(spec), ServerMetrics(), "m", "key-a")


def test_a_runtime_spec_without_the_crds_defaults_is_refused_naming_the_key(mlp):
    # The defaults come from the CRD once (`kiln serve` applies them), never from here.
    spec = runtime_with_defaults()
    del spec["contextsPerGPU"]
    with pytest.raises(ValueError, match=r"^runtime\.contextsPerGPU is missing: "):
        Scheduler(load_engine(mlp), spec, ServerMetrics(), "m", "key-a")
