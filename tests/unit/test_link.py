"""minddp.perf.link, the modelled link of `bench-ddp --link-gbps`: buckets in turn, each future
completed when its transfer ends; and the report's columns for it."""

import argparse
import time

import pytest
import torch

from minddp.perf.link import Link
from minddp.tools.bench_ddp import compile_blocks


def test_buckets_go_over_the_link_in_turn_and_complete_when_their_transfer_ends():
    link = Link(8.0, latency_s=0.0)  # 1 GB/s: 10 MB in 10 ms
    buckets = [torch.zeros(10**7 // 4) for _ in range(3)]
    start = time.perf_counter()
    futures = [link.send(b) for b in buckets]
    handed = time.perf_counter()
    assert link.sent_s == pytest.approx(0.03)
    assert link.tail_s() == pytest.approx(0.03 - (handed - start), abs=2e-3)
    for k, (f, b) in enumerate(zip(futures, buckets)):
        assert f.wait() is b
        assert time.perf_counter() - start >= 0.01 * (k + 1)
    later = link.send(buckets[0])  # the link was free again: 10 ms from now
    assert link.tail_s() == pytest.approx(0.01)
    later.wait()


def test_a_link_needs_a_bandwidth():
    with pytest.raises(ValueError, match="above 0 Gbit/s"):
        Link(0)


def test_the_report_names_the_link_and_adds_its_columns():
    row = {"label": "minddp DDP(compile(model))", "vs_torch": [1.0], "step_ms": [500.0],
           "exposed_ms": [60.0], "wait_ms": [55.0], "local_ms": [400.0], "tail_ms": [58.0],
           "transfer_ms": [170.0]}
    args = argparse.Namespace(link_gbps=2.0, compile_cap=None, compile_backend="aot_eager")
    text, table = compile_blocks(args, [row])
    assert "2 Gbit/s" in text and "170 ms, 42% of the backward under no_sync (400 ms" in text
    assert table["header"][-4:] == ["link busy after the last bucket (ms)", "spread",
                                    "backward under no_sync (ms)", "spread"]
    assert table["rows"][0][-4:] == ["58.0", "58.0-58.0", "400", "400-400"]
    args.link_gbps = 0.0
    text, table = compile_blocks(args, [row])
    assert "link" not in text and len(table["header"]) == 9
