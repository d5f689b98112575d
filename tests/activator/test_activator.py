"""The activator over real sockets: held REST and gRPC requests at zero, answered by a real
runtime server (tests/support/serving.py's InferenceServer on its own loop, what `kiln
serve` runs) once its "pod" is Ready; the bounds (503 with Retry-After, gRPC UNAVAILABLE);
nothing sent twice; a burst of 1,000 held requests all answered.

The cluster is played by the test: the activation callback starts the runtime server (as
the scale from zero starts a pod) and puts its address in the table as the pod watch would.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import numpy as np
import pytest

from kiln.activator import table as tablemod
from kiln.activator.grpcproxy import GrpcProxy
from kiln.activator.holding import Holder
from kiln.activator.rest import RestProxy
from kiln.activator.routing import namespace_from_host
from kiln.activator.table import Table, endpoint_of
from kiln.runtime.api.contract import LABEL_MODEL
from kiln.runtime.serving.grpc import grpc_service_pb2 as pb
from support.metrics import wait_for_metric
from support.serving import TOPOLOGIES, NAME, Built, ServeProcess, ServerThread, json_inputs, sample, serve_in

NS = "ml"
HOST = f"{NAME}.{NS}.svc.cluster.local:8080"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("activator"))


def pod(name: str, ready: bool, ip: str = "127.0.0.1", http: int = 8080, grpc_port: int = 8081) -> dict:
    return {"metadata": {"name": name, "namespace": NS, "labels": {LABEL_MODEL: NAME}},
            "spec": {"containers": [{"name": "runtime", "ports": [{"name": "http", "containerPort": http},
                                                                   {"name": "grpc", "containerPort": grpc_port}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


class Cluster:
    """Plays the scale from zero: the first activation starts the runtime (`kiln serve` in
    `topology`), then its pod is Ready."""

    def __init__(self, built: Built, table: Table, start_delay: float = 0.3,
                 topology: str = TOPOLOGIES[0]) -> None:
        self.built, self.table, self.start_delay, self.topology = built, table, start_delay, topology
        self.activations: list[tuple[str, str]] = []
        self.server: ServerThread | ServeProcess | None = None

    async def activate(self, namespace: str, model: str) -> None:
        self.activations.append((namespace, model))
        if self.server is None:
            await asyncio.sleep(self.start_delay)  # the pod is scheduled and starts
            self.server = await asyncio.to_thread(self._start)
            self.table.set_pod(pod("p-0", True, http=self.server.port,
                                   grpc_port=int(self.server.grpc_address.rsplit(":", 1)[1])))

    def _start(self) -> ServerThread | ServeProcess:
        return serve_in(self.topology, self.built.cache, {"cpu": self.built.rel})

    def requests(self, count: int) -> None:
        """The runtime counted `count` successful requests (a front end's tally reaches the
        engine's /metrics a moment after its answer)."""
        assert self.server is not None
        wait_for_metric(self.server.url, "kiln_requests_total", {"model": NAME, "outcome": "success"},
                        lambda n: n >= count)
        assert self.server.metric("kiln_requests_total", model=NAME, outcome="success") == count

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class Activator:
    def __init__(self, holder: Holder) -> None:
        self.rest, self.grpc = RestProxy(holder), GrpcProxy(holder)

    async def __aenter__(self) -> "Activator":
        self.http_port = await self.rest.start("127.0.0.1", 0)
        self.grpc_port = await self.grpc.start("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.http_port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.grpc.stop()
        await self.rest.stop()


@pytest.fixture(params=TOPOLOGIES)
async def zero(built, request):
    """(activator, cluster, holder) for a model at zero, whose pod runs `kiln serve` in each
    topology."""
    table = Table()
    table.set_activating({(NS, NAME)})  # its Service points at the activator (the held EndpointSlice)
    cluster = Cluster(built, table, topology=request.param)
    holder = Holder(table, cluster.activate, max_queued=2000, max_wait=60)
    try:
        async with Activator(holder) as activator:
            yield activator, cluster, holder
    finally:
        await asyncio.to_thread(cluster.close)


def infer_doc(seed: int) -> tuple[dict, dict[str, np.ndarray]]:
    inputs = sample(1, seed)
    return {"id": str(seed), "inputs": json_inputs(inputs)}, inputs


def outputs_of(doc: dict) -> dict[str, np.ndarray]:
    dtypes = {"FP32": np.float32, "INT64": np.int64}
    return {o["name"]: np.array(o["data"], dtype=dtypes[o["datatype"]]).reshape(o["shape"]) for o in doc["outputs"]}


def assert_answer(built: Built, doc: dict, inputs: dict[str, np.ndarray]) -> None:
    want = built.expected(inputs)
    got = outputs_of(doc)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


async def post(session: aiohttp.ClientSession, url: str, doc: dict, host: str = HOST) -> tuple[int, dict, dict]:
    async with session.post(f"{url}/v2/models/{NAME}/infer", data=json.dumps(doc).encode(),
                            headers={"Content-Type": "application/json", "Host": host}) as r:
        return r.status, dict(r.headers), json.loads(await r.read())


# ------------------------------------------------------------------ pure parts

def test_a_pod_is_an_endpoint_only_while_ready():
    assert endpoint_of(pod("p", True, "10.0.0.7", 9000, 9001)) == (
        (NS, NAME), tablemod.Endpoint("10.0.0.7", 9000, 9001))
    assert endpoint_of(pod("p", False)) == ((NS, NAME), None)
    terminating = pod("p", True)
    terminating["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    assert endpoint_of(terminating) == ((NS, NAME), None)
    assert endpoint_of({"metadata": {"name": "x", "namespace": NS, "labels": {}}}) is None
    table = Table()
    table.set_pod(pod("p", True, "10.0.0.7"))
    assert [e.host for e in table.ready((NS, NAME))] == ["10.0.0.7"]
    table.set_pod(pod("p", False, "10.0.0.7"))
    assert table.ready((NS, NAME)) == []


@pytest.mark.parametrize("host, namespace", [
    ("multi.ml.svc.cluster.local:8080", "ml"), ("multi.ml.svc", "ml"), ("multi.ml:8080", "ml"),
    ("multi:8080", None), ("10.0.0.7:8080", None), ("[fd00::7]:8080", None), (None, None),
    ("www.example.com", None)])
def test_the_namespace_comes_from_the_service_host(host, namespace):
    assert namespace_from_host(host) == namespace


def test_a_short_host_finds_the_one_namespace_the_table_knows():
    from kiln.activator.routing import model_key

    table = Table()
    assert model_key(NAME, "multi:8080", table, None) is None
    table.set_activating({(NS, NAME)})
    assert model_key(NAME, "multi:8080", table, None) == (NS, NAME)
    table.set_activating({(NS, NAME), ("other", NAME)})
    assert model_key(NAME, "multi:8080", table, "fallback") == ("fallback", NAME)
    assert model_key(NAME, "multi:8080", table, "fallback", named="other") == ("other", NAME)


# ------------------------------------------------------------------ held, then forwarded

async def test_a_rest_request_at_zero_is_held_activates_once_and_is_answered(zero, built):
    activator, cluster, holder = zero
    doc, inputs = infer_doc(1)
    async with aiohttp.ClientSession() as s:
        status, _, answer = await post(s, activator.url, doc)
    assert status == 200, answer
    assert_answer(built, answer, inputs)
    assert cluster.activations == [(NS, NAME)]
    await asyncio.to_thread(cluster.requests, 1)
    # With a Ready pod, metadata and readiness go straight through.
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{activator.url}/v2/models/{NAME}/ready", headers={"Host": HOST}) as r:
            assert r.status == 200
    assert holder.activations == 1


async def test_a_burst_of_1000_held_requests_is_answered_each_once(zero, built):
    activator, cluster, holder = zero
    docs = [infer_doc(seed) for seed in range(1000)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        answers = await asyncio.gather(*(post(s, activator.url, doc) for doc, _ in docs))
    assert [status for status, _, _ in answers] == [200] * 1000, [a for a in answers if a[0] != 200][:3]
    for (doc, inputs), (_, _, answer) in zip(docs, answers):
        assert answer["id"] == doc["id"]
        assert_answer(built, answer, inputs)
    assert holder.activations == 1
    # Each answered once: the runtime counted exactly 1,000 requests, all successes.
    await asyncio.to_thread(cluster.requests, 1000)
    assert activator.rest.forwarded == 1000


async def test_a_grpc_request_at_zero_is_held_and_answered(zero, built):
    activator, cluster, _ = zero
    inputs = sample(2, seed=5)
    request = pb.ModelInferRequest(model_name=NAME, id="g1")
    for name, array in inputs.items():
        request.inputs.add(name=name, datatype="FP32" if array.dtype == np.float32 else "INT64",
                           shape=list(array.shape))
        request.raw_input_contents.append(array.tobytes())
    # The namespace: the model's held EndpointSlice names it (grpc.aio shows no :authority).
    async with grpc.aio.insecure_channel(f"127.0.0.1:{activator.grpc_port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        answer = await infer(request, timeout=60)
        ready = channel.unary_unary("/inference.GRPCInferenceService/ModelReady",
                                    request_serializer=pb.ModelReadyRequest.SerializeToString,
                                    response_deserializer=pb.ModelReadyResponse.FromString)
        assert (await ready(pb.ModelReadyRequest(name=NAME), timeout=10)).ready
    assert answer.id == "g1"
    want = built.expected(inputs)
    dtypes = {"FP32": np.float32, "INT64": np.int64}
    for out, raw in zip(answer.outputs, answer.raw_output_contents):
        got = np.frombuffer(raw, dtype=dtypes[out.datatype]).reshape(list(out.shape))
        np.testing.assert_allclose(got, want[out.name], rtol=1e-5, atol=1e-5)
    assert cluster.activations == [(NS, NAME)]


# ------------------------------------------------------------------ the bounds

async def never(namespace: str, model: str) -> None:
    """An activation whose pod never becomes Ready."""


def at_zero() -> Table:
    table = Table()
    table.set_activating({(NS, NAME)})
    return table


async def test_a_model_the_activator_does_not_serve_is_404_and_never_scaled():
    """The namespace and name come from the request (Host, header, metadata): only a model
    whose Service points at the activator is held and scaled."""
    woken = []

    async def activate(namespace: str, model: str) -> None:
        woken.append((namespace, model))

    holder = Holder(at_zero(), activate, max_queued=3, max_wait=5)
    async with Activator(holder) as activator, aiohttp.ClientSession() as s:
        status, _, body = await post(s, activator.url, infer_doc(0)[0], host=f"{NAME}.kube-system.svc:8080")
        assert status == 404 and "not one the activator holds" in body["error"], body
        async with grpc.aio.insecure_channel(f"127.0.0.1:{activator.grpc_port}") as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await infer(pb.ModelInferRequest(model_name="other"), timeout=10,
                            metadata=(("kiln-namespace", NS),))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert woken == [] and holder.held((NS, NAME)) == 0


async def test_past_the_queue_bound_a_request_is_refused_with_retry_after():
    holder = Holder(at_zero(), never, max_queued=3, max_wait=30)
    async with Activator(holder) as activator, aiohttp.ClientSession() as s:
        held = [asyncio.create_task(post(s, activator.url, infer_doc(i)[0])) for i in range(3)]
        while holder.held((NS, NAME)) < 3:
            await asyncio.sleep(0.01)
        status, headers, body = await post(s, activator.url, infer_doc(9)[0])
        assert status == 503 and headers["Retry-After"] == "5", body
        assert "already held" in body["error"]
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


async def test_past_the_wait_bound_rest_gets_503_and_grpc_unavailable():
    holder = Holder(at_zero(), never, max_queued=10, max_wait=0.3)
    async with Activator(holder) as activator:
        async with aiohttp.ClientSession() as s:
            status, headers, body = await post(s, activator.url, infer_doc(0)[0])
        assert status == 503 and headers["Retry-After"] == "5"
        assert "no Ready replica after 0.3s" in body["error"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{activator.grpc_port}") as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await infer(pb.ModelInferRequest(model_name=NAME), timeout=10,
                            metadata=(("kiln-namespace", NS),))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dict(info.value.trailing_metadata())["retry-after"] == "5"


async def test_a_request_that_reached_a_pod_is_never_sent_again():
    """The pod reads the request and drops the connection: a 502, and the pod saw it once."""
    seen = []

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    table = Table()
    table.set_pod(pod("p-0", True, http=port))
    async with server, Activator(Holder(table, never)) as activator, aiohttp.ClientSession() as s:
        status, _, body = await post(s, activator.url, infer_doc(0)[0])
    assert status == 502, body
    assert len(seen) == 1


async def test_a_connection_refused_before_sending_tries_again():
    """The first pod in the table is gone (connection refused): nothing was sent, so the
    request waits for the next Ready pod and is answered there."""
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    dead = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    answers = []

    async def ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        answers.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                     b"Connection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(ok, "127.0.0.1", 0)
    table = Table()
    table.set_pod(pod("p-0", True, http=dead))
    async with server, Activator(Holder(table, never)) as activator, aiohttp.ClientSession() as s:
        async def pod_replaced() -> None:
            await asyncio.sleep(0.1)
            table.remove_pod(NS, "p-0")
            table.set_pod(pod("p-1", True, http=server.sockets[0].getsockname()[1]))
        replaced = asyncio.create_task(pod_replaced())
        status, _, body = await post(s, activator.url, infer_doc(0)[0])
        await replaced
    assert status == 200 and answers == [1], body


async def test_a_grpc_stream_at_zero_is_held_on_its_first_message_then_piped_to_the_pod(zero, built):
    activator, cluster, _ = zero
    requests = []
    for i in range(3):
        inputs = sample(1, seed=20 + i)
        request = pb.ModelInferRequest(model_name=NAME, id=f"s{i}")
        for name, array in inputs.items():
            request.inputs.add(name=name, datatype="FP32" if array.dtype == np.float32 else "INT64",
                               shape=list(array.shape))
            request.raw_input_contents.append(array.tobytes())
        requests.append(request)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{activator.grpc_port}") as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       request_serializer=pb.ModelInferRequest.SerializeToString,
                                       response_deserializer=pb.ModelStreamInferResponse.FromString)

        async def messages():
            for r in requests:
                yield r

        answers = [a async for a in stream(messages(), metadata=(("kiln-namespace", NS),), timeout=60)]
    assert sorted(a.infer_response.id for a in answers) == ["s0", "s1", "s2"]
    assert all(not a.error_message for a in answers)
    assert cluster.activations == [(NS, NAME)]
    await asyncio.to_thread(cluster.requests, 3)


def test_kiln_activator_is_a_subcommand_whose_help_needs_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys; from kiln.cli import main; import kiln.activator.command; "
            "print(sorted(m for m in ('aiohttp', 'grpc', 'kubernetes') if m in sys.modules)); main(['activator', '--help'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, rest = out.stdout.split("\n", 1)
    assert first == "[]"  # the command module alone imports none of them
    for flag in ("--max-queued", "--max-wait-seconds", "--http-port", "--grpc-port", "--namespace"):
        assert flag in rest


# -- the REST door's bounds (issue 35 items 2, 3 and 5): kiln serve's HTTP server -------------

async def _raw(port: int, data: bytes, wait: float) -> bytes:
    """What the door answers to `data` within `wait` s (b"" when it closes without a word)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        async with asyncio.timeout(wait):
            return await reader.read()
    finally:
        writer.close()


@pytest.fixture
async def door():
    from kiln.runtime.serving.rest.connections import ConnectionLimits

    table = Table()
    table.set_activating({(NS, NAME)})
    activated = []
    holder = Holder(table, lambda key: activated.append(key), max_queued=10, max_wait=5)
    proxy = RestProxy(holder, max_body_bytes=1 << 20,
                      limits=ConnectionLimits(header_timeout=1.0), body_timeout=1.0)
    port = await proxy.start("127.0.0.1", 0)
    try:
        yield port, activated
    finally:
        await proxy.stop()


HEAD = (f"POST /v2/models/{NAME}/infer HTTP/1.1\r\nHost: {HOST}\r\n"
        f"Content-Type: application/json\r\n")


@pytest.mark.timeout(30)
async def test_the_activator_closes_slow_headers_times_out_slow_bodies_and_refuses_big_ones_at_once(
        door, caplog):
    port, activated = door
    loop = asyncio.get_running_loop()
    # Headers trickled past the header timeout: the connection is closed, no request made.
    started = loop.time()
    answer = await _raw(port, HEAD.encode(), wait=10)  # TimeoutError if it is never closed
    assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer[:300]
    assert loop.time() - started < 5
    # A body announced and never sent in full: 408 after the body timeout.
    started = loop.time()
    answer = await _raw(port, (HEAD + "Content-Length: 100\r\n\r\n{\"in").encode(), wait=10)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer, answer[:300]
    assert loop.time() - started < 5
    # A length over the bound: 413 at once, before any of the body (none is sent); the
    # connection closes a lingering second later (ConnectionLimits.lingering_timeout).
    started = loop.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((HEAD + "Content-Length: 1073741824\r\n\r\n").encode())
    async with asyncio.timeout(10):
        status = await reader.readline()
    assert status.startswith(b"HTTP/1.1 413") and loop.time() - started < 1, status
    async with asyncio.timeout(10):
        answer = await reader.read()
    writer.close()
    assert b"1073741824 bytes" in answer, answer[:300]
    # A client that resets mid-body: no traceback in the log.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((HEAD + "Content-Length: 100000\r\n\r\n" + "x" * 1000).encode())
    await writer.drain()
    sock = writer.get_extra_info("socket")
    import socket as socketmod
    import struct
    sock.setsockopt(socketmod.SOL_SOCKET, socketmod.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    await asyncio.sleep(1.5)
    assert activated == []  # nothing of it reached the holder
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"], \
        [r.getMessage() for r in caplog.records]


@pytest.mark.timeout(30)
async def test_a_full_queue_is_refused_before_the_body_is_read():
    table = Table()
    table.set_activating({(NS, NAME)})
    holder = Holder(table, lambda key: None, max_queued=1, max_wait=10)
    proxy = RestProxy(holder, max_body_bytes=8 << 20)
    port = await proxy.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(post(session, f"http://127.0.0.1:{port}", infer_doc(1)[0]))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while holder.held((NS, NAME)) < 1:  # the first is held: the queue is full
                assert loop.time() < deadline
                await asyncio.sleep(0.02)
            # 4 MiB announced, none of it sent: refused at once, the body never waited for.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write((HEAD + f"Content-Length: {4 << 20}\r\n\r\n").encode())
            started = loop.time()
            async with asyncio.timeout(5):
                status = await reader.readline()
            writer.close()
            assert status.startswith(b"HTTP/1.1 503") and loop.time() - started < 1, status
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
    finally:
        await proxy.stop()
