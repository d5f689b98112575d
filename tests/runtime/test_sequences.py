"""Stateful sequences (issue 13): state in, state out, kept outside the engine and the pod.

Three layers, each against real pieces:
- the core (runtime/serving/sequences/) with a numpy RNN as the engine, a MemoryStore and a
  clock the test advances: expiry, isolation, bounds, races, corruption, engine keys;
- the store: a real `redis-server` on loopback (Debian's, `make redis`), its Lua
  compare-and-set, its own TTL, and what a store that is down answers;
- the server: two ONNX models made with onnx.helper (an autoregressive one, one token per
  step, and an RNN), built by `kiln build`'s code, served over HTTP and gRPC, and
  `kiln serve` processes SIGTERMed midway through a sequence and continued on another one.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kiln.runtime.serving.refusals import Kind
from kiln.runtime.engine.backends.base import TensorSpec
from kiln.runtime.serving.protocol import decode_infer_response

from kiln.runtime.api.spec import runtime_with_defaults
from kiln.runtime.serving.sequences import stores
from kiln.runtime.serving.sequences.codec import (TOKEN_BYTES, TOKEN_OFFSET, CorruptState, StoredState,
                                                  decode_state, encode_state)
from kiln.runtime.serving.sequences.manager import SequenceManager
from kiln.runtime.serving.sequences.params import (MAX_TENANT_BYTES, SequenceError, SequenceParams,
                                                   parse_parameters, tenant_hash, tenant_of)
from kiln.runtime.engine.states import check_pairs
from kiln.runtime.serving.sequences.spec import SequenceSpec, StoreSpec
from support.sequence_models import (AR_STATES, RNN_STATES, RedisServer, autoregressive_model,
                                     build_engine_for, redis_server_binary,
                                     reference_autoregressive, rnn_model)

needs_redis = pytest.mark.skipif(redis_server_binary() is None,
                                 reason="needs redis-server (make redis)")

H, D = 6, 3
RNG = np.random.default_rng(7)
W = RNG.standard_normal((D, H)).astype(np.float32)
U = RNG.standard_normal((H, H)).astype(np.float32) * 0.5
INPUTS = [TensorSpec("x", "FP32", (1, D)), TensorSpec("h", "FP32", (1, H))]
OUTPUTS = [TensorSpec("h_next", "FP32", (1, H)), TensorSpec("y", "FP32", (1, H))]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NumpyRnn:
    """The engine for the core's tests: h_next = tanh(x W + h U), y = 2 h_next."""

    def __init__(self):
        self.calls = 0
        self.gate: asyncio.Event | None = None  # set: a step waits inside the engine

    async def __call__(self, inputs):
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        h = np.tanh(inputs["x"] @ W + inputs["h"] @ U).astype(np.float32)
        return {"h_next": h, "y": 2 * h}


def manager(store=None, clock=None, engine=None, engine_key="key-1",
            **spec_fields) -> SequenceManager:
    raw = {"states": [{"input": "h", "output": "h_next"}], **spec_fields}
    spec = SequenceSpec.from_runtime(runtime_with_defaults({"sequences": raw}))
    return SequenceManager(spec, "rnn", engine_key,
                              engine or NumpyRnn(), INPUTS, OUTPUTS, store=store,
                              clock=clock or Clock())


def x(i: int) -> dict[str, np.ndarray]:
    return {"x": np.full((1, D), 0.1 * (i + 1), dtype=np.float32)}


def reference(steps: int) -> list[np.ndarray]:
    h = np.zeros((1, H), dtype=np.float32)
    out = []
    for i in range(steps):
        h = np.tanh(x(i)["x"] @ W + h @ U).astype(np.float32)
        out.append(2 * h)
    return out


def params(seq, start=False, end=False):
    return {"sequence_id": seq, "sequence_start": start, "sequence_end": end}


async def run_steps(m, seq, first, last, tenant="", start=None, end_at=None):
    out = []
    for i in range(first, last):
        out.append((await m.step(x(i), params(seq, start=(i == first) if start is None else start,
                                              end=(i == end_at)), tenant))["y"])
    return out


async def refused(coro) -> SequenceError:
    with pytest.raises(SequenceError) as e:
        await coro
    return e.value


# ------------------------------------------------------------------ the spec and the parameters

def test_spec_defaults_and_pairs():
    spec = SequenceSpec.from_runtime(runtime_with_defaults({"sequences": {"states": RNN_STATES}}))
    assert spec.states == (("h", "h_next"),)
    assert (spec.idle_timeout, spec.max_live, spec.store.type) == (300, 1024, "memory")
    assert SequenceSpec.from_runtime({}) is None
    with pytest.raises(ValueError, match="address is required"):
        SequenceSpec.from_runtime(runtime_with_defaults({"sequences": {"states": RNN_STATES,
                                                               "store": {"type": "redis"}}}))


def test_the_spec_requires_what_the_crd_defaults():
    """The CRD's defaults are applied before the spec is read (the API server, kiln serve):
    a key the CRD defaults is required here, and a missing one is named."""
    whole = runtime_with_defaults({"sequences": {"states": RNN_STATES}})["sequences"]
    for key in ("idleTimeoutSeconds", "maxLiveSequences", "maxBytesPerSequence",
                "maxBytesTotal", "store"):
        raw = {k: v for k, v in whole.items() if k != key}
        with pytest.raises(ValueError, match=rf"^spec\.runtime\.sequences\.{key} is missing"):
            SequenceSpec.from_runtime({"sequences": raw})
    for key in ("type", "timeoutMilliseconds"):
        store = {k: v for k, v in whole["store"].items() if k != key}
        with pytest.raises(ValueError,
                           match=rf"^spec\.runtime\.sequences\.store\.{key} is missing"):
            SequenceSpec.from_runtime({"sequences": {**whole, "store": store}})


