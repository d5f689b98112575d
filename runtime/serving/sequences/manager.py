"""`SequenceManager`: one model's sequences on this replica. Its step (a per-sequence lock;
the state from memory, else the store, else the initial state at the start; the model run;
the new state written through to the store before the answer), its bounded memory of live
states, idle expiry, and close. How the parts fit: the package's docstring.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Mapping, Sequence

import numpy as np

from kiln.runtime.engine.backends.base import DATATYPES, TensorSpec
from kiln.runtime.serving.tensors import shown
from kiln.runtime.serving.refusals import Kind
from kiln.runtime.serving.sequences.codec import (CorruptState, StoredState, decode_state,
                                                  encode_state, misfit)
from kiln.runtime.serving.sequences.params import (SequenceError, SequenceParams,
                                                   parse_parameters, tenant_hash)
from kiln.runtime.engine.states import check_pairs
from kiln.runtime.serving.sequences.spec import SequenceSpec
from kiln.runtime.serving.sequences.stores import (CONFLICT, MISSING, SequenceStore, StoreFull,
                                                   StoreUnavailable)

log = logging.getLogger(__name__)

# Seconds a client waits before retrying when the store cannot be reached.
STORE_RETRY_AFTER = 1.0
# A step that finds its state advanced by another replica reloads and runs again, this often.
MAX_RACE_RETRIES = 3
# States larger than this are encoded and hashed on a worker thread, not on the event loop.
_THREAD_BYTES = 1 << 20


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
        bounds refuse (Kind.OVERLOADED) rather than drop it. With one, memory is a cache of
        the store: the least recently used sequences not mid-step make room, and a state
        that finds none is simply not cached."""
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
        return SequenceError(Kind.OVERLOADED,
                             f"model '{self.model}': {what}; end sequences "
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
            raise SequenceError(Kind.INVALID,
                                f"model '{self.model}' is stateful: every request needs "
                                f"parameters.sequence_id (with sequence_start: true on the "
                                f"first step, sequence_end: true on the last)")
        if self._closing:
            raise SequenceError(Kind.UNAVAILABLE,
                                "the server is shutting down; retry on another replica",
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
                raise SequenceError(Kind.FAILED,
                                    f"the engine returned no state output "
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
        raise SequenceError(Kind.CONFLICT,
                            f"sequence {shown_id} was advanced by other requests "
                            f"{MAX_RACE_RETRIES + 1} times while this step ran; send one "
                            f"step of a sequence at a time")

    def _already_live(self, shown_id: str) -> SequenceError:
        return SequenceError(Kind.INVALID,
                             f"sequence {shown_id} is already live (started, not ended "
                             f"or expired): continue it without sequence_start, end it "
                             f"with sequence_end, or use another sequence_id")

    def _no_such(self, shown_id: str) -> SequenceError:
        return SequenceError(Kind.NOT_FOUND,
                             f"no such sequence {shown_id} for model '{self.model}': never "
                             f"started, ended, or idle past idleTimeoutSeconds "
                             f"({self.spec.idle_timeout:g} s); start it with "
                             f"sequence_start: true")

    def _check_size(self, nbytes: int, shown_id: str, grown: bool = False) -> None:
        if nbytes > self.spec.max_bytes_per_sequence:
            what = "would grow to" if grown else "is"
            raise SequenceError(Kind.OVERLOADED,
                                f"model '{self.model}': the state of sequence {shown_id} "
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
            raise SequenceError(Kind.FAILED,
                                f"the stored state of sequence {shown_id} is corrupt ({e}); "
                                f"it was discarded, not used: start the sequence again") from None
        if state.engine_key != self.engine_key:
            raise SequenceError(Kind.CONFLICT,
                                f"sequence {shown_id} was started on engine "
                                f"{state.engine_key}; this replica serves engine "
                                f"{self.engine_key} (another model version or build): a "
                                f"state is never fed to another engine. Finish it on a "
                                f"replica of its engine, or start a new sequence")
        problem = misfit(state.tensors, {i: self._inputs[i] for i in self._pairs})
        if problem:
            # No replica of this engine can run it: fed to the engine, it would fail there
            # (and count against the pod's health) at every retry until it expired.
            log.warning("model %s: the stored state of %s does not fit the model (%s); "
                        "discarding it", self.model, key, problem)
            await self._discard(key, state.token)
            raise SequenceError(Kind.CONFLICT,
                                f"the stored state of sequence {shown_id} does not fit "
                                f"this model's state inputs: {problem}; it was discarded, "
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
            raise SequenceError(Kind.UNAVAILABLE,
                                f"{e}; sequence requests cannot run now (stateless "
                                f"requests are unaffected); retry", STORE_RETRY_AFTER) from None
        except StoreFull as e:
            self._drop(key)
            raise SequenceError(Kind.OVERLOADED,
                                f"{e}; end sequences or raise the store's maxmemory",
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
