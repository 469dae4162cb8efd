"""The scheduler's decisions on a small paged cache: token budget, chunked prefill beside decodes, first come
first served, preemption of the newest request when blocks run out, and nothing ever dropped."""

from types import SimpleNamespace

import pytest
import torch

from qinfer.engine.scheduler import Request, Scheduler
from qinfer.errors import QinferError
from qinfer.model.kv_cache import KVCache

CONFIG = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=8)  # all a cache reads of a ModelConfig


def scheduler(blocks: int, block_size: int = 8, max_step_tokens: int = 64, max_running: int = 8,
              prefill_chunk: int = 16, **kwargs) -> Scheduler:
    """A scheduler over ``blocks`` blocks of ``block_size`` positions (no sequences bound: the scheduler's own)."""
    cache = KVCache(CONFIG, 0, block_size, torch.float32, block_size=block_size, num_blocks=blocks)
    return Scheduler(cache, max_step_tokens, max_running, prefill_chunk, **kwargs)


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


def test_prompts_run_in_whole_chunks_on_a_fixed_grid_while_the_others_decode():
    s = scheduler(blocks=32, max_step_tokens=16, max_running=4, prefill_chunk=12)
    s.add(Request("a", [1] * 4, max_tokens=6))
    first = s.schedule()
    s.advance(first, {"a": 7})
    s.add(Request("b", [2] * 40, max_tokens=2))
    steps = run(s)
    # every step until b's prompt is in gives a its token first, and b its next chunk, ending at a multiple of 12
    assert steps[:4] == [[("a", 4, 1), ("b", 0, 12)], [("a", 5, 1), ("b", 12, 12)], [("a", 6, 1), ("b", 24, 12)],
                         [("a", 7, 1), ("b", 36, 4)]]
    assert all(sum(c for _, _, c in step) <= 16 for step in steps)


def test_a_chunk_that_does_not_fit_the_budget_waits_whole():
    s = scheduler(blocks=32, max_step_tokens=16, max_running=4, prefill_chunk=12)
    s.add(Request("a", [1] * 12, max_tokens=3))
    s.add(Request("b", [2] * 12, max_tokens=3))
    steps = run(s)
    assert steps[0] == [("a", 0, 12)]  # b's chunk of 12 would not fit the 4 tokens left: it is not cut
    assert steps[1] == [("a", 12, 1), ("b", 0, 12)]


def test_the_budget_must_hold_a_token_per_sequence_and_a_chunk():
    with pytest.raises(QinferError, match="must hold a token for each of 8 running sequences and a prompt chunk"):
        scheduler(blocks=4, max_step_tokens=16, max_running=8, prefill_chunk=12)


def test_requests_are_admitted_in_arrival_order_within_the_budgets():
    s = scheduler(blocks=32, max_step_tokens=14, max_running=2, prefill_chunk=6)
    for name in "abc":
        s.add(Request(name, [1] * 6, max_tokens=1))
    step = s.schedule()
    assert [(x.request.id, x.count) for x in step.scheduled] == [("a", 6), ("b", 6)]  # c waits: no sequence left
    assert [r.id for r in s.waiting] == ["c"]


def test_when_blocks_run_out_the_newest_request_is_preempted_and_computed_again():
    s = scheduler(blocks=4, max_step_tokens=64, max_running=4, prefill_chunk=16)  # 4 blocks of 8: 32 positions
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
    s = scheduler(blocks=4, max_step_tokens=12, max_running=4, prefill_chunk=8)
    requests = [Request(str(i), [i] * (3 + i % 7), max_tokens=1 + i % 5) for i in range(20)]
    for r in requests:
        s.add(r)
    run(s)
    assert all(r.finished and len(r.generated) == r.max_tokens for r in requests)
    assert any(r.preemptions for r in requests)  # (the cache was too small for all of them at once)
    assert s.cache.pool.num_free == 4


def test_a_preempted_request_computes_its_generated_tokens_again_past_the_chunk_grid():
    s = scheduler(blocks=8, prefill_chunk=8, prefix_caching=False)
    r = Request("r", [1] * 8, max_tokens=20)
    s.add(r)
    for _ in range(11):  # the prompt, then 10 more tokens: 11 generated
        s.advance(s.schedule(), {"r": 7})
    s._preempt(r)
    step = s.schedule()
    assert [(x.start, x.count) for x in step.scheduled] == [(0, 8)]  # the prompt: its chunk
    s.advance(step, {})
    step = s.schedule()
    assert [(x.start, x.count, x.samples) for x in step.scheduled] == [(8, 11, True)]  # all generated, one step