def test_check_pairs_names_both_tensors():
    ins = [TensorSpec("tok", "INT64", (1, 1)), TensorSpec("past", "FP32", (1, -1, 8)),
           TensorSpec("c", "FP16", (1, 4))]
    outs = [TensorSpec("present", "FP32", (1, -1, 8)), TensorSpec("c2", "FP32", (1, 4)),
            TensorSpec("bad", "FP32", (1, 9, 7))]
    assert check_pairs([("past", "present")], ins, outs) == []
    assert check_pairs([("c", "c2"), ("past", "bad"), ("nope", "present"), ("past", "gone")],
                          ins, outs) == [
        "spec.runtime.sequences.states[0]: input 'c' (FP16 [1, 4]) and output 'c2' (FP32 [1, 4]) "
        "differ in datatype: the output becomes the next step's input",
        "spec.runtime.sequences.states[1]: input 'past' (FP32 [1, -1, 8]) and output 'bad' "
        "(FP32 [1, 9, 7]) differ in dimension 2 (8 vs 7): the output becomes the next step's input",
        "spec.runtime.sequences.states[2]: 'nope' is not an input of the model; its inputs are: "
        "tok, past, c",
        "spec.runtime.sequences.states[3]: 'gone' is not an output of the model; its outputs are: "
        "present, c2, bad",
    ]
    assert check_pairs([("tok", "present")], ins[:1], outs)[-1] == (
        "spec.runtime.sequences.states: every input of the model is a state; a step needs "
        "at least one input from the client")


@pytest.mark.parametrize("raw,want", [
    ({}, None), ({"sequence_id": 0}, None), ({"sequence_id": ""}, None),
    ({"sequence_id": 7, "sequence_start": True}, SequenceParams("7", True, False)),
    ({"sequence_id": "chat-42", "sequence_end": True}, SequenceParams("chat-42", False, True)),
])
def test_sequence_parameters(raw, want):
    assert parse_parameters(raw) == want


@pytest.mark.parametrize("raw,fragment", [
    ({"sequence_id": True}, "positive integer or a string"),
    ({"sequence_id": -1}, "must be 1.."),
    ({"sequence_id": "a b"}, "a string id is 1 to 128 characters"),
    ({"sequence_id": 1, "sequence_start": "yes"}, "must be true or false"),
    ({"sequence_start": True}, "need a sequence_id"),
])
def test_bad_sequence_parameters_are_400(raw, fragment):
    with pytest.raises(SequenceError) as e:
        parse_parameters(raw)
    assert e.value.kind is Kind.INVALID and fragment in e.value.message


def test_tenant_is_the_header_else_the_token():
    assert tenant_of([("Kiln-Tenant", "acme")]) == "h:acme"
    assert tenant_of([("kiln-tenant", "acme")]) == "h:acme"  # gRPC metadata
    bearer = tenant_of([("Authorization", "Bearer s3cret")])
    assert bearer.startswith("t:") and "s3cret" not in bearer
    assert tenant_of([("Kiln-Tenant", "acme"), ("Authorization", "Bearer s3cret")]) == "h:acme"
    assert tenant_of([]) == ""
    assert tenant_hash("h:a") != tenant_hash("h:b")


def tenant_refusal(pairs) -> str:
    with pytest.raises(SequenceError) as e:
        tenant_of(pairs)
    assert e.value.kind is Kind.INVALID
    return e.value.message


def test_a_tenant_is_its_whole_identity():
    prefix = "spiffe://corp/" + "x" * 250
    alice, mallory = (tenant_of([("Kiln-Tenant", prefix + who)])
                      for who in ("/alice", "/mallory"))
    assert alice == "h:" + prefix + "/alice" and alice != mallory
    most = "a" * MAX_TENANT_BYTES
    assert tenant_of([("Kiln-Tenant", most)]) == "h:" + most
    assert tenant_refusal([("Kiln-Tenant", most + "a")]) == (
        "the Kiln-Tenant header has 4097 characters; a tenant has at most 4096 (it is never "
        "cut short: two tenants would become one)")
    # HTTP never delivers the spaces and tabs around a value; gRPC does: both drop them.
    assert tenant_of([("kiln-tenant", " \talice \t")]) == "h:alice"
    assert tenant_of([("Kiln-Tenant", "alice bob")]) == "h:alice bob"
    # What aiohttp and gRPC make of bytes that are not printable ASCII differs (surrogates,
    # latin-1): refused alike rather than told apart.
    for value in ("caf\u00e9", "\udcff", "\u00ff", "a\tb", "a\x01b", "a\x7fb"):
        assert tenant_refusal([("Kiln-Tenant", value)]).startswith(
            "the Kiln-Tenant header must be printable ASCII (0x20-0x7E): character "), value
    assert tenant_refusal([("Kiln-Tenant", " ")]) == (
        "the Kiln-Tenant header is empty; it names the tenant that owns the request's sequence")


def test_a_repeated_tenant_header_is_refused():
    want = ("the request has 2 Kiln-Tenant headers; it belongs to one tenant (a gateway must "
            "replace the header, not add another)")
    assert tenant_refusal([("Kiln-Tenant", "alice"), ("Kiln-Tenant", "mallory")]) == want
    assert tenant_refusal([("kiln-tenant", "alice"), ("KILN-TENANT", "alice")]) == want
    # Authorization is refused when repeated only where it is the tenant's source.
    assert tenant_refusal([("Authorization", "Bearer a"), ("authorization", "Bearer b")]) == (
        want.replace("Kiln-Tenant", "Authorization"))
    assert tenant_refusal([("Authorization", "Bearer caf\u00e9")]).startswith(
        "the Authorization header must be printable ASCII")
    assert tenant_of([("Kiln-Tenant", "acme"), ("Authorization", "a"),
                         ("Authorization", "b")]) == "h:acme"


