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

The parts, pure where they can be (each module imports only those above it):
- `spec`: `SequenceSpec`, `spec.runtime.sequences` parsed (the CRD's defaults applied
  before); each state input/output pair is checked against the engine's tensors (dtype,
  shape) by `engine.states.check_pairs`, at build and at load.
- `params`: a request's sequence parameters and its tenant, and `SequenceError`.
- `codec`: a state as one blob (`encode_state`, `decode_state`) with its token, the
  sequence's incarnation and step.
- `stores`: where state outlives the pod. `RedisStore` (redis.asyncio; every call bounded by
  the store's timeout) and `MemoryStore` (the same contract in this process: tests,
  benchmarks). Values are blobs; writes are compare-and-set on the blob's token, so a step
  that two replicas race on is applied once, and a write is one Redis command (a Lua
  script): never half a state.
- `manager`: `SequenceManager`, the live state in memory (bounded), the step, expiry, close.

Write-through: a step is answered only after its state is in the store, so the loss window
is none: a SIGTERM'd pod has nothing left to flush once its in-flight steps are done (its
drain waits for them), and any replica continues from the store. With store `memory` the
state lives in this pod alone and ends with it.

Errors are `SequenceError`s, a Refusal of a kind (each transport answers the kind its own
way): INVALID for bad sequence parameters or a bad tenant header; NOT_FOUND for no such
sequence (unknown, ended, expired or another tenant's: the same answer); CONFLICT when the
stored state belongs to another engine key, or does not fit the model's state inputs
(discarded), or a step raced another replica past the retries; OVERLOADED at a bound (the
message says which); FAILED for a stored state whose digest does not match (discarded,
never used); UNAVAILABLE, with a retry_after, when the store cannot be reached in time.
"""
