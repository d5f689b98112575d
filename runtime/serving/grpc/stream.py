"""Triton's bidirectional `ModelStreamInfer`: ModelInferRequests in, ModelStreamInferResponses
out, on one call (what tritonclient's `start_stream` / `async_stream_infer` and the aio
client's `stream_infer` use, and Triton's sequence examples are written with).

Each message is answered exactly as a unary ModelInfer is, by the endpoint's one per-request
path (`infer_message`: the same checks and messages, tenancy from the call's metadata,
admission, draining, kiln_requests_total and the latency histogram). What the stream adds:

- A refusal is an answer, not the end: `error_message` set, `infer_response` carrying only
  the request's model, version and id (as Triton repopulates it, so a client knows which
  request failed); bytes that are not a ModelInferRequest likewise. The stream goes on.
- Requests of one stream run concurrently, except that those naming the same sequence
  (`sequence_id`) run one after the other in the order they arrived, so each step sees the
  state the previous one left (Triton's guarantee). Every answer carries its request's id;
  answers of different sequences may come back in any order.
- At most `MAX_IN_FLIGHT` requests of one stream are unanswered at a time; beyond, the
  stream stops reading (HTTP/2 flow control then holds the client back) until one is
  answered: backpressure, not refusal. A client that goes away cancels the whole stream,
  every request of it still running.
- Draining (SIGTERM): requests already read finish and are answered; those read after get
  the draining refusal (UNAVAILABLE's message); once none of the stream is in flight the
  call ends with status UNAVAILABLE, so the client reconnects to another replica.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import grpc
from google.protobuf.message import DecodeError

from kiln.runtime.serving.grpc import grpc_service_pb2 as pb
from kiln.runtime.serving.refusals import Refusal, cut, internal_error
from kiln.runtime.serving.sequences.params import names_sequence

log = logging.getLogger("kiln.runtime.grpc")

# Unanswered requests one stream may hold; the next message is read once one is answered.
MAX_IN_FLIGHT = 64
DRAINING_MESSAGE = "the server is shutting down; reconnect to another replica"

Metadata = Iterable[tuple[str, str]]
InferMessage = Callable[[pb.ModelInferRequest, Metadata], Awaitable[pb.ModelInferResponse]]


def sequence_of(request: pb.ModelInferRequest) -> str | None:
    """The sequence a request names (its sequence_id as text, so 7 and "7" are one), else
    None. Only orders the stream: the sequence manager checks the value itself."""
    if "sequence_id" not in request.parameters:  # `in`: reading a missing key would add it
        return None
    param = request.parameters["sequence_id"]
    choice = param.WhichOneof("parameter_choice")
    value = getattr(param, choice) if choice else None
    return str(value) if names_sequence({"sequence_id": value}) else None


def refused(request: pb.ModelInferRequest | None, message: str) -> pb.ModelStreamInferResponse:
    """The answer to a request refused (None: bytes that are not a request)."""
    answer = pb.ModelStreamInferResponse(error_message=cut(message))
    if request is not None:
        answer.infer_response.model_name = request.model_name
        answer.infer_response.model_version = request.model_version
        answer.infer_response.id = request.id
    return answer


class ModelStreamInfer:
    """The method: `handle` is the stream_stream handler `GrpcEndpoint._handlers` registers
    (a coroutine function, so grpc.aio writes with context.write), one instance for every
    stream, each call's state its own `_Stream`."""

    def __init__(self, infer_message: InferMessage, draining: asyncio.Event,
                 max_in_flight: int = MAX_IN_FLIGHT):
        """`draining`: set when the server starts to drain (the dataplane's)."""
        self._infer_message = infer_message
        self._draining = draining
        self._max_in_flight = max_in_flight

    async def handle(self, requests: AsyncIterator[bytes],
                     context: grpc.aio.ServicerContext) -> None:
        stream = _Stream(self._infer_message, tuple(context.invocation_metadata() or ()),
                         self._max_in_flight)
        writer = asyncio.create_task(stream.write_answers(context), name="stream answers")
        try:
            cut_by_drain = await stream.read_all(requests, self._draining)
            await stream.finish(writer)
        finally:
            # Normally nothing is left; when the client went away (this task cancelled),
            # every request of the stream still running.
            await stream.cancel(writer)
        if cut_by_drain:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)


