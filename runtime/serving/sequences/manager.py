"""Stateful sequences: a model's state kept outside the engine between steps, and outside the
pod between requests (`spec.runtime.sequences`).

A model whose state is an explicit input and output (an RNN's hidden state, a transformer's
KV cache as `past_*` inputs and `present_*` outputs) is stepped one request at a time. The
client sends Triton's sequence parameters (`sequence_id`, `sequence_start`, `sequence_end`
in the request's `parameters`) and the model's other inputs; a step feeds the stored state
(at the start the model's declared initial state, an input's default value, else zeros),
runs the model, stores the returned state and answers the other outputs. The state tensors
are not the client's: they are not in the model's metadata and a request cannot send or
ask for them.

    request --> SequenceManager.step(inputs, parameters, tenant)
                  per-sequence lock (two requests of one sequence run one after the other)
                  state: this replica's memory, else the store (one GET), else zeros at start
                  model.infer(inputs + state)            (the batching scheduler, as ever)
                  the new state: written to the store (one atomic compare-and-set), then memory
                <-- the other outputs

Pieces, pure where they can be:
- `SequenceSpec`: `spec.runtime.sequences` parsed (the CRD applied its defaults).
- `check_pairs`: each state input/output pair against the model's tensors (dtype, shape).
- `SequenceStore`: where state outlives the pod. `RedisStore` (redis.asyncio; every call
  bounded by the store's timeout) and `MemoryStore` (the same contract in this process: tests,
  benchmarks). Values are `encode_state` blobs; writes are compare-and-set on the blob's
  token (the sequence's incarnation and step), so a step that two replicas race on is applied
  once, and a write is one Redis command (a Lua script): never half a state.
- `SequenceManager`: the live state in memory (bounded), the step, expiry, close.

Write-through: a step is answered only after its state is in the store, so the loss window
is none: a SIGTERM'd pod has nothing left to flush once its in-flight steps are done (its
drain waits for them), and any replica continues from the store. With store `memory` the
state lives in this pod alone and ends with it.

Errors are `SequenceError`s (a Refusal: its kind and the message; each transport maps
the status): 400 bad sequence parameters or tenant header, 404 no such sequence (unknown,
ended, expired or another tenant's: the same answer), 409 the stored state belongs to
another engine key, or does not fit the model's state inputs (discarded), or a step raced
another replica past the retries, 429 a bound (the message says which), 500 a stored state
whose digest does not match (discarded, never used), 503 with Retry-After when the store
cannot be reached in time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import secrets
import struct
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from kiln.runtime.engine.backends.base import DATATYPES, TensorSpec
from kiln.runtime.api.contract import SEQUENCE_STORE_PASSWORD_ENV
from kiln.runtime.serving.protocol import datatype_of, shown
from kiln.runtime.serving.refusals import Kind, Refusal

log = logging.getLogger("kiln.runtime.serving.sequences.manager")

# Defaults: the CRD's (docs/api.md); repeated here for code that runs without the API server.
DEFAULT_IDLE_TIMEOUT_SECONDS = 300
DEFAULT_MAX_LIVE_SEQUENCES = 1024
DEFAULT_MAX_BYTES_PER_SEQUENCE = 64 << 20
DEFAULT_MAX_BYTES_TOTAL = 1 << 30
DEFAULT_STORE_TIMEOUT_MS = 1000
# The tenant: the header a gateway sets (and strips from clients), else the bearer token.
TENANT_HEADER = "Kiln-Tenant"
# A longer tenant is refused, never cut: a cut makes two identities one tenant.
MAX_TENANT_BYTES = 4096
# What both doors deliver alike: gRPC's legal metadata values. Beyond them aiohttp and gRPC
# decode the same bytes differently (surrogates, latin-1), so one identity could be two.
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")
# HTTP's optional whitespace: never part of an HTTP value, so not of a gRPC one either.
_OWS = " \t"
# A string sequence_id: what is safe in a Redis key and a log line.
_SEQUENCE_ID = re.compile(r"[A-Za-z0-9._~:@+=-]{1,128}")
_MAX_SEQUENCE_INT = 2 ** 64 - 1
# Retry-After (seconds) when the store cannot be reached.
STORE_RETRY_AFTER = 1.0
# A step that finds its state advanced by another replica reloads and runs again, this often.
MAX_RACE_RETRIES = 3
# States larger than this are encoded and hashed on a worker thread, not on the event loop.
_THREAD_BYTES = 1 << 20


class SequenceError(Refusal):
    """A sequence request the server refuses: its kind, a message, and Retry-After seconds
    where waiting can help."""


class StoreUnavailable(Exception):
    """The store did not answer in time, refused the connection, or failed the command."""


class StoreFull(Exception):
    """The store refused a write for lack of memory (Redis `maxmemory` with noeviction)."""


class CorruptState(Exception):
    """A stored blob that is not a whole, untampered state."""


# ------------------------------------------------------------------------------ the spec

@dataclasses.dataclass(frozen=True)
class StoreSpec:
    type: str = "memory"  # memory | redis
    address: str | None = None  # host:port, or a redis:// or rediss:// URL
    timeout: float = DEFAULT_STORE_TIMEOUT_MS / 1000
    password_required: bool = False  # passwordSecretRef is set: the env variable must be


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
    states: tuple[tuple[str, str], ...]  # (input, output) pairs
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_SECONDS
    max_live: int = DEFAULT_MAX_LIVE_SEQUENCES
    max_bytes_per_sequence: int = DEFAULT_MAX_BYTES_PER_SEQUENCE
    max_bytes_total: int = DEFAULT_MAX_BYTES_TOTAL
    store: StoreSpec = StoreSpec()

    @classmethod
    def from_runtime(cls, runtime: Mapping[str, Any] | None) -> "SequenceSpec | None":
        """`spec.runtime.sequences` -> a SequenceSpec, None when absent. ValueError says what
        is wrong (the CRD refuses it first; this is for a hand-written --runtime-spec)."""
        raw = (runtime or {}).get("sequences")
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ValueError("spec.runtime.sequences must be an object")
        states = raw.get("states")
        if not isinstance(states, list) or not states:
            raise ValueError("spec.runtime.sequences.states must list at least one "
                             "{input, output} pair")
        pairs = []
        for i, s in enumerate(states):
            if not (isinstance(s, Mapping) and isinstance(s.get("input"), str) and s["input"]
                    and isinstance(s.get("output"), str) and s["output"]):
                raise ValueError(f"spec.runtime.sequences.states[{i}] must be "
                                 f"{{input: name, output: name}}")
            pairs.append((s["input"], s["output"]))
        for side, names in (("input", [p[0] for p in pairs]), ("output", [p[1] for p in pairs])):
            if len(set(names)) != len(names):
                raise ValueError(f"spec.runtime.sequences.states: each state {side} may appear "
                                 f"once")
        store = raw.get("store") or {}
        if not isinstance(store, Mapping):
            raise ValueError("spec.runtime.sequences.store must be an object")
        kind = store.get("type", "memory")
        if kind not in ("memory", "redis"):
            raise ValueError(f"spec.runtime.sequences.store.type must be memory or redis, "
                             f"got {kind!r}")
        address = store.get("address")
        if kind == "redis" and not (isinstance(address, str) and address):
            raise ValueError("spec.runtime.sequences.store.address is required for a redis store")
        spec = cls(
            states=tuple(pairs),
            idle_timeout=float(_positive(raw, "idleTimeoutSeconds", DEFAULT_IDLE_TIMEOUT_SECONDS)),
            max_live=int(_positive(raw, "maxLiveSequences", DEFAULT_MAX_LIVE_SEQUENCES)),
            max_bytes_per_sequence=int(_positive(raw, "maxBytesPerSequence",
                                                 DEFAULT_MAX_BYTES_PER_SEQUENCE)),
            max_bytes_total=int(_positive(raw, "maxBytesTotal", DEFAULT_MAX_BYTES_TOTAL)),
            store=StoreSpec(type=kind, address=address if kind == "redis" else None,
                            timeout=_positive(store, "timeoutMilliseconds",
                                              DEFAULT_STORE_TIMEOUT_MS) / 1000,
                            password_required=bool(store.get("passwordSecretRef"))))
        if spec.max_bytes_per_sequence > spec.max_bytes_total:
            raise ValueError("spec.runtime.sequences: maxBytesPerSequence must be <= maxBytesTotal")
        return spec

    @property
    def state_inputs(self) -> frozenset[str]:
        return frozenset(i for i, _ in self.states)

    @property
    def state_outputs(self) -> frozenset[str]:
        return frozenset(o for _, o in self.states)


def _positive(raw: Mapping[str, Any], name: str, default: float) -> float:
    value = raw.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise ValueError(f"spec.runtime.sequences {name} must be a positive number, got {value!r}")
    return value


def _describe_tensor(spec: TensorSpec) -> str:
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
        pair = f"{where}: input {inp!r} ({_describe_tensor(a)}) and output {out!r} " \
               f"({_describe_tensor(b)})"
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


# ------------------------------------------------------------------------------ requests

@dataclasses.dataclass(frozen=True)
class SequenceParams:
    id: str  # the sequence_id as a string (int 7 and "7" are one sequence)
    start: bool
    end: bool


def names_sequence(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's parameters name a sequence: a sequence_id other than Triton's
    0 or "" for none. The one reading every caller uses (tenancy, joining, routing)."""
    return bool(params) and params.get("sequence_id") not in (None, 0, "")