# ------------------------------------------------------------------ the blob

def test_blob_round_trip_and_integrity():
    state = StoredState("key-1", 3, "0123456789abcdef",
                           {"h": np.arange(6, dtype=np.float32).reshape(1, 6),
                            "c": np.array([[1, 2]], dtype=np.int64)})
    blob = encode_state(state, "rnn")
    back = decode_state(blob)
    assert (back.engine_key, back.step, back.incarnation) == ("key-1", 3, "0123456789abcdef")
    assert all(np.array_equal(back.tensors[k], v) and back.tensors[k].dtype == v.dtype
               for k, v in state.tensors.items())
    assert blob[TOKEN_OFFSET:TOKEN_OFFSET + TOKEN_BYTES] == state.token
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    with pytest.raises(CorruptState, match="sha256 of the tensor bytes"):
        decode_state(bytes(flipped))
    with pytest.raises(CorruptState, match="header accounts for"):
        decode_state(blob[:-4])
    with pytest.raises(CorruptState, match="bad magic"):
        decode_state(b"nonsense" * 10)


# ------------------------------------------------------------------ the core, in memory

async def test_a_sequence_steps_and_ends():
    m = manager()
    got = await run_steps(m, 1, 0, 5, end_at=4)
    assert all(np.array_equal(a, b) for a, b in zip(got, reference(5)))
    assert m.live_sequences == 0  # ended
    e = await refused(m.step(x(5), params(1)))
    assert e.kind is Kind.NOT_FOUND and "no such sequence '1'" in e.message


async def test_state_is_not_the_clients_and_start_twice_is_400():
    m = manager()
    out = await m.step(x(0), params("s", start=True))
    assert set(out) == {"y"}  # the state output stays inside
    e = await refused(m.step(x(0), params("s", start=True)))
    assert e.kind is Kind.INVALID and "already live" in e.message
    e = await refused(m.step(x(0), {}))
    assert e.kind is Kind.INVALID and "needs parameters.sequence_id" in e.message


async def test_idle_sequences_expire_by_the_clock():
    clock = Clock()
    m = manager(clock=clock, idleTimeoutSeconds=60)
    await m.step(x(0), params(9, start=True))
    clock.now += 59
    await m.step(x(1), params(9))  # a step resets the idle time
    clock.now += 59
    await m.step(x(2), params(9))
    clock.now += 61
    assert m.sweep() == 1 and m.live_sequences == 0
    e = await refused(m.step(x(3), params(9)))
    assert e.kind is Kind.NOT_FOUND and "idle past idleTimeoutSeconds (60 s)" in e.message


async def test_tenants_are_isolated():
    m = manager()
    await m.step(x(0), params(5, start=True), tenant="h:alice")
    e = await refused(m.step(x(1), params(5), tenant="h:mallory"))
    assert e.kind is Kind.NOT_FOUND  # as if it did not exist
    await m.step(x(0), params(5, start=True), tenant="h:mallory")  # the same id is hers too
    a = await m.step(x(1), params(5), tenant="h:alice")
    assert np.array_equal(a["y"], reference(2)[1])


async def test_bounds_in_memory_are_429_with_the_reason():
    m = manager(maxLiveSequences=2)
    for s in (1, 2):
        await m.step(x(0), params(s, start=True))
    e = await refused(m.step(x(0), params(3, start=True)))
    assert e.kind is Kind.OVERLOADED and "maxLiveSequences (2)" in e.message and e.retry_after
    await m.step(x(1), params(1, end=True))
    await m.step(x(0), params(3, start=True))  # room again

    per = manager(maxBytesPerSequence=8, maxBytesTotal=100)
    e = await refused(per.step(x(0), params(1, start=True)))
    assert e.kind is Kind.OVERLOADED and "24 bytes, over maxBytesPerSequence (8)" in e.message

    total = manager(maxBytesPerSequence=24, maxBytesTotal=48)
    await total.step(x(0), params(1, start=True))
    await total.step(x(0), params(2, start=True))
    e = await refused(total.step(x(0), params(3, start=True)))
    assert e.kind is Kind.OVERLOADED and "over maxBytesTotal (48)" in e.message
    assert total.live_bytes == 48


async def test_steps_of_one_sequence_run_one_after_the_other():
    engine = NumpyRnn()
    m = manager(engine=engine)
    await m.step(x(0), params(1, start=True))
    engine.gate = asyncio.Event()
    first = asyncio.create_task(m.step(x(1), params(1)))
    second = asyncio.create_task(m.step(x(2), params(1)))
    await asyncio.sleep(0.01)
    assert engine.calls == 2  # the second waits for the first's state, not the engine
    engine.gate.set()
    a, b = await first, await second
    want = reference(3)
    assert np.array_equal(a["y"], want[1]) and np.array_equal(b["y"], want[2])


# ------------------------------------------------------------------ the core, with a store

async def test_another_replica_continues_from_the_store_bit_for_bit():
    clock = Clock()
    store = stores.MemoryStore(clock)
    one, two = manager(store, clock), manager(store, clock)
    got = await run_steps(one, "conv", 0, 4)
    got += await run_steps(two, "conv", 4, 8, start=False)  # a new pod: one read, then on
    got += await run_steps(one, "conv", 8, 10, start=False)  # back: its memory is stale
    assert all(np.array_equal(a, b) for a, b in zip(got, reference(10)))


async def test_a_state_from_another_engine_is_refused():
    store = stores.MemoryStore()
    await manager(store, engine_key="v1").step(x(0), params(1, start=True))
    e = await refused(manager(store, engine_key="v2").step(x(1), params(1)))
    assert e.kind is Kind.CONFLICT and "started on engine v1" in e.message and "serves engine v2" in e.message


