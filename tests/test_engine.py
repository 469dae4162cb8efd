"""The engine on tiny models: batched runs against each request alone, preemption under a small KV budget, the
prefix cache, per-request sampling, stop strings, aborts and refusals."""

import pytest
import torch

from qinfer.engine.engine import Engine, EngineConfig
from qinfer.engine.generate import generate
from qinfer.engine.sampling import SamplingParams
from qinfer.errors import QinferError
from qinfer.model.kv_cache import KVCache
from qinfer.model.loader import load_model
from qinfer.sources.tokenizer import Tokenizer
from tests.tiny_models import make_model

# small chunks and budgets, so that prompts are cut and steps mix prompt chunks with decodes
SMALL = dict(block_size=8, max_step_tokens=24, max_running=8, prefill_chunk=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")  # sliding windows of 5 in two of its three layers
    make_model("gemma3", folder)
    return load_model(folder, dtype=torch.float32), Tokenizer.from_folder(folder)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 300, (length,), generator=g).tolist() for length in [1, 7, 16, 17, 40, 3, 33, 9][:n]]


def memory(model, blocks: int, block_size: int = 8, kv_dtype: str = "bf16") -> int:
    return blocks * KVCache.bytes_per_block(model.config, block_size, kv_dtype, model.dtype)


def token_ids(outputs) -> dict[str, list[int]]:
    return {i: [t for o in outs for t in o.token_ids] for i, outs in outputs.items()}


def run(model, requests, tokenizer=None, **config) -> tuple[Engine, dict]:
    engine = Engine(model, tokenizer, EngineConfig(**config), eos_ids=())
    return engine, engine.run(requests)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_a_batched_run_gives_each_request_the_tokens_it_gets_alone(tiny, kv_dtype):
    model, _ = tiny
    requests = [(str(i), p, SamplingParams(max_tokens=6 + i)) for i, p in enumerate(prompts(8))]
    _, batched = run(model, requests, kv_dtype=kv_dtype, kv_memory=memory(model, 64), **SMALL)
    for request_id, prompt, params in requests:
        alone = list(generate(model, prompt, params, kv_dtype=kv_dtype))  # one request, the default chunking
        assert token_ids(batched)[request_id] == alone
        assert batched[request_id][-1].finish_reason == "length"