def parse_parameters(params: Mapping[str, Any] | None) -> SequenceParams | None:
    """Triton's sequence parameters of a request -> SequenceParams, or None when the request
    names no sequence (no sequence_id, or Triton's 0 / "" for none). 400 on bad values."""
    params = params or {}
    raw = params.get("sequence_id")
    start, end = (_bool_param(params, n) for n in ("sequence_start", "sequence_end"))
    if not names_sequence(params):
        if start or end:
            raise SequenceError(Kind.INVALID, "sequence_start and sequence_end need a sequence_id "
                                     "parameter")
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise SequenceError(Kind.INVALID, f"parameter 'sequence_id' must be a positive integer or a "
                                 f"string, got {shown(raw)}")
    if isinstance(raw, int):
        if not 0 < raw <= _MAX_SEQUENCE_INT:
            raise SequenceError(Kind.INVALID, f"parameter 'sequence_id' must be 1..{_MAX_SEQUENCE_INT}, "
                                     f"got {shown(raw)}")
        ident = str(raw)
    else:
        if not _SEQUENCE_ID.fullmatch(raw):
            raise SequenceError(Kind.INVALID, f"parameter 'sequence_id' {shown(raw)}: a string id is 1 to "
                                     f"128 characters of letters, digits and ._~:@+=-")
        ident = raw
    return SequenceParams(ident, start, end)