class _Stream:
    """One call's requests in flight, each sequence's last one, and the answers to write.
    Every message read takes a place (`room`); writing its answer gives it back."""

    def __init__(self, infer_message: InferMessage, metadata: Metadata, max_in_flight: int):
        self._infer_message = infer_message
        self._metadata = metadata
        self._room = asyncio.Semaphore(max_in_flight)
        self._answers: asyncio.Queue[pb.ModelStreamInferResponse] = asyncio.Queue()
        self._running: set[asyncio.Task] = set()
        self._last_of_sequence: dict[str, asyncio.Task] = {}

    async def read_all(self, requests: AsyncIterator[bytes], drain: asyncio.Event) -> bool:
        """Read and start every request until the client stops sending (False), or until
        the server drains and every request read is answered (True: the stream is cut)."""
        reader = asyncio.create_task(self._read(requests), name="stream requests")
        drained = asyncio.create_task(drain.wait())
        try:
            await asyncio.wait({reader, drained}, return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():
                # Draining: go on reading (infer_message refuses what comes now) until
                # what was accepted is answered.
                await self._idle_or(reader)
            if reader.done():
                reader.result()  # what reading raised, if anything
                return False
            return True
        finally:
            drained.cancel()
            reader.cancel()
            await asyncio.gather(reader, drained, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        iterator = requests.__aiter__()
        while True:
            await self._room.acquire()  # backpressure: no read while the stream is full
            try:
                data = await iterator.__anext__()
            except StopAsyncIteration:
                self._room.release()
                return
            except BaseException:
                self._room.release()
                raise
            self._start(data)

    def _start(self, data: bytes) -> None:
        try:
            request = pb.ModelInferRequest.FromString(data)
        except DecodeError:
            log.info("gRPC stream: answered %d bytes that are not a valid "
                     "inference.ModelInferRequest with an error", len(data))
            self._answers.put_nowait(refused(None, (
                f"the message is not a valid inference.ModelInferRequest: protobuf cannot "
                f"parse its {len(data)} bytes (malformed, cut short, or a string that is "
                f"not UTF-8)")))
            return
        sequence = sequence_of(request)
        previous = self._last_of_sequence.get(sequence) if sequence is not None else None
        task = asyncio.create_task(self._answer(request, previous),
                                   name=f"stream request {request.id!r}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        if sequence is not None:
            self._last_of_sequence[sequence] = task
            task.add_done_callback(lambda t: self._forget(sequence, t))

    def _forget(self, sequence: str, task: asyncio.Task) -> None:
        if self._last_of_sequence.get(sequence) is task:
            del self._last_of_sequence[sequence]

    async def _answer(self, request: pb.ModelInferRequest, previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.wait({previous})  # the sequence's step before, however it ended
        try:
            response = await self._infer_message(request, self._metadata)
            answer = pb.ModelStreamInferResponse(infer_response=response)
        except Refusal as e:
            answer = refused(request, e.message)
        except Exception:  # a bug: logged, answered with a request id, and the stream goes on
            answer = refused(request, internal_error(
                log, f"gRPC stream request {request.id[:64]!r}").message)
        self._answers.put_nowait(answer)

    async def _idle_or(self, reader: asyncio.Task) -> None:
        """Until no request of the stream runs, or the reader ends."""
        while self._running and not reader.done():
            await asyncio.wait({reader, *self._running}, return_when=asyncio.FIRST_COMPLETED)

    async def write_answers(self, context: grpc.aio.ServicerContext) -> None:
        while True:
            answer = await self._answers.get()
            await context.write(answer)
            self._answers.task_done()
            self._room.release()

    async def finish(self, writer: asyncio.Task) -> None:
        """Until every request read is answered and every answer written."""
        while self._running:
            await asyncio.wait(set(self._running))
        written = asyncio.create_task(self._answers.join())
        try:
            await asyncio.wait({written, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            written.cancel()
        if writer.done():
            writer.result()  # the write that failed

    async def cancel(self, writer: asyncio.Task) -> None:
        tasks: list[Any] = [writer, *self._running]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