async def test_a_store_that_is_down_is_503_and_the_state_stays_whole():
    store = stores.MemoryStore()
    m = manager(store)
    await run_steps(m, 1, 0, 3)
    store.down = True
    e = await refused(m.step(x(3), params(1)))
    assert e.kind is Kind.UNAVAILABLE and e.retry_after and "stateless requests are unaffected" in e.message
    store.down = False
    got = await run_steps(m, 1, 3, 5, start=False)  # the failed step left no trace
    assert all(np.array_equal(a, b) for a, b in zip(got, reference(5)[3:]))


async def test_a_corrupt_state_is_an_error_not_data():
    store = stores.MemoryStore()
    await manager(store).step(x(0), params(1, start=True))
    key = next(iter(store._data))
    blob, expires = store._data[key]
    store._data[key] = (blob[:-1] + bytes([blob[-1] ^ 0xFF]), expires)
    e = await refused(manager(store).step(x(1), params(1)))
    assert e.kind is Kind.FAILED and "corrupt" in e.message and "discarded" in e.message
    assert len(store) == 0


async def test_a_state_of_the_wrong_shape_is_refused_and_discarded():
    """Issue 19, item 4: a state with a valid digest but a shape the model's state input
    cannot take is a 409 that says so, and gone from the store: never fed to the engine."""
    store = stores.MemoryStore()
    engine = NumpyRnn()
    m = manager(store, engine=engine)
    key = m.key("", "bad")
    blob = encode_state(StoredState("key-1", 1, "0123456789abcdef",
                                          {"h": np.zeros((1, 8), np.float32)}), "rnn")
    await store.put(key, blob, None, 60_000)
    e = await refused(m.step(x(1), params("bad")))
    assert (e.kind, e.message) == (Kind.CONFLICT, (
        "the stored state of sequence 'bad' does not fit this model's state inputs: 'h' has "
        "shape [1, 8], the model's input is FP32 [1, 6]; it was discarded, not used: start "
        "the sequence again"))
    assert len(store) == 0 and engine.calls == 0
    e = await refused(m.step(x(1), params("bad")))
    assert e.kind is Kind.NOT_FOUND  # gone: a retry does not meet it again
    await store.put(key, encode_state(StoredState(
        "key-1", 1, "0123456789abcdef", {"h": np.zeros((1, H), np.int64)}), "rnn"), None, 60_000)
    e = await refused(m.step(x(1), params("bad")))
    assert e.kind is Kind.CONFLICT and "'h' is INT64, the model's input is FP32 [1, 6]" in e.message
    assert len(store) == 0 and engine.calls == 0


async def test_memory_is_a_bounded_cache_of_the_store():
    store = stores.MemoryStore()
    m = manager(store, maxLiveSequences=2)
    for s in range(1, 6):
        await m.step(x(0), params(s, start=True))
    assert m.live_sequences == 2 and len(store) == 5  # evicted from memory, not lost
    got = await run_steps(m, 1, 1, 3, start=False)
    assert all(np.array_equal(a, b) for a, b in zip(got, reference(3)[1:]))


async def test_close_refuses_new_steps():
    m = manager(stores.MemoryStore())
    await m.step(x(0), params(1, start=True))
    await m.close(1.0)
    e = await refused(m.step(x(1), params(1)))
    assert e.kind is Kind.UNAVAILABLE


# ------------------------------------------------------------------ the real Redis

@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@needs_redis
async def test_redis_store_compare_and_set_and_ttl(redis_server):
    store = stores.RedisStore(redis_server.address, timeout=1.0)
    try:
        state = StoredState("k", 1, "00000000000000aa", {"h": np.ones((1, 4), np.float32)})
        blob = encode_state(state, "m")
        assert await store.put("kiln:seq:t", blob, None, 60_000) == stores.OK
        assert await store.put("kiln:seq:t", blob, None, 60_000) == stores.CONFLICT  # exists
        assert await store.put("kiln:seq:t", blob, b"x" * 32, 60_000) == stores.CONFLICT
        assert await store.put("kiln:seq:gone", blob, state.token, 60_000) == stores.MISSING
        assert await store.get("kiln:seq:t") == blob
        assert await store.delete("kiln:seq:t", b"y" * 32) == stores.CONFLICT
        assert await store.delete("kiln:seq:t", state.token) == stores.OK
        assert await store.get("kiln:seq:t") is None
        # A large value takes WATCH + MULTI/EXEC instead of the script: the same verdicts.
        big = StoredState("k", 1, "00000000000000bb", {"h": np.ones((1, 100_000), np.float32)})
        blob = encode_state(big, "m")
        assert len(blob) > stores._SCRIPT_MAX_BYTES
        assert await store.put("kiln:seq:big", blob, None, 60_000) == stores.OK
        assert await store.put("kiln:seq:big", blob, None, 60_000) == stores.CONFLICT
        assert await store.put("kiln:seq:big", blob, b"x" * 32, 60_000) == stores.CONFLICT
        assert await store.put("kiln:seq:nope", blob, big.token, 60_000) == stores.MISSING
        assert await store.put("kiln:seq:big", blob, big.token, 60_000) == stores.OK
        assert await store.get("kiln:seq:big") == blob
        # Expiry is Redis's own TTL (the idle timeout, in ms).
        assert await store.put("kiln:seq:short", blob, None, 300) == stores.OK
        await asyncio.sleep(0.5)
        assert await store.get("kiln:seq:short") is None
    finally:
        await store.close()