def _bool_param(params: Mapping[str, Any], name: str) -> bool:
    value = params.get(name, False)
    if not isinstance(value, bool):
        raise SequenceError(Kind.INVALID, f"parameter '{name}' must be true or false, got {shown(value)}")
    return value


def tenant_of(headers: Iterable[tuple[str, str]]) -> str:
    """The tenant a request's sequences belong to: the `Kiln-Tenant` header (which the
    gateway in front of Kiln sets from the caller's identity, and strips when a client sends
    it), else the sha256 of the `Authorization` header (the bearer token), else "" (every
    anonymous caller is one tenant).

    `headers`: every (name, value) pair as received, repeats included: aiohttp's
    `headers.items()` and gRPC's invocation metadata alike, so both doors decide the same.
    400 for a repeated header (the first would win over HTTP, the last over gRPC), an
    empty one, one over MAX_TENANT_BYTES, or one that is not printable ASCII."""
    tenants, tokens = [], []
    for name, value in headers:
        key = name.lower()
        if key == TENANT_HEADER.lower():
            tenants.append(value)
        elif key == "authorization":
            tokens.append(value)
    if tenants:
        return "h:" + _identity(TENANT_HEADER, tenants, MAX_TENANT_BYTES)
    if tokens:
        return "t:" + hashlib.sha256(_identity("Authorization", tokens).encode()).hexdigest()
    return ""


def _identity(header: str, values: list[str], most: int | None = None) -> str:
    if len(values) > 1:
        raise SequenceError(Kind.INVALID, f"the request has {len(values)} {header} headers; it belongs "
                                 f"to one tenant (a gateway must replace the header, not add "
                                 f"another)")
    value = values[0].strip(_OWS)
    if not value:
        raise SequenceError(Kind.INVALID, f"the {header} header is empty; it names the tenant that owns "
                                 f"the request's sequence")
    if most is not None and len(value) > most:
        raise SequenceError(Kind.INVALID, f"the {header} header has {len(value)} characters; a tenant "
                                 f"has at most {most} (it is never cut short: two tenants "
                                 f"would become one)")
    printable = _PRINTABLE_ASCII.match(value).end()
    if printable < len(value):
        raise SequenceError(Kind.INVALID, f"the {header} header must be printable ASCII (0x20-0x7E): "
                                 f"character {printable + 1} is not")
    return value


def request_tenant(parameters: Mapping[str, Any] | None,
                   headers: Callable[[], Iterable[tuple[str, str]]]) -> str:
    """The tenant of a request that names a sequence (`tenant_of` its `headers()`), else ""
    without reading them: stateless requests pay nothing for tenancy."""
    return tenant_of(headers()) if names_sequence(parameters) else ""


def tenant_hash(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------ the blob

# Layout: MAGIC | token (32 ASCII bytes: incarnation 16 hex + step 16 digits) | header length
# (u32, big-endian) | header JSON | the state tensors' bytes, little-endian, in header order.
# The token sits at a fixed offset so the store's compare-and-set reads 32 bytes, not the state.
MAGIC = b"KSEQ1 "
TOKEN_OFFSET = len(MAGIC)
TOKEN_BYTES = 32
_HEADER_AT = TOKEN_OFFSET + TOKEN_BYTES
_MAX_HEADER_BYTES = 1 << 20


def make_token(incarnation: str, step: int) -> bytes:
    return f"{incarnation}{step:016d}".encode()


@dataclasses.dataclass
class StoredState:
    engine_key: str
    step: int  # steps taken: 1 after the start step
    incarnation: str  # 16 hex characters, new at every sequence_start
    tensors: dict[str, np.ndarray]  # state input name -> array (read-only views of the blob)

    @property
    def token(self) -> bytes:
        return make_token(self.incarnation, self.step)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.tensors.values())


def encode_state(state: StoredState, model: str) -> bytes:
    """A state -> one blob (header with the engine key, step, dtypes, shapes and the sha256
    of the tensor bytes; then the bytes). One copy of the tensors."""
    chunks = []
    entries = []
    digest = hashlib.sha256()
    for name, array in state.tensors.items():
        raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        view = raw.reshape(-1).view(np.uint8)
        digest.update(view)
        chunks.append(view)
        dtype = datatype_of(array)
        entries.append({"name": name, "datatype": dtype, "shape": list(array.shape),
                        "nbytes": int(raw.nbytes)})
    header = json.dumps({"v": 1, "model": model, "engineKey": state.engine_key,
                         "step": state.step, "incarnation": state.incarnation,
                         "tensors": entries, "sha256": digest.hexdigest(),
                         "savedAt": round(time.time(), 3)},
                        separators=(",", ":")).encode()
    return b"".join([MAGIC, state.token, struct.pack(">I", len(header)), header, *chunks])