def test_batched_logits_are_each_requests_alone(tiny):
    # the decode rows of many sequences in one forward against each sequence's own: same positions, windows, pages
    model, _ = tiny
    engine = Engine(model, config=EngineConfig(kv_memory=memory(model, 64), **SMALL), eos_ids=())
    alone = Engine(model, config=EngineConfig(kv_memory=memory(model, 64), **SMALL), eos_ids=())
    batched, single = greedy_keeping_logits(engine, model), greedy_keeping_logits(alone, model)
    requests = [(str(i), p, SamplingParams(max_tokens=8)) for i, p in enumerate(prompts(5))]
    engine.run(requests)
    for request in requests:
        alone.run([request])
    for request_id, *_ in requests:
        for a, b in zip(batched[request_id], single[request_id], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_under_a_small_kv_budget_requests_are_preempted_and_give_the_same_tokens(tiny):
    model, _ = tiny
    requests = [(str(i), p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts(8))]
    _, ample = run(model, requests, kv_memory=memory(model, 128), **SMALL)
    # 12 blocks of 8 positions: a quarter of what the eight running requests come to hold (up to 64 positions each)
    engine, tight = run(model, requests, kv_memory=memory(model, 12), **SMALL)
    assert engine.preemptions > 0
    assert token_ids(tight) == token_ids(ample)
    assert engine.cache.pool.num_free == 12 and not engine.live


def greedy_keeping_logits(engine: Engine, model) -> dict[str, list[torch.Tensor]]:
    """Make ``engine`` sample greedily and keep each request's logits at every token: {id: [logits, ...]}."""
    kept: dict[str, list[torch.Tensor]] = {}

    def sample(hidden):
        logits = {i: model.lm_head(h) for i, h in hidden.items()}
        for i, row in logits.items():
            kept.setdefault(i, []).append(row)
        return {i: int(row.argmax()) for i, row in logits.items()}

    engine._sample = sample
    return kept


def test_the_prefix_cache_skips_the_full_blocks_of_a_shared_prefix(tiny):
    model, _ = tiny
    system = prompts(8)[4]  # 40 tokens: 5 full blocks
    turns = [(str(i), system + [5 + i] * (3 + i), SamplingParams(max_tokens=6)) for i in range(3)]
    engine = Engine(model, config=EngineConfig(kv_memory=memory(model, 64), **SMALL), eos_ids=())
    cached = greedy_keeping_logits(engine, model)
    engine.run(turns[:1])
    later = engine.run(turns[1:])  # after the first finished: its blocks are free, still cached
    assert [later[i][-1].cached_tokens for i in ("1", "2")] == [40, 40]
    plain_engine = Engine(model, config=EngineConfig(kv_memory=memory(model, 64), prefix_caching=False, **SMALL),
                          eos_ids=())
    plain = greedy_keeping_logits(plain_engine, model)
    outputs = plain_engine.run(turns)
    assert all(outs[-1].cached_tokens == 0 for outs in outputs.values())
    for request_id in plain:  # the same numbers, up to the order of sums (other chunks after the prefix)
        for a, b in zip(cached[request_id], plain[request_id], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_seeded_request_samples_the_same_tokens_whatever_else_runs(tiny):
    model, _ = tiny
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=3)
    _, alone = run(model, [("s", prompts(1)[0] + [7, 8], params)], kv_memory=memory(model, 64), **SMALL)
    others = [(str(i), p, SamplingParams(max_tokens=9, temperature=0.8, seed=i)) for i, p in enumerate(prompts(6))]
    _, mixed = run(model, others[:3] + [("s", prompts(1)[0] + [7, 8], params)] + others[3:],
                   kv_memory=memory(model, 64), **SMALL)
    assert token_ids(mixed)["s"] == token_ids(alone)["s"]


def test_a_stop_string_ends_the_text_before_it_and_held_text_is_never_taken_back(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode("It is a truth")
    _, free = run(model, [("a", prompt, SamplingParams(max_tokens=30))], tokenizer)
    text = "".join(o.text for o in free["a"])
    assert len(text) > 12
    stop = text[5:9]
    _, stopped = run(model, [("a", prompt, SamplingParams(max_tokens=30, stop=(stop,)))], tokenizer)
    pieces = [o.text for o in stopped["a"]]
    assert "".join(pieces) == text[:text.index(stop)]
    assert stopped["a"][-1].finish_reason == "stop" and stopped["a"][-1].completion_tokens < 30
    assert free["a"][-1].finish_reason == "length"


def test_stop_ids_end_a_request_without_joining_its_output(tiny):
    model, _ = tiny
    prompt = prompts(2)[1]
    _, free = run(model, [("a", prompt, SamplingParams(max_tokens=10))])
    ids = token_ids(free)["a"]
    _, stopped = run(model, [("a", prompt, SamplingParams(max_tokens=10, stop_ids=(ids[4],)))])
    assert token_ids(stopped)["a"] == ids[:ids.index(ids[4])]
    assert stopped["a"][-1].finish_reason == "stop"


def test_abort_frees_the_request_and_the_others_go_on(tiny):
    model, _ = tiny
    engine = Engine(model, config=EngineConfig(kv_memory=memory(model, 32), **SMALL), eos_ids=())
    for i, p in enumerate(prompts(3)):
        engine.add(str(i), p, SamplingParams(max_tokens=20))
    engine.step()
    out = engine.abort("1")
    assert out.finish_reason == "abort" and engine.abort("1") is None
    ended = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                ended[o.id] = o
    assert sorted(ended) == ["0", "2"] and engine.cache.pool.num_free == 32


def test_timings_and_counts_are_reported(tiny):
    model, _ = tiny
    _, outs = run(model, [("a", prompts(5)[4], SamplingParams(max_tokens=5))], kv_memory=memory(model, 32), **SMALL)
    last = outs["a"][-1]
    assert (last.prompt_tokens, last.completion_tokens, last.finish_reason) == (40, 5, "length")
    assert len(last.timings.tokens) == 5 and 0 < last.timings.ttft and last.timings.tpot > 0


def test_requests_the_engine_cannot_run_are_refused_when_added(tiny):
    model, tokenizer = tiny
    engine = Engine(model, config=EngineConfig(kv_memory=memory(model, 4), **SMALL), eos_ids=())
    engine.add("a", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(QinferError, match="already running"):
        engine.add("a", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(QinferError, match="empty"):
        engine.add("b", [], SamplingParams(max_tokens=2))
    with pytest.raises(QinferError, match="exceeds the model's context of 256 tokens"):
        engine.add("c", [1] * 200, SamplingParams(max_tokens=100))
    with pytest.raises(QinferError, match="need 5 KV-cache blocks; the cache has 4"):
        engine.add("d", [1] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(QinferError, match="stop strings need the engine to have a tokenizer"):
        engine.add("e", [1], SamplingParams(max_tokens=2, stop=("x",)))
    with pytest.raises(QinferError, match="less than one KV-cache block"):
        Engine(model, config=EngineConfig(kv_memory=100))
    with pytest.raises(QinferError, match="non-empty strings"):
        SamplingParams(stop=("",))
