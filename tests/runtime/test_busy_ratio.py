"""`kiln_engine_busy_ratio`: the recent fraction of engine capacity in use, one read (the
operator's pod-deletion-cost reads it once at a scale-down, with no memory of a counter)."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kiln.runtime.serving.metrics import BusyWindow, ServerMetrics
from kiln.runtime.serving.workers.engines import merge_metrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_window_is_the_busy_seconds_of_its_last_30_s():
    clock = Clock()
    window = BusyWindow(30, clock)
    assert window.ratio() == 0.0
    window.add(3.0)
    clock.now += 10
    window.add(6.0)
    assert window.ratio() == 0.3
    clock.now += 25  # the first second left the window, the second not yet
    assert window.ratio() == 0.2
    clock.now += 10
    assert window.ratio() == 0.0


def test_the_window_never_reads_above_one():
    clock = Clock()
    window = BusyWindow(30, clock)
    window.add(45.0)  # one long execution ends: it counts in the second it ended
    assert window.ratio() == 1.0


def test_the_gauge_reads_the_window_at_scrape_time():
    metrics = ServerMetrics()
    window = metrics.busy_window("m", "1")
    window.add(15.0)
    assert metrics.registry.get_sample_value("kiln_engine_busy_ratio", {"model": "m", "version": "1"}) == 0.5


def test_a_context_pool_counts_its_executions_in_the_window():
    from kiln.runtime.serving.scheduling.pool import ContextPool

    class Engine:
        contexts_any_thread = False

        def create_context(self):
            return self

        def run(self, inputs):
            return dict(inputs)

    clock = iter([0.0, 3.0] * 10).__next__  # each execution takes 3 s of the pool's clock
    metrics = ServerMetrics()
    pool = ContextPool(Engine(), 2, metrics, "m", version="1", clock=clock)

    async def main() -> None:
        await pool.start()
        slot = await pool.acquire()
        try:
            await pool.run(slot, {})
        finally:
            pool.release(slot)
            await pool.close()

    asyncio.run(main())
    # 3 s on one of two contexts: 1.5 s of capacity, over the 30 s window.
    assert metrics.registry.get_sample_value("kiln_engine_busy_ratio", {"model": "m", "version": "1"}) == 0.05


def test_engine_processes_average_their_ratios_not_sum_them():
    first, second = ServerMetrics(), ServerMetrics()
    first.busy_window("m", "1").add(27.0)  # 0.9
    second.busy_window("m", "1").add(3.0)  # 0.1
    merged = merge_metrics([generate_latest(first.registry), generate_latest(second.registry)], 2)
    [value] = [s.value for f in text_string_to_metric_families(merged.decode()) for s in f.samples
               if s.name == "kiln_engine_busy_ratio"]
    assert abs(value - 0.5) < 1e-9