@needs_redis
async def test_redis_keys_ttl_and_real_expiry(redis_server):
    clock = Clock()
    store = stores.RedisStore(redis_server.address)
    try:
        m = manager(store, clock, idleTimeoutSeconds=1)
        await m.step(x(0), params("exp", start=True), tenant="h:acme")
        keys = redis_server.command("KEYS", "kiln:seq:*").decode()
        assert f"kiln:seq:rnn:{tenant_hash('h:acme')}:exp" in keys
        ttl = int(redis_server.command("PTTL", f"kiln:seq:rnn:{tenant_hash('h:acme')}:exp")
                  .decode().strip(":\r\n"))
        assert 0 < ttl <= 1000
        await asyncio.sleep(1.2)  # the one real wait: Redis's TTL, not ours
        other = manager(store, Clock(), idleTimeoutSeconds=1)
        e = await refused(other.step(x(1), params("exp"), tenant="h:acme"))
        assert e.kind is Kind.NOT_FOUND
    finally:
        await store.close()


@needs_redis
async def test_the_password_comes_from_the_environment(tmp_path):
    server = RedisServer(tmp_path / "auth", password="s3cret-pw").start()
    spec = StoreSpec(type="redis", timeout=1.0, address=server.address, password_required=True)
    try:
        with pytest.raises(ValueError, match="KILN_SEQUENCE_STORE_PASSWORD is not in the environment"):
            stores.make_store(spec, environ={})
        good = stores.make_store(spec, environ={"KILN_SEQUENCE_STORE_PASSWORD": "s3cret-pw"})
        await run_steps(manager(good), 1, 0, 2)
        await good.close()
        bad = stores.make_store(spec, environ={"KILN_SEQUENCE_STORE_PASSWORD": "wrong"})
        e = await refused(manager(bad).step(x(0), params(1, start=True)))
        assert e.kind is Kind.UNAVAILABLE and "refused the credentials" in e.message
        assert "s3cret-pw" not in e.message and "wrong" not in e.message
        await bad.close()
    finally:
        server.stop()


@needs_redis
async def test_redis_down_is_503_within_the_timeout(redis_server):
    store = stores.RedisStore(redis_server.address, timeout=0.3)
    try:
        m = manager(store)
        await run_steps(m, 1, 0, 2)
        redis_server.stop()
        started = time.monotonic()
        e = await refused(m.step(x(2), params(1)))
        assert e.kind is Kind.UNAVAILABLE and redis_server.address in e.message
        assert time.monotonic() - started < 2
        e = await refused(m.step(x(0), params(2, start=True)))
        assert e.kind is Kind.UNAVAILABLE
        redis_server.start()  # same port, empty: the sequence is gone, cleanly
        e = await refused(m.step(x(2), params(1)))
        assert e.kind is Kind.NOT_FOUND
    finally:
        await store.close()


# ------------------------------------------------------------------ the server, real models

@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("seq-engines")
    return root, {"ar": build_engine_for(root, "ar", autoregressive_model(), AR_STATES).path,
                  "rnn": build_engine_for(root, "rnn", rnn_model(), RNN_STATES).path}


def test_kiln_build_checks_the_pairs(tmp_path):
    from kiln.runtime.api.errors import BadRequest

    with pytest.raises(BadRequest) as e:
        build_engine_for(tmp_path, "ar", autoregressive_model(), [{"input": "past", "output": "logits"}])
    assert str(e.value) == (
        "spec.runtime.sequences.states[0]: input 'past' (FP32 [1, 16]) and output 'logits' "
        "(FP32 [1, 11]) differ in dimension 1 (16 vs 11): the output becomes the next "
        "step's input")