def decode_state(blob: bytes) -> StoredState:
    """A blob -> the state, its tensors read-only views of the blob. CorruptState unless
    the blob is whole: magic, header, sizes that add up, and the tensor bytes' sha256."""
    view = memoryview(blob)
    if len(view) < _HEADER_AT + 4 or bytes(view[:TOKEN_OFFSET]) != MAGIC:
        raise CorruptState("not a Kiln sequence state (bad magic)")
    (length,) = struct.unpack(">I", view[_HEADER_AT:_HEADER_AT + 4])
    start = _HEADER_AT + 4
    if length > _MAX_HEADER_BYTES or start + length > len(view):
        raise CorruptState(f"header length {length} does not fit the {len(view)}-byte value")
    try:
        header = json.loads(bytes(view[start:start + length]))
        tensors = header["tensors"]
        step, incarnation = int(header["step"]), str(header["incarnation"])
        engine_key, want = str(header["engineKey"]), str(header["sha256"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptState(f"unreadable header: {e}") from None
    if bytes(view[TOKEN_OFFSET:_HEADER_AT]) != make_token(incarnation, step):
        raise CorruptState("the token does not match the header")
    offset = start + length
    body = view[offset:]
    total = 0
    layout = []
    for t in tensors:
        try:
            dtype = DATATYPES[t["datatype"]]
            shape = [int(d) for d in t["shape"]]
            nbytes = int(t["nbytes"])
            name = str(t["name"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptState(f"bad tensor entry {str(t)[:100]}: {e}") from None
        if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != nbytes:
            raise CorruptState(f"tensor {name!r}: {nbytes} bytes do not make shape {shape}")
        layout.append((name, dtype, shape, total, nbytes))
        total += nbytes
    if total != len(body):
        raise CorruptState(f"the header accounts for {total} tensor bytes, the value has "
                           f"{len(body)}")
    got = hashlib.sha256(body).hexdigest()
    if got != want:
        raise CorruptState(f"sha256 of the tensor bytes is {got}, the header says {want}")
    arrays = {}
    for name, dtype, shape, at, nbytes in layout:
        array = np.frombuffer(body[at:at + nbytes], dtype=dtype.newbyteorder("<"))
        if not array.dtype.isnative:
            array = array.astype(dtype)
        arrays[name] = array.reshape(shape)
    return StoredState(engine_key, step, incarnation, arrays)


def _misfit(tensors: Mapping[str, np.ndarray], inputs: Mapping[str, TensorSpec]) -> str | None:
    """Why stored state tensors cannot be the model's state inputs (names, datatypes, ranks,
    fixed dimensions), or None when they can."""
    if set(tensors) != set(inputs):
        return f"it has tensors {sorted(tensors)}, the model's state inputs are {sorted(inputs)}"
    for name, array in tensors.items():
        spec = inputs[name]
        if array.dtype != DATATYPES[spec.datatype]:
            return (f"{name!r} is {datatype_of(array)}, the model's input is "
                    f"{_describe_tensor(spec)}")
        if len(array.shape) != len(spec.shape) or any(
                d >= 0 and d != got for d, got in zip(spec.shape, array.shape)):
            return (f"{name!r} has shape {list(array.shape)}, the model's input is "
                    f"{_describe_tensor(spec)}")
    return None


# ------------------------------------------------------------------------------ stores

OK, MISSING, CONFLICT = "ok", "missing", "conflict"


class SequenceStore(Protocol):
    """Where state outlives the pod. Values are `encode_state` blobs; `expect` is the token
    the stored value must have (None: the key must not exist). Every method raises
    StoreUnavailable when the store cannot answer in time."""

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, expect: bytes | None, ttl_ms: int) -> str:
        """Set `value` with a time to live, atomically, if the stored token is `expect`:
        OK, MISSING (expect given, no such key) or CONFLICT (another token, or the key
        exists when expect is None)."""

    async def delete(self, key: str, expect: bytes | None) -> str: ...

    async def close(self) -> None: ...


class MemoryStore:
    """The store contract in this process's memory, expiry by an injected clock: for tests
    and benchmarks (two managers on one MemoryStore are two replicas on one Redis)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._data: dict[str, tuple[bytes, float]] = {}
        self.down = False  # tests: True makes every call fail as a dead store would

    def _live(self, key: str) -> bytes | None:
        if self.down:
            raise StoreUnavailable("the memory store is down (a test said so)")
        item = self._data.get(key)
        if item is None:
            return None
        if self._clock() >= item[1]:
            del self._data[key]
            return None
        return item[0]

    async def get(self, key: str) -> bytes | None:
        return self._live(key)

    async def put(self, key: str, value: bytes, expect: bytes | None, ttl_ms: int) -> str:
        current = self._live(key)
        verdict = _compare(current, expect)
        if verdict == OK:
            self._data[key] = (bytes(value), self._clock() + ttl_ms / 1000)
        return verdict

    async def delete(self, key: str, expect: bytes | None) -> str:
        current = self._live(key)
        verdict = OK if expect is None else _compare(current, expect)
        if verdict == OK:
            self._data.pop(key, None)
        return verdict

    async def close(self) -> None:
        pass

    def __len__(self) -> int:
        return len(self._data)


def _compare(current: bytes | None, expect: bytes | None) -> str:
    if expect is None:
        return OK if current is None else CONFLICT
    if current is None:
        return MISSING
    return OK if current[TOKEN_OFFSET:_HEADER_AT] == expect else CONFLICT


# One round trip each, atomic in Redis: compare the token at its offset, then write.
_PUT_SCRIPT = """
local at = tonumber(ARGV[3])
if ARGV[1] == '' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
else
  local cur = redis.call('GETRANGE', KEYS[1], at, at + string.len(ARGV[1]) - 1)
  if cur == '' then return -1 end
  if cur ~= ARGV[1] then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
return 1
"""
_DELETE_SCRIPT = """
if ARGV[1] ~= '' then
  local at = tonumber(ARGV[2])
  local cur = redis.call('GETRANGE', KEYS[1], at, at + string.len(ARGV[1]) - 1)
  if cur == '' then return -1 end
  if cur ~= ARGV[1] then return 0 end
end
redis.call('DEL', KEYS[1])
return 1
"""
_VERDICTS = {1: OK, 0: CONFLICT, -1: MISSING}


# Values above this are written with WATCH + MULTI/EXEC instead of the script: Redis copies a
# script's arguments into Lua and back (a 1 MB write takes 5x a plain SET), a transaction
# does not (2.5x: three round trips instead of one, which is what small values pay).
_SCRIPT_MAX_BYTES = 256 << 10


class RedisStore:
    """Redis through `redis.asyncio`: GET to read; to write, compare the token, then SET with
    PX, atomically (a Lua script, or for large values WATCH + MULTI/EXEC), so a write is whole
    or absent and expiry is Redis's own TTL. No client-side retries: every call is bounded by
    `timeout` and a failure is StoreUnavailable at once (the step answers 503; the client
    retries, possibly on another replica)."""

    def __init__(self, address: str, *, password: str | None = None, timeout: float = 1.0):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        url = address if "://" in address else f"redis://{address}"
        self.address = address
        self.timeout = timeout
        self._client = aioredis.Redis.from_url(
            url, password=password or None, socket_timeout=timeout,
            socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
            health_check_interval=0)
        self._put = self._client.register_script(_PUT_SCRIPT)
        self._delete = self._client.register_script(_DELETE_SCRIPT)

    async def _call(self, what: str, coro: Awaitable[Any]) -> Any:
        import redis.exceptions as rx

        try:
            async with asyncio.timeout(self.timeout):
                return await coro
        except TimeoutError:
            raise StoreUnavailable(f"the sequence store {self.address} did not answer {what} "
                                   f"within {self.timeout * 1000:g} ms") from None
        except rx.AuthenticationError as e:
            raise StoreUnavailable(f"the sequence store {self.address} refused the credentials "
                                   f"({e}); check the Secret behind "
                                   f"{SEQUENCE_STORE_PASSWORD_ENV}") from None
        except (rx.ConnectionError, rx.TimeoutError, OSError) as e:
            raise StoreUnavailable(f"the sequence store {self.address} cannot be reached: "
                                   f"{e}") from None
        except rx.ResponseError as e:
            if "OOM" in str(e):
                raise StoreFull(f"the sequence store {self.address} is out of memory: {e}") from None
            raise StoreUnavailable(f"the sequence store {self.address} failed {what}: {e}") from None

    async def get(self, key: str) -> bytes | None:
        return await self._call("a read", self._client.get(key))

    async def put(self, key: str, value: bytes, expect: bytes | None, ttl_ms: int) -> str:
        ttl_ms = max(1, int(ttl_ms))
        if len(value) > _SCRIPT_MAX_BYTES:
            return await self._call("a write", self._put_watched(key, value, expect, ttl_ms))
        args = [expect or b"", value, TOKEN_OFFSET, ttl_ms]
        return _VERDICTS[int(await self._call("a write", self._put(keys=[key], args=args)))]

    async def _put_watched(self, key: str, value: bytes, expect: bytes | None, ttl_ms: int) -> str:
        import redis.exceptions as rx

        async with self._client.pipeline(transaction=True) as pipe:
            await pipe.watch(key)  # EXEC fails if anything writes the key from here on
            if expect is None:
                if await pipe.exists(key):
                    return CONFLICT
            else:
                current = await pipe.getrange(key, TOKEN_OFFSET, TOKEN_OFFSET + TOKEN_BYTES - 1)
                if not current:
                    return MISSING
                if current != expect:
                    return CONFLICT
            pipe.multi()
            pipe.set(key, value, px=ttl_ms)
            try:
                await pipe.execute()
            except rx.WatchError:
                return CONFLICT
        return OK

    async def delete(self, key: str, expect: bytes | None) -> str:
        args = [expect or b"", TOKEN_OFFSET]
        return _VERDICTS[int(await self._call("a delete", self._delete(keys=[key], args=args)))]

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._client.aclose(), self.timeout)
        except Exception as e:  # noqa: BLE001 - closing a dead connection is not worth failing
            log.debug("closing the sequence store: %s", e)


def make_store(spec: StoreSpec, environ: Mapping[str, str] = os.environ) -> SequenceStore | None:
    """The store a spec names: None for `memory` (the live state is all there is)."""
    if spec.type == "memory":
        return None
    password = environ.get(SEQUENCE_STORE_PASSWORD_ENV) or None
    if spec.password_required and password is None:
        raise ValueError(f"spec.runtime.sequences.store.passwordSecretRef is set but "
                         f"{SEQUENCE_STORE_PASSWORD_ENV} is not in the environment")
    return RedisStore(spec.address or "", password=password, timeout=spec.timeout)


# ------------------------------------------------------------------------------ the manager

def _own(array: np.ndarray) -> np.ndarray:
    """A state output as its own array: a row of a batch's output would keep the whole
    batch alive (and uncounted) for as long as the sequence lives."""
    base = array.base
    if array.flags.c_contiguous and (base is None or not isinstance(base, np.ndarray)
                                     or base.nbytes <= array.nbytes):
        return array
    return np.array(array, order="C")


@dataclasses.dataclass(eq=False)
class _Live:
    state: StoredState
    used: float  # the clock at its last step


class _KeyLock:
    __slots__ = ("lock", "holders")

    def __init__(self):
        self.lock = asyncio.Lock()
        self.holders = 0


Infer = Callable[[dict[str, np.ndarray]], Awaitable[dict[str, np.ndarray]]]


class SequenceManager:
    """One model's sequences on this replica: the live state in memory, the store behind it.

    `infer(inputs)` runs the model (the scheduler's submit). `inputs`/`outputs`: the engine's
    tensors (the pairs were checked against them). `store`: None keeps state in this
    replica's memory only (store type `memory`). `clock` is read for idle expiry in memory;
    the store's expiry is its own TTL, set to the idle timeout at every step.
    """

    def __init__(self, spec: SequenceSpec, model: str, engine_key: str, infer: Infer,
                 inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], *,
                 store: SequenceStore | None = None, namespace: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 initial: Mapping[str, np.ndarray] | None = None):
        problems = check_pairs(spec.states, inputs, outputs)
        if problems:
            raise ValueError("; ".join(problems))
        self.spec = spec
        self.model = model
        self.engine_key = engine_key
        self._infer = infer
        self._inputs = {s.name: s for s in inputs}
        self._pairs = dict(spec.states)  # state input -> state output
        # The model's declared initial state (an input's default value), else zeros.
        self._initial_values = {k: np.ascontiguousarray(v) for k, v in (initial or {}).items()
                                if k in self._pairs}
        self.store = store
        self._prefix = f"kiln:seq:{namespace + '/' if namespace else ''}{model}:"
        self._clock = clock
        self._live: OrderedDict[str, _Live] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._locks: dict[str, _KeyLock] = {}
        self._closing = False
        self._janitor: asyncio.Task | None = None

    # -- bookkeeping -------------------------------------------------------------------

    @property
    def live_sequences(self) -> int:
        return len(self._live)

    @property
    def live_bytes(self) -> int:
        return self._bytes

    def key(self, tenant: str, sequence_id: str) -> str:
        return f"{self._prefix}{tenant_hash(tenant)}:{sequence_id}"

    def _drop(self, key: str) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._bytes -= entry.state.nbytes

    def sweep(self) -> int:
        """Forget sequences idle past the timeout (in memory; the store's TTL does the same
        there). Returns how many. Runs on every step and from a background task."""
        limit = self._clock() - self.spec.idle_timeout
        expired = [k for k, e in self._live.items() if e.used <= limit and k not in self._locks]
        for k in expired:
            self._drop(k)
        return len(expired)

    def _keep(self, key: str, state: StoredState) -> None:
        """Hold `state` as the live state of `key`. Without a store it is the only copy: the
        bounds refuse (429) rather than drop it. With one, memory is a cache of the store:
        the least recently used sequences not mid-step make room, and a state that finds
        none is simply not cached."""
        old = self._live.get(key)
        grow = state.nbytes - (old.state.nbytes if old else 0)
        if self.store is None:
            if old is None and len(self._live) >= self.spec.max_live:
                raise self._bound(f"this replica holds maxLiveSequences ({self.spec.max_live}) "
                                  f"live sequences")
            if self._bytes + grow > self.spec.max_bytes_total:
                raise self._bound(f"this replica's live sequence state would reach "
                                  f"{self._bytes + grow} bytes, over maxBytesTotal "
                                  f"({self.spec.max_bytes_total})")
        else:
            for other in [k for k in self._live if k != key and k not in self._locks]:
                if (len(self._live) < self.spec.max_live or old is not None) \
                        and self._bytes + grow <= self.spec.max_bytes_total:
                    break
                self._drop(other)
            if (old is None and len(self._live) >= self.spec.max_live) \
                    or self._bytes + grow > self.spec.max_bytes_total:
                self._drop(key)  # it is in the store; the next step reads it from there
                return
        self._drop(key)
        self._live[key] = _Live(state, self._clock())
        self._bytes += state.nbytes

    def _bound(self, what: str) -> SequenceError:
        return SequenceError(Kind.OVERLOADED, f"model '{self.model}': {what}; end sequences "
                                  f"(sequence_end) or wait for idle ones to expire "
                                  f"(idleTimeoutSeconds {self.spec.idle_timeout:g})",
                             retry_after=min(self.spec.idle_timeout, 60.0))

    # -- the step ----------------------------------------------------------------------

    async def step(self, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any] | None,
                   tenant: str = "") -> dict[str, np.ndarray]:
        """One request of a sequence: its state in, the model run, its state out. Returns the
        outputs that are not state."""
        seq = parse_parameters(parameters)
        if seq is None:
            raise SequenceError(Kind.INVALID, f"model '{self.model}' is stateful: every request needs "
                                     f"parameters.sequence_id (with sequence_start: true on the "
                                     f"first step, sequence_end: true on the last)")
        if self._closing:
            raise SequenceError(Kind.UNAVAILABLE, "the server is shutting down; retry on another replica",
                                retry_after=STORE_RETRY_AFTER)
        key = self.key(tenant, seq.id)
        holder = self._locks.get(key)
        if holder is None:
            if self.store is not None and len(self._locks) >= self.spec.max_live:
                raise self._bound(f"{len(self._locks)} sequences are mid-step on this replica "
                                  f"(maxLiveSequences {self.spec.max_live})")
            holder = self._locks[key] = _KeyLock()
        holder.holders += 1
        try:
            async with holder.lock:
                return await self._step(key, seq, dict(inputs))
        finally:
            holder.holders -= 1
            if holder.holders == 0:
                del self._locks[key]

    async def _step(self, key: str, seq: SequenceParams,
                    inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        shown_id = shown(seq.id)
        for attempt in range(MAX_RACE_RETRIES + 1):
            self.sweep()
            live = self._live.get(key)
            if seq.start:
                if live is not None:
                    raise self._already_live(shown_id)
                if self.store is None and len(self._live) >= self.spec.max_live:
                    raise self._bound(f"this replica holds maxLiveSequences "
                                      f"({self.spec.max_live}) live sequences")
                state = StoredState(self.engine_key, 0, secrets.token_hex(8),
                                    self._initial(inputs))
                expect = None
            else:
                if live is not None:
                    state = live.state
                else:
                    state = await self._load(key, shown_id)
                expect = state.token
            self._check_size(state.nbytes, shown_id)
            outputs = await self._infer({**inputs, **state.tensors})
            missing = [o for o in self._pairs.values() if o not in outputs]
            if missing:
                raise SequenceError(Kind.FAILED, f"the engine returned no state output "
                                         f"{', '.join(missing)}")
            answer = {n: a for n, a in outputs.items() if n not in self._pairs.values()}
            if seq.end:
                if self.store is not None and expect is not None:
                    verdict = await self._store_call(self.store.delete(key, expect), key)
                    if verdict == CONFLICT:
                        self._drop(key)
                        continue  # advanced elsewhere meanwhile: run on its newest state
                self._drop(key)
                return answer
            new = StoredState(self.engine_key, state.step + 1, state.incarnation,
                              {i: _own(outputs[o]) for i, o in self._pairs.items()})
            self._check_size(new.nbytes, shown_id, grown=True)
            if self.store is not None:
                blob = await self._encode(new)
                verdict = await self._store_call(
                    self.store.put(key, blob, expect, int(self.spec.idle_timeout * 1000)), key)
                if verdict == CONFLICT:
                    self._drop(key)
                    if seq.start:
                        raise self._already_live(shown_id)
                    continue  # another replica stepped it after we read it: read it again
                if verdict == MISSING:
                    self._drop(key)
                    raise self._no_such(shown_id)
            self._keep(key, new)
            return answer
        raise SequenceError(Kind.CONFLICT, f"sequence {shown_id} was advanced by other requests "
                                 f"{MAX_RACE_RETRIES + 1} times while this step ran; send one "
                                 f"step of a sequence at a time")

    def _already_live(self, shown_id: str) -> SequenceError:
        return SequenceError(Kind.INVALID, f"sequence {shown_id} is already live (started, not ended "
                                  f"or expired): continue it without sequence_start, end it "
                                  f"with sequence_end, or use another sequence_id")

    def _no_such(self, shown_id: str) -> SequenceError:
        return SequenceError(Kind.NOT_FOUND, f"no such sequence {shown_id} for model '{self.model}': never "
                                  f"started, ended, or idle past idleTimeoutSeconds "
                                  f"({self.spec.idle_timeout:g} s); start it with "
                                  f"sequence_start: true")

    def _check_size(self, nbytes: int, shown_id: str, grown: bool = False) -> None:
        if nbytes > self.spec.max_bytes_per_sequence:
            what = "would grow to" if grown else "is"
            raise SequenceError(Kind.OVERLOADED, f"model '{self.model}': the state of sequence {shown_id} "
                                     f"{what} {nbytes} bytes, over maxBytesPerSequence "
                                     f"({self.spec.max_bytes_per_sequence}); end the sequence "
                                     f"(sequence_end) and start a shorter one")

    async def _load(self, key: str, shown_id: str) -> StoredState:
        if self.store is None:
            raise self._no_such(shown_id)
        blob = await self._store_call(self.store.get(key), key)
        if blob is None:
            raise self._no_such(shown_id)
        try:
            state = (await asyncio.to_thread(decode_state, blob) if len(blob) > _THREAD_BYTES
                     else decode_state(blob))
        except CorruptState as e:
            log.error("model %s: the stored state of %s is corrupt (%s); discarding it",
                      self.model, key, e)
            await self._discard(key, None)
            raise SequenceError(Kind.FAILED, f"the stored state of sequence {shown_id} is corrupt ({e}); "
                                     f"it was discarded, not used: start the sequence again") from None
        if state.engine_key != self.engine_key:
            raise SequenceError(Kind.CONFLICT, f"sequence {shown_id} was started on engine "
                                     f"{state.engine_key}; this replica serves engine "
                                     f"{self.engine_key} (another model version or build): a "
                                     f"state is never fed to another engine. Finish it on a "
                                     f"replica of its engine, or start a new sequence")
        misfit = _misfit(state.tensors, {i: self._inputs[i] for i in self._pairs})
        if misfit:
            # No replica of this engine can run it: fed to the engine, it would fail there
            # (and count against the pod's health) at every retry until it expired.
            log.warning("model %s: the stored state of %s does not fit the model (%s); "
                        "discarding it", self.model, key, misfit)
            await self._discard(key, state.token)
            raise SequenceError(Kind.CONFLICT, f"the stored state of sequence {shown_id} does not fit "
                                     f"this model's state inputs: {misfit}; it was discarded, "
                                     f"not used: start the sequence again")
        return state

    async def _discard(self, key: str, token: bytes | None) -> None:
        try:
            await self.store.delete(key, token)
        except (StoreUnavailable, StoreFull):
            pass  # it expires; until then every read refuses it again

    async def _encode(self, state: StoredState) -> bytes:
        if state.nbytes > _THREAD_BYTES:  # hashing and copying 64 MB takes tens of ms
            return await asyncio.to_thread(encode_state, state, self.model)
        return encode_state(state, self.model)

    async def _store_call(self, coro: Awaitable[Any], key: str) -> Any:
        try:
            return await coro
        except StoreUnavailable as e:
            self._drop(key)  # what memory holds may now differ from the store: reread next time
            raise SequenceError(Kind.UNAVAILABLE, f"{e}; sequence requests cannot run now (stateless "
                                     f"requests are unaffected); retry", STORE_RETRY_AFTER) from None
        except StoreFull as e:
            self._drop(key)
            raise SequenceError(Kind.OVERLOADED, f"{e}; end sequences or raise the store's maxmemory",
                                retry_after=min(self.spec.idle_timeout, 60.0)) from None

    def _initial(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's declared initial state where it has one (the input's default value),
        else zeros of each state input's shape: a dynamic dimension 0 is the request's batch,
        other dynamic dimensions start empty (0: no past yet, the KV-cache convention)."""
        batch = 1
        for name, array in inputs.items():
            spec = self._inputs.get(name)
            if spec is not None and spec.shape and spec.shape[0] < 0 and array.ndim:
                batch = int(array.shape[0])
                break
        out = {}
        for name in self._pairs:
            if name in self._initial_values:
                out[name] = self._initial_values[name]
                continue
            spec = self._inputs[name]
            shape = [d if d >= 0 else (batch if i == 0 else 0) for i, d in enumerate(spec.shape)]
            out[name] = np.zeros(shape, dtype=DATATYPES[spec.datatype])
        return out

    # -- life cycle --------------------------------------------------------------------

    def start(self) -> None:
        """Start the background sweep (memory is freed without waiting for a request)."""
        if self._janitor is None:
            self._janitor = asyncio.create_task(self._sweep_forever(),
                                                name=f"kiln-sequences-{self.model}")

    async def _sweep_forever(self) -> None:
        interval = max(0.5, min(self.spec.idle_timeout / 4, 30.0))
        while True:
            await asyncio.sleep(interval)
            self.sweep()

    async def close(self, timeout: float = 10.0) -> None:
        """Refuse new steps, let the running ones finish their writes (up to `timeout`), then
        close the store. Write-through leaves nothing else to flush: every answered step's
        state is in the store already."""
        self._closing = True
        if self._janitor is not None:
            self._janitor.cancel()
            self._janitor = None
        deadline = time.monotonic() + max(0.0, timeout)
        while self._locks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._locks:
            log.warning("model %s: %d sequence step(s) still running at shutdown; their "
                        "states stay as last stored", self.model, len(self._locks))
        held = len(self._live)
        self._live.clear()
        self._bytes = 0
        if self.store is not None:
            log.info("model %s: sequences closed; %d live state(s) were already in the store",
                     self.model, held)
            await self.store.close()
        elif held:
            log.warning("model %s: %d live sequence(s) end with this process (store: memory)",
                        self.model, held)
