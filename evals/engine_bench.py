"""The engine under load on this CPU: throughput and latency at several concurrencies, the prefix cache, and
whether batching or a small KV budget changes any request's tokens.

    python -m qinfer.evals.engine_bench [MODEL] [--concurrency 1,4,16,64] [--requests 2] [--check 8] [--repeats 3]

MODEL defaults to the main job's GPTQ 4-bit gemma3-270m (``qinfer demo`` makes it). Prompts are slices of
held-out *Persuasion*, 32 to 1024 tokens, and each request generates 16 to 256 tokens, greedily, with the
end-of-sequence id ignored so the lengths hold (a fixed draw: the same mix every run). Everything runs on one
engine config (``EngineConfig`` defaults: bf16 KV cache of 1 GiB, blocks of 16, 512 tokens a step, prompt chunks
of 256).

1. **Decode throughput**: at each concurrency c, c requests with 32-token prompts start together and generate
   128 tokens each; tokens per second over the steps after every prompt is in (the weights are read once per
   step for all c rows); the median of ``--repeats`` rounds, the concurrencies taking turns within a round.
2. **Request mix**: at each concurrency c, ``--requests`` x c requests of the mix (at least 4), c in flight at a
   time (a new one starts as one ends): aggregate output tokens per second over the wall time, TTFT and TPOT
   p50 and p99, preemptions, prefix-cache hits.
3. **Shared system prompt**: the same 1,000-token prefix before each of three short questions, one after
   another: each request's TTFT, and how much of its prompt came from the cache.
4. **Same tokens**: ``--check`` requests of the concurrency-16 mix run alone, each against its tokens in the mix;
   then the whole concurrency-16 mix again under a KV budget of a quarter of the blocks its 16 running requests
   come to hold, against the ample run.

The last line is the headline: ``throughput at concurrency 16 = 9.1x concurrency 1`` (decode throughput).
Timings on a shared VM vary between runs: compare figures from one run.
"""

import random
import statistics
import time

import click
import torch

