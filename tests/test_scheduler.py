"""The scheduler's decisions on a small paged cache: token budget, chunked prefill beside decodes, first come
first served, preemption of the newest request when blocks run out, and nothing ever dropped."""

from types import SimpleNamespace

import pytest
import torch

from qinfer.engine.scheduler import Request, Scheduler
from qinfer.errors import QinferError
from qinfer.model.kv_cache import KVCache

CONFIG = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=8)  # all a cache reads of a ModelConfig


def scheduler(blocks: int, block_size: int = 8, **kwargs) -> Scheduler:
    """A scheduler over ``blocks`` blocks of ``block_size`` positions (no sequences bound: the scheduler's own)."""
    return Scheduler(KVCache(CONFIG, 0, block_size, torch.float32, block_size=block_size, num_blocks=blocks), **kwargs)


def run(s: Scheduler, steps: int = 1000) -> list[list[tuple[str, int, int]]]:
    """Run ``s`` to the end, sampling token 7 wherever a request samples; the (id, start, count) of every step."""
    log = []
    for _ in range(steps):
        if not s.has_work():
            break
        step = s.schedule()
        assert step.scheduled, "a step with work left must schedule something"
        log.append([(x.request.id, x.start, x.count) for x in step.scheduled])
        s.advance(step, {x.request.id: 7 for x in step.scheduled if x.samples})
    assert not s.has_work()
    return log


def test_a_long_prompt_is_chunked_while_the_others_decode():
    s = scheduler(blocks=32, max_step_tokens=16)
    s.add(Request("a", [1] * 4, max_tokens=6))
    first = s.schedule()
    s.advance(first, {"a": 7})
    s.add(Request("b", [2] * 40, max_tokens=2))
    steps = run(s)
    # every step until b's prompt is in gives a its token, and b the rest of the budget
    assert steps[0] == [("a", 4, 1), ("b", 0, 15)]
    assert steps[1] == [("a", 5, 1), ("b", 15, 15)]
    assert steps[2] == [("a", 6, 1), ("b", 30, 10)]
    assert all(sum(c for _, _, c in step) <= 16 for step in steps)


def test_requests_are_admitted_in_arrival_order_within_the_budgets():
    s = scheduler(blocks=32, max_step_tokens=10, max_running=2)
    for name in "abc":
        s.add(Request(name, [1] * 6, max_tokens=1))
    step = s.schedule()
    assert [(x.request.id, x.count) for x in step.scheduled] == [("a", 6), ("b", 4)]  # c waits: no sequence left
    assert [r.id for r in s.waiting] == ["c"]


def test_when_blocks_run_out_the_newest_request_is_preempted_and_computed_again():
    s = scheduler(blocks=4, max_step_tokens=64)  # 4 blocks of 8: 32 positions in all
    s.add(Request("old", [1] * 12, max_tokens=8))
    s.add(Request("new", [2] * 12, max_tokens=8))
    first = s.schedule()
    assert [(x.request.id, x.count) for x in first.scheduled] == [("old", 12), ("new", 12)]  # 2 blocks each
    s.advance(first, {"old": 7, "new": 7})
    for position in range(12, 16):  # decoding positions 12..15: still in the second blocks
        step = s.schedule()
        assert not step.preempted and [(x.request.id, x.start) for x in step.scheduled] == [("old", position),
                                                                                          ("new", position)]
        s.advance(step, {"old": 7, "new": 7})
    step = s.schedule()  # position 16 needs a third block each: none free, so "new" gives its two up
    assert [r.id for r in step.preempted] == ["new"] and [x.request.id for x in step.scheduled] == ["old"]
    assert s.waiting[0].id == "new" and s.waiting[0].computed == 0 and s.cache.pool.num_free == 1
    s.advance(step, {"old": 7})
    run(s)
    new = step.preempted[0]
    assert new.finished and len(new.generated) == 8 and new.preemptions >= 1  # recomputed, never dropped
    assert s.cache.pool.num_free == 4


def test_a_request_too_long_for_the_whole_cache_is_refused_when_added():
    s = scheduler(blocks=2)
    with pytest.raises(QinferError, match="need 3 KV-cache blocks; the cache has 2"):
        s.add(Request("x", [1] * 12, max_tokens=5))


def test_finish_frees_a_request_wherever_it_is():
    s = scheduler(blocks=8)
    s.add(Request("a", [1] * 5, max_tokens=4))
    s.add(Request("b", [1] * 5, max_tokens=4))
    step = s.schedule()
    s.finish(step.scheduled[0].request)  # aborted while running
    s.add(Request("c", [1] * 5, max_tokens=4))
    s.finish(s.waiting[-1])  # aborted while waiting
    assert [r.id for r in s.running] == ["b"] and not s.waiting and s.cache.pool.num_free == 7


def test_many_requests_all_finish_with_every_block_returned():
    s = scheduler(blocks=6, max_step_tokens=12, max_running=8)
    requests = [Request(str(i), [i] * (3 + i % 7), max_tokens=1 + i % 5) for i in range(20)]
    for r in requests:
        s.add(r)
    run(s)
    assert all(r.finished and len(r.generated) == r.max_tokens for r in requests)
    assert any(r.preemptions for r in requests)  # (the cache was too small for all of them at once)
    assert s.cache.pool.num_free == 6