class Served:
    """One model on an InferenceServer (HTTP and gRPC) on its own loop in a thread."""

    def __init__(self, root: Path, name: str, rel: str, runtime: dict):
        from kiln.runtime.serving.metrics import ServerMetrics
        from kiln.runtime.serving.model import ServedModel
        from kiln.runtime.serving.servers import InferenceServer

        self.name = name
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.model = ServedModel(name, "1", root / "cache", {"cpu": rel}, runtime_with_defaults(runtime),
                                 ServerMetrics(), target="cpu")
        self.server = InferenceServer([self.model], self.model.metrics)
        url = self.call(self.server.start("127.0.0.1", 0, 0))
        self.port = int(url.rsplit(":", 1)[1])
        assert self.call(self.server.wait_loaded()), self.model.status_message()

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.call(self.server.shutdown(2.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def post(port: int, name: str, inputs: dict, parameters: dict, headers=None):
    """`headers`: a dict, or (name, value) pairs where a name may repeat."""
    doc = {"inputs": [{"name": n, "shape": list(a.shape),
                       "datatype": {"float32": "FP32", "int64": "INT64"}[str(a.dtype)],
                       "data": a.reshape(-1).tolist()} for n, a in inputs.items()],
           "parameters": {**parameters, "binary_data_output": True}}
    body = json.dumps(doc).encode()
    pairs = headers.items() if isinstance(headers, dict) else headers or ()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.putrequest("POST", f"/v2/models/{name}/infer")
        for k, v in [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                     *pairs]:
            conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        body = resp.read()
        length = resp.getheader("Inference-Header-Content-Length")
        if resp.status != 200:
            return resp.status, dict(resp.getheaders()), json.loads(body)
        out = decode_infer_response(body, int(length) if length else None)
        return 200, dict(resp.getheaders()), {o["name"]: o["data"] for o in out["outputs"]}
    finally:
        conn.close()


def get(port: int, path: str):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def ar_step(port, seq, token, start=False, end=False, name="ar", headers=None):
    return post(port, name, {"token": np.array([[token]], dtype=np.int64)},
                params(seq, start, end), headers)


def generate(port, seq, first_token, first, last, name="ar", headers=None):
    """Steps first..last-1 of an autoregressive sequence: each answer's next_token is the
    next step's input. Returns [(logits, next_token)] and the token to feed next."""
    out = []
    token = first_token
    for i in range(first, last):
        status, _, doc = ar_step(port, seq, token, start=(i == 0), name=name, headers=headers)
        assert status == 200, doc
        out.append((doc["logits"], doc["next_token"]))
        token = int(doc["next_token"][0, 0])
    return out, token


@pytest.fixture(scope="module")
def ort_ar():
    import onnxruntime as ort
    return ort.InferenceSession(autoregressive_model(), providers=["CPUExecutionProvider"])


def same(a, b) -> bool:
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() and np.asarray(x).dtype == np.asarray(y).dtype
               for pair_a, pair_b in zip(a, b) for x, y in zip(pair_a, pair_b)) and len(a) == len(b)


@needs_redis
def test_http_and_grpc_sequences_on_a_server(engines, redis_server, ort_ar):
    root, rels = engines
    runtime = {"sequences": {"states": AR_STATES, "store": {"type": "redis",
                                                           "address": redis_server.address}}}
    served = Served(root, "ar", rels["ar"], runtime)
    try:
        # The state tensors are the server's: not in the metadata, not accepted from a client.
        status, meta = get(served.port, "/v2/models/ar")
        assert [i["name"] for i in meta["inputs"]] == ["token"]
        assert [o["name"] for o in meta["outputs"]] == ["logits", "next_token"]
        got, _ = generate(served.port, 11, 3, 0, 6)
        assert same(got, reference_autoregressive(ort_ar, 3, 6))
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
        assert 'kiln_sequences_live{model="ar"} 1.0' in metrics
        assert 'kiln_sequence_state_bytes{model="ar"} 64.0' in metrics

        status, headers, doc = ar_step(served.port, 99, 1)
        assert status == 404 and "no such sequence '99'" in doc["error"]
        status, _, doc = post(served.port, "ar", {"token": np.array([[1]], dtype=np.int64)}, {})
        assert status == 400 and "needs parameters.sequence_id" in doc["error"]
        # Another tenant cannot continue it: the same answer as for no sequence at all.
        status, _, doc = ar_step(served.port, 11, 1, headers={"Kiln-Tenant": "mallory"})
        assert status == 404

        # gRPC: Triton's parameters as InferParameters, the tenant in the metadata.
        import tritonclient.grpc as tg

        client = tg.InferenceServerClient(served.server.grpc_address)
        token = 3
        grpc_out = []
        for i in range(6):
            tensor = tg.InferInput("token", [1, 1], "INT64")
            tensor.set_data_from_numpy(np.array([[token]], dtype=np.int64))
            result = client.infer("ar", [tensor], sequence_id=12, sequence_start=(i == 0),
                                  sequence_end=(i == 5), headers={"kiln-tenant": "acme"})
            grpc_out.append((result.as_numpy("logits"), result.as_numpy("next_token")))
            token = int(grpc_out[-1][1][0, 0])
        assert same(grpc_out, reference_autoregressive(ort_ar, 3, 6))
        with pytest.raises(tg.InferenceServerException, match="no such sequence"):
            tensor = tg.InferInput("token", [1, 1], "INT64")
            tensor.set_data_from_numpy(np.array([[1]], dtype=np.int64))
            client.infer("ar", [tensor], sequence_id=12, headers={"kiln-tenant": "acme"})
        client.close()

        # A store that is down: sequence requests 503 with Retry-After, nothing corrupt.
        redis_server.stop()
        status, headers, doc = ar_step(served.port, 13, 1, start=True)
        assert status == 503 and "Retry-After" in headers and "cannot be reached" in doc["error"]
        redis_server.start()
    finally:
        served.close()


@needs_redis
def test_stateless_requests_keep_working_without_the_store(engines, redis_server, tmp_path):
    root, rels = engines
    redis_server.stop()  # down from the start: the model still loads and is ready
    rnn = {"sequences": {"states": RNN_STATES, "store": {"type": "redis",
                                                        "address": redis_server.address,
                                                        "timeoutMilliseconds": 200}}}
    served = Served(root, "rnn", rels["rnn"], rnn)
    plain = Served(root, "ar", rels["ar"], {})  # the same engine, no sequences
    try:
        assert get(served.port, "/v2/models/rnn/ready")[0] == 200
        status, headers, doc = post(served.port, "rnn", {"x": np.ones((1, 8), np.float32)},
                                    params(1, start=True))
        assert status == 503 and headers["Retry-After"] == "1"
        status, _, doc = post(plain.port, "ar", {"token": np.array([[2]], dtype=np.int64),
                                                 "past": np.zeros((1, 16), np.float32)}, {})
        assert status == 200 and set(doc) == {"present", "logits", "next_token"}
        status, _, doc = post(plain.port, "ar", {"token": np.array([[2]], dtype=np.int64),
                                                 "past": np.zeros((1, 16), np.float32)},
                              params(5))
        assert status == 400 and "not stateful" in doc["error"]
    finally:
        served.close()
        plain.close()


def test_the_models_declared_initial_state_starts_the_sequence(tmp_path):
    import onnxruntime as ort

    onnx_bytes = rnn_model(initial_h=0.25)
    rel = build_engine_for(tmp_path, "rnn", onnx_bytes, RNN_STATES).path
    served = Served(tmp_path, "rnn", rel, {"sequences": {"states": RNN_STATES}})
    try:
        assert [i["name"] for i in get(served.port, "/v2/models/rnn")[1]["inputs"]] == ["x"]
        got = [post(served.port, "rnn", {"x": rnn_x(i)}, params("d", start=(i == 0)))[2]["y"]
               for i in range(3)]
    finally:
        served.close()
    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    h = np.full((1, 32), 0.25, dtype=np.float32)  # not zeros: the model's default
    for i in range(3):
        h, y = session.run(["h_next", "y"], {"x": rnn_x(i), "h": h})
        assert got[i].tobytes() == y.tobytes()


def test_a_mismatched_pair_keeps_the_pod_alive_and_not_ready(engines):
    root, rels = engines
    runtime = {"sequences": {"states": [{"input": "h", "output": "y"}]}}
    from kiln.runtime.serving.metrics import ServerMetrics
    from kiln.runtime.serving.model import ServedModel

    model = ServedModel("rnn", "1", root / "cache", {"cpu": rels["rnn"]}, runtime_with_defaults(runtime),
                        ServerMetrics(), target="cpu")
    assert asyncio.run(model.load()) is False
    assert model.error == ("spec.runtime.sequences.states[0]: input 'h' (FP32 [1, 32]) and "
                           "output 'y' (FP32 [1, 4]) differ in dimension 1 (32 vs 4): the "
                           "output becomes the next step's input")


def test_bounds_over_http_are_429_with_the_reason(engines):
    root, rels = engines
    runtime = {"sequences": {"states": RNN_STATES, "maxLiveSequences": 1}}
    served = Served(root, "rnn", rels["rnn"], runtime)
    try:
        one = {"x": np.ones((1, 8), np.float32)}
        assert post(served.port, "rnn", one, params(1, start=True))[0] == 200
        status, headers, doc = post(served.port, "rnn", one, params(2, start=True))
        assert status == 429 and "maxLiveSequences (1)" in doc["error"] and "Retry-After" in headers
    finally:
        served.close()


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=needs_redis)])
def test_a_bad_state_never_takes_the_replica_out_of_service(engines, request, store):
    """Issue 19, item 4: a stored state of the wrong shape (valid digest) is refused and
    discarded before the engine, as often as it is written: the replica stays ready."""
    root, rels = engines
    runtime = {"sequences": {"states": RNN_STATES, "store": {"type": store}}}
    if store == "redis":
        runtime["sequences"]["store"]["address"] = request.getfixturevalue("redis_server").address
    served = Served(root, "rnn", rels["rnn"], runtime)
    sequences = served.model.sequences
    if store == "memory":  # the one store a test can write into without a server
        sequences.store = stores.MemoryStore()
    key = sequences.key("", "bad")
    blob = encode_state(StoredState(sequences.engine_key, 1, "0123456789abcdef",
                                          {"h": np.ones((1, 8), np.float32)}), "rnn")
    try:
        for _ in range(6):
            served.call(sequences.store.put(key, blob, None, 60_000))
            status, _, doc = post(served.port, "rnn", {"x": rnn_x(1)}, params("bad"))
            assert (status, doc["error"]) == (409, (
                "the stored state of sequence 'bad' does not fit this model's state inputs: "
                "'h' has shape [1, 8], the model's input is FP32 [1, 32]; it was discarded, "
                "not used: start the sequence again"))
            assert served.call(sequences.store.get(key)) is None
        assert get(served.port, "/v2/health/ready")[0] == 200
        got = [post(served.port, "rnn", {"x": rnn_x(i)}, params("good", start=(i == 0)))[2]["y"]
               for i in range(2)]
        assert same([(y,) for y in got], reference_run("rnn", 2))
    finally:
        served.close()