from qinfer.cli.command import Command
from qinfer.engine.engine import Engine, EngineConfig
from qinfer.engine.sampling import SamplingParams
from qinfer.errors import QinferError
from qinfer.model.kv_cache import KVCache


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Bench:
    def __init__(self, model, tokenizer, text_ids: list[int], seed: int = 0):
        self.model, self.tokenizer, self.text = model, tokenizer, text_ids
        self.random = random.Random(seed)

    def engine(self, **config) -> Engine:
        return Engine(self.model, self.tokenizer, EngineConfig(**config), eos_ids=())

    def prompt(self, length: int) -> list[int]:
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        start = self.random.randrange(0, len(self.text) - length)
        return bos + self.text[start:start + length - len(bos)]

    def mix(self, n: int) -> list[tuple[list[int], int]]:
        """``n`` (prompt, output length) pairs: prompts of 32-1024 tokens, outputs of 16-256 (log-uniform)."""
        return [(self.prompt(round(2 ** self.random.uniform(5, 10))), round(2 ** self.random.uniform(4, 8)))
                for _ in range(n)]

    def warm_up(self) -> None:
        """Run every kernel path once (one prompt chunk of each size class, decode steps of 1 to 64 rows): the
        first call of a path prepares its weights' layouts, which is not what a step costs."""
        for c in (1, 2, 64):
            self.closed_loop([(self.prompt(length), 4) for length in (300, 40)] * max(1, c // 2), c)

    def decode_throughput(self, concurrency: int, tokens: int = 128) -> float:
        """Tokens per second of the steps after every prompt is in."""
        engine = self.engine()
        for i in range(concurrency):
            engine.add(str(i), self.prompt(32), SamplingParams(max_tokens=tokens + 1))
        while any(live.request.computed < len(live.request.prompt) for live in engine.live.values()):
            engine.step()
        start, produced = time.perf_counter(), 0
        while engine.has_work():
            produced += sum(len(o.token_ids) for o in engine.step())
        return produced / (time.perf_counter() - start)

    def closed_loop(self, requests, concurrency: int, **config) -> tuple[Engine, dict, float]:
        """Run ``requests`` with ``concurrency`` in flight; (engine, {index: (token ids, last output)}, seconds)."""
        engine = self.engine(**config)
        queue, results, ids = list(enumerate(requests)), {}, {}
        start = time.perf_counter()
        while queue or engine.has_work():
            while queue and len(engine.live) < concurrency:
                i, (prompt, n) = queue.pop(0)
                engine.add(str(i), prompt, SamplingParams(max_tokens=n))
                ids[i] = []
            for out in engine.step():
                ids[int(out.id)] += out.token_ids
                if out.finished:
                    results[int(out.id)] = (ids[int(out.id)], out)
        return engine, results, time.perf_counter() - start


def _blocks(requests, block_size: int = 16) -> int:
    return sum(-(-(len(p) + n) // block_size) for p, n in requests)


@click.command(cls=Command)
@click.argument("model", required=False)
@click.option("--concurrency", default="1,4,16,64", show_default=True, help="Requests in flight.")
@click.option("--requests", "per_client", type=int, default=2, show_default=True,
              help="Requests of the mix per concurrent client (at least 4 in all).")
@click.option("--check", type=int, default=8, show_default=True,
              help="Requests of the concurrency-16 mix also run alone, to compare their tokens.")
@click.option("--seed", type=int, default=0, show_default=True, help="The draw of prompts and lengths.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Rounds of the decode-throughput runs.")
def main(model, concurrency, per_client, check, seed, repeats):
    """Throughput, latency, prefix caching and batch invariance of the engine on this CPU."""
    from qinfer.calib.austen import heldout_text
    from qinfer.model.loader import load_model
    from qinfer.sources.resolve import resolve_model
    from qinfer.sources.tokenizer import Tokenizer
    from qinfer.evals.main_job import quantized_dir

    if model is None:
        folder = quantized_dir("gemma3-270m", "gptq-w4g128")
        if not (folder / "config.json").exists():
            raise QinferError(f"no model given and {folder} is not there: run `qinfer demo` first, or pass MODEL")
        model = str(folder)
    levels = [int(c) for c in concurrency.split(",")]
    folder = resolve_model(model)
    lm, tokenizer = load_model(folder, dtype=torch.bfloat16, run=True), Tokenizer.from_folder(folder)
    text = tokenizer.encode(heldout_text(), add_bos=False)
    bench = Bench(lm, tokenizer, text, seed)
    print(f"model {model}; {torch.get_num_threads()} threads; {EngineConfig()}")
    bench.warm_up()

    print(f"\n1. decode throughput (32-token prompts, 128 tokens each, after every prompt is in; median of {repeats} "
          "rounds, the concurrencies alternating)")
    rounds = {c: [] for c in levels}
    for _ in range(repeats):
        for c in levels:
            rounds[c].append(bench.decode_throughput(c))
    decode = {c: statistics.median(r) for c, r in rounds.items()}
    for c in levels:
        spread = f"(rounds {', '.join(f'{x:.1f}' for x in rounds[c])})"
        print(f"  concurrency {c:3d}: {decode[c]:7.1f} tok/s" + (f" = {decode[c] / decode[levels[0]]:.1f}x "
              f"concurrency {levels[0]}" if c != levels[0] else "") + f" {spread}")

    print("\n2. request mix (prompts 32-1024 tokens, outputs 16-256)")
    mixes = {}
    for c in levels:
        requests = bench.mix(max(4, per_client * c))
        engine, results, seconds = bench.closed_loop(requests, c)
        mixes[c] = (requests, results)
        outs = [out for _, out in results.values()]
        ttft = [o.timings.ttft for o in outs]
        tpot = [o.timings.tpot for o in outs if o.timings.tpot is not None]
        produced = sum(o.completion_tokens for o in outs)
        print(f"  concurrency {c:3d}: {len(outs)} requests, {produced / seconds:7.1f} output tok/s; TTFT p50 "
              f"{percentile(ttft, 50):.2f} s p99 {percentile(ttft, 99):.2f} s; TPOT p50 "
              f"{1000 * percentile(tpot, 50):.0f} ms p99 {1000 * percentile(tpot, 99):.0f} ms; "
              f"{engine.preemptions} preemptions; prefix cache {sum(o.cached_tokens for o in outs)} of "
              f"{sum(o.prompt_tokens for o in outs)} prompt tokens")

    print("\n3. shared system prompt (1000 tokens, then a question of 16-64 tokens; one request at a time)")
    engine = bench.engine()
    system = bench.prompt(1000)
    ttfts = []
    for i in range(3):
        question = bench.prompt(bench.random.randrange(16, 65))[1 if tokenizer.bos_id is not None else 0:]
        engine.add(str(i), system + question, SamplingParams(max_tokens=8))
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    ttfts.append(out.timings.ttft)
                    print(f"  request {i + 1}: TTFT {out.timings.ttft:.3f} s, {out.cached_tokens} of "
                          f"{out.prompt_tokens} prompt tokens from the cache")
    print(f"  the second request's TTFT is {ttfts[0] / ttfts[1]:.1f}x lower than the first's")

    if 16 in mixes:
        requests, results = mixes[16]
        print("\n4. same tokens (the concurrency-16 mix)")
        same = 0
        for i in range(min(check, len(requests))):
            _, alone, _ = bench.closed_loop([requests[i]], 1)
            same += alone[0][0] == results[i][0]
        print(f"  {same} of {min(check, len(requests))} requests give each token they give alone")
        running = sorted(requests[:16], key=lambda r: -len(r[0]) - r[1])
        budget = max(_blocks(running) // 4, max(_blocks([r]) for r in requests))
        memory = budget * KVCache.bytes_per_block(lm.config, 16, "bf16", lm.dtype)
        engine, tight, _ = bench.closed_loop(requests, 16, kv_memory=memory)
        same = sum(tight[i][0] == results[i][0] for i in results)
        print(f"  KV budget of {budget} blocks (a quarter of the {_blocks(running)} its 16 running requests hold): "
              f"{engine.preemptions} preemptions, {same} of {len(results)} requests give the same tokens")

    if 1 in decode and 16 in decode:
        print(f"\nthroughput at concurrency 16 = {decode[16] / decode[1]:.1f}x concurrency 1")


if __name__ == "__main__":
    main()