def test_a_request_reuses_every_cached_block_of_a_shared_prefix_and_chunks_from_there():
    s = scheduler(blocks=16, prefill_chunk=16)  # blocks of 8
    first = Request("first", list(range(40)), max_tokens=2)
    s.add(first)
    run(s)  # finished: its blocks are free, and cached
    assert s.cache.pool.num_free == 16 and s.cache.pool.cached_blocks == 5  # 41 computed tokens: 5 full blocks
    shared = Request("shared", list(range(24)) + [99] * 30, max_tokens=1)
    s.add(shared)
    step = s.schedule()
    cached = [s.cache.pool.lookup(key) for key in first.keys]
    assert shared.cached_tokens == 24 and shared.table.blocks[:3] == cached[:3]
    assert [(x.start, x.count) for x in step.scheduled] == [(24, 16)]  # its grid starts at 24: 24, 40, 54
    s.advance(step, {})
    assert [(x.start, x.count) for x in s.schedule().scheduled] == [(40, 14)]


def test_a_preempted_request_takes_back_only_the_cached_prefix_that_keeps_its_chunks():
    s = scheduler(blocks=16, prefill_chunk=12, max_running=4)  # blocks of 8; its grid: 0, 12, 24, 36, 40
    r = Request("r", list(range(40)), max_tokens=4)
    s.add(r)
    s.advance(s.schedule(), {})  # chunk 0..12: one full block registered
    s._preempt(r)
    step = s.schedule()
    assert r.cached_tokens == 0 and [(x.start, x.count) for x in step.scheduled] == [(0, 12)]  # 8 is off its grid
    s.advance(step, {})
    for _ in range(3):
        step = s.schedule()
        s.advance(step, {"r": 7} if step.scheduled[0].samples else {})
    assert r.computed == 40 and r.generated == [7]
    s._preempt(r)  # the whole prompt is cached: taken back whole, the generated token computed again as a row
    step = s.schedule()
    assert r.cached_tokens == 40 and [(x.start, x.count) for x in step.scheduled] == [(40, 1)]


def test_an_identical_prompt_leaves_its_newest_token_to_compute():
    s = scheduler(blocks=16, prefill_chunk=8)
    s.add(Request("a", list(range(32)), max_tokens=1))
    run(s)
    b = Request("b", list(range(32)), max_tokens=1)
    s.add(b)
    step = s.schedule()
    assert b.cached_tokens == 24 and [(x.start, x.count, x.samples) for x in step.scheduled] == [(24, 8, True)]
    # (31 tokens are cached, in 3 full blocks and one of 7: only full blocks are shared)


def test_cached_free_blocks_are_evicted_least_recently_released_first():
    from qinfer.model.kv_cache import BlockPool, block_key

    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    keys = [block_key(None, (i,)) for i in range(3)]
    for block, key in zip((a, b, c), keys):
        pool.register(block, key)
    pool.release([b])
    pool.release([a])
    pool.release([c])
    assert pool.num_free == 4 and pool.lookup(keys[1]) == b
    assert pool.allocate(1) == [3]  # a block that holds nothing known goes first
    assert pool.allocate(1) == [b] and pool.lookup(keys[1]) is None  # then the least recently released
    pool.share([c])  # a cached free block taken back is not evicted
    assert pool.allocate(1) == [a] and pool.lookup(keys[2]) == c and pool.refs[c] == 1


def test_a_decode_already_scheduled_is_taken_back_when_its_request_is_preempted_in_the_same_step():
    s = scheduler(blocks=4, max_step_tokens=16, max_running=4, prefill_chunk=8, prefix_caching=False)
    old, new = Request("old", [1] * 24, max_tokens=1), Request("new", [2] * 8, max_tokens=8)
    s.add(old)
    s.add(new)
    for _ in range(2):  # old's first two chunks; new's prompt, then its first decode
        s.advance(s.schedule(), {"new": 7})
    step = s.schedule()  # new decodes first, then old's third chunk needs the block new holds: new goes
    assert [r.id for r in step.preempted] == ["new"]
    assert [(x.request.id, x.start, x.count) for x in step.scheduled] == [("old", 16, 8)]