def grpc_step(address: str, name: str, x, parameters: dict, metadata=()):
    """One step over gRPC with Kiln's own messages (metadata may repeat a key, which
    tritonclient's dict of headers cannot): (code, details)."""
    import grpc

    from kiln.runtime.serving.grpc import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name=name)
    for k, v in parameters.items():
        field = "bool_param" if isinstance(v, bool) else "int64_param" if isinstance(v, int) \
            else "string_param"
        setattr(request.parameters[k], field, v)
    tensor = request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
        try:
            call(request, metadata=list(metadata), timeout=20)
        except grpc.RpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=needs_redis)])
def test_a_tenant_is_its_whole_identity_on_both_doors(engines, request, store):
    """Issue 19, item 3: a tenant is its whole header, the same over HTTP and gRPC, and a
    repeated header is refused alike on both."""
    import grpc

    root, rels = engines
    runtime = {"sequences": {"states": RNN_STATES, "store": {"type": store}}}
    if store == "redis":
        runtime["sequences"]["store"]["address"] = request.getfixturevalue("redis_server").address
    served = Served(root, "rnn", rels["rnn"], runtime)
    prefix = "spiffe://corp/" + "x" * 250
    alice, mallory = [("Kiln-Tenant", prefix + "/alice")], [("Kiln-Tenant", prefix + "/mallory")]
    address = served.server.grpc_address
    try:
        status, _, doc = post(served.port, "rnn", {"x": rnn_x(0)}, params("s", start=True), alice)
        assert status == 200, doc
        # Another identity with the same first 256 characters is another tenant, on both doors.
        status, _, doc = post(served.port, "rnn", {"x": rnn_x(1)}, params("s"), mallory)
        assert status == 404, doc
        metadata = [("kiln-tenant", prefix + "/mallory")]
        assert grpc_step(address, "rnn", rnn_x(1), params("s"), metadata)[0] == \
            grpc.StatusCode.NOT_FOUND
        # The same identity is the same tenant on either door.
        metadata = [("kiln-tenant", prefix + "/alice")]
        assert grpc_step(address, "rnn", rnn_x(1), params("s"), metadata) == \
            (grpc.StatusCode.OK, "")
        status, _, doc = post(served.port, "rnn", {"x": rnn_x(2)}, params("s"), alice)
        assert status == 200, doc

        # A gateway that appends its header to the client's: refused alike, before any state.
        both = alice + mallory
        status, _, doc = post(served.port, "rnn", {"x": rnn_x(3)}, params("s"), both)
        want = ("the request has 2 Kiln-Tenant headers; it belongs to one tenant (a gateway "
                "must replace the header, not add another)")
        assert (status, doc["error"]) == (400, want)
        both = [(k.lower(), v) for k, v in both]
        assert grpc_step(address, "rnn", rnn_x(3), params("s"), both) == \
            (grpc.StatusCode.INVALID_ARGUMENT, want)
        assert grpc_step(address, "rnn", rnn_x(3), params("s"), both[::-1]) == \
            (grpc.StatusCode.INVALID_ARGUMENT, want)
        # Bytes aiohttp decodes to surrogates: a 400, never a 500.
        status, _, doc = post(served.port, "rnn", {"x": rnn_x(3)}, params("t", start=True),
                              [("Authorization", b"Bearer \xff")])
        assert status == 400 and "printable ASCII" in doc["error"], doc
        # Over the bound: refused, not cut.
        status, _, doc = post(served.port, "rnn", {"x": rnn_x(3)}, params("t", start=True),
                              [("Kiln-Tenant", "a" * 5000)])
        assert status == 400 and "at most 4096" in doc["error"], doc
        # The refused steps changed nothing: the sequence goes on from step 3.
        status, _, doc = post(served.port, "rnn", {"x": rnn_x(3)}, params("s", end=True), alice)
        assert status == 200, doc
    finally:
        served.close()


# ------------------------------------------------------------------ SIGTERM midway, another pod

def serve(kiln_process, root: Path, name: str, rel: str, runtime: dict, tmp_path: Path,
          workers: int = 1):
    p = kiln_process(["serve", "--model-name", name, "--cache-dir", str(root / "cache"),
                      "--engine", f"cpu={rel}", "--runtime-spec", json.dumps(runtime),
                      "--host", "127.0.0.1", "--port", "0", "--no-grpc",
                      "--drain-seconds", "5", "--workers", str(workers)], tmp_path)
    listening = r"listening on" if workers == 1 else r"front-end worker\(s\) on"
    port = int(p.wait_for(listening + r" 127\.0\.0\.1:(\d+)").group(1))
    deadline = time.monotonic() + 30
    while True:
        try:
            if get(port, "/v2/health/ready")[0] == 200:
                break
        except OSError:  # front ends not listening yet
            pass
        assert time.monotonic() < deadline, "\n".join(p.lines)
        time.sleep(0.05)
    return p, port


def rnn_x(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).standard_normal((1, 8)).astype(np.float32)


def drive(port, name, seq, first, last, carry):
    """Steps first..last-1 of a sequence of either model; `carry` is the autoregressive
    model's next input token (the RNN's inputs are fixed per step)."""
    if name == "ar":
        return generate(port, seq, carry, first, last)
    out = []
    for i in range(first, last):
        status, _, doc = post(port, "rnn", {"x": rnn_x(i)}, params(seq, start=(i == 0)))
        assert status == 200, doc
        out.append((doc["y"],))
    return out, carry


def reference_run(name, steps):
    import onnxruntime as ort

    if name == "ar":
        session = ort.InferenceSession(autoregressive_model(), providers=["CPUExecutionProvider"])
        return reference_autoregressive(session, 5, steps)
    session = ort.InferenceSession(rnn_model(), providers=["CPUExecutionProvider"])
    h = np.zeros((1, 32), dtype=np.float32)
    out = []
    for i in range(steps):
        h, y = session.run(["h_next", "y"], {"x": rnn_x(i), "h": h})
        out.append((y,))
    return out


@needs_redis
@pytest.mark.parametrize("name,states,steps,cut", [("ar", AR_STATES, 40, 17),
                                                   ("rnn", RNN_STATES, 25, 9)])
def test_sigterm_midway_and_another_pod_continues_bit_for_bit(engines, redis_server, tmp_path,
                                                              kiln_process, name, states,
                                                              steps, cut):
    root, rels = engines
    runtime = {"sequences": {"states": states, "store": {"type": "redis",
                                                        "address": redis_server.address}}}
    first, port = serve(kiln_process, root, name, rels[name], runtime, tmp_path)
    uninterrupted, _ = drive(port, name, "whole", 0, steps, 5)
    head, carry = drive(port, name, "cut", 0, cut, 5)
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(15) == 0
    assert any("sequences closed" in line for line in first.lines), "\n".join(first.lines)

    # The next pod has front-end workers: the steps reach its engine with their parameters.
    second, port = serve(kiln_process, root, name, rels[name], runtime, tmp_path, workers=2)
    tail, _ = drive(port, name, "cut", cut, steps, carry)
    assert same(head + tail, uninterrupted)
    assert same(uninterrupted, reference_run(name, steps))
    second.stop()


def test_front_ends_read_the_tenant_as_the_single_process_does(engines, tmp_path, kiln_process):
    """`kiln serve --workers 2`: each front end reads the tenant before the hand-over, with
    the same function and answers as the single process."""
    root, rels = engines
    p, port = serve(kiln_process, root, "rnn", rels["rnn"], {"sequences": {"states": RNN_STATES}},
                    tmp_path, workers=2)
    prefix = "spiffe://corp/" + "x" * 250
    alice, mallory = [("Kiln-Tenant", prefix + "/alice")], [("Kiln-Tenant", prefix + "/mallory")]
    status, _, doc = post(port, "rnn", {"x": rnn_x(0)}, params("s", start=True), alice)
    assert status == 200, doc
    assert post(port, "rnn", {"x": rnn_x(1)}, params("s"), mallory)[0] == 404
    status, _, doc = post(port, "rnn", {"x": rnn_x(1)}, params("s"), alice + mallory)
    assert (status, doc["error"]) == (400, tenant_refusal(alice + mallory))
    status, _, doc = post(port, "rnn", {"x": rnn_x(1)}, params("s", end=True), alice)
    assert status == 200, doc
    p.stop()
