"""``qinfer serve`` under load, measured as its clients see it: throughput and latency over HTTP at several
concurrencies.

    python -m qinfer.evals.serve_bench [--model MODEL] [--concurrency 1,4,16] [--requests N] [--max-tokens 64]

The server runs in a subprocess (``python -m qinfer serve MODEL --port 0``, on loopback) on MODEL, by default the
main job's GPTQ 4-bit gemma3-270m (``qinfer demo`` makes it). Clients are the official ``openai`` package's
``AsyncOpenAI``, streaming with ``include_usage``. At each concurrency c, ``--requests`` requests (default 2c, at
least 4) run with c in flight at a time (a new one is sent as one ends); each has its own ``--prompt-tokens``-token
prompt, a slice of held-out *Persuasion* (``--text``) from a random start (two share a prefix-cache block only if
they start at the same token; the JSON counts the cached tokens), and asks for ``--max-tokens`` tokens, greedily.
The server has no way to ignore the end-of-sequence token, so a request may end sooner: the report counts the tokens
each request actually gave (its ``usage``), and says how many ended early. Each concurrency is warmed up first (c
short requests), then ``--rounds`` rounds run, the concurrencies taking turns within a round.

Per concurrency, from the clients' clocks:

- **output tok/s**: completion tokens over the wall time from the first request sent to the last one finished (the
  median of the rounds);
- **TTFT**: request sent to the first chunk carrying text; **TPOT**: (last chunk - first chunk) / (completion
  tokens - 1), which counts every token although a chunk may carry several; p50 and p99 over every round's requests;
- from the server's ``/metrics``: its mean TTFT (from the request's arrival, without HTTP: the gap to the clients'
  is what HTTP, streaming and the client add) and its preemptions.

The clients run on the server's CPU and take some of it. The results go to ``--out``/serve_bench.json. The last
line is the headline, the highest concurrency against the lowest:
``HTTP throughput at concurrency 16 = X.Xx concurrency 1 (N.N vs M.M tok/s)``. Timings on a shared VM vary between
runs: compare figures from one run.
"""

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import click

from qinfer.cli.command import Command
from qinfer.errors import QinferError
from qinfer.evals.engine_bench import percentile

READY = re.compile(r"qinfer serve: \S+ at (http://\S+) ")
START_TIMEOUT = 600  # seconds for the server to load the model and listen
STOP_TIMEOUT = 60  # seconds after SIGTERM (the server's grace for requests in flight is 10 s)
TAIL = 40  # lines of the server's output kept to show when it fails
WARM_UP_TOKENS = 4


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str  # a model folder, .gguf file or built-in name, as `qinfer serve` takes it
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int | None = None  # per concurrency; None: 2 per client, at least 4
    max_tokens: int = 64
    prompt_tokens: int = 128
    rounds: int = 3
    endpoint: str = "completions"  # or "chat": the prompt's text as one user message
    kv_memory: str | None = None  # passed to `qinfer serve` when given
    max_batch: int | None = None
    text: str = "heldout"
    seed: int = 0

    def __post_init__(self):
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise QinferError(f"--concurrency {self.concurrency}: give positive numbers of clients, e.g. 1,4,16")
        for name in ("requests", "max_tokens", "rounds", "max_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise QinferError(f"--{name.replace('_', '-')} is {value}: it must be at least 1")
        if self.prompt_tokens < 2:
            raise QinferError(f"--prompt-tokens is {self.prompt_tokens}: it must be at least 2")
        if self.endpoint not in ("completions", "chat"):
            raise QinferError(f"--endpoint {self.endpoint}: completions or chat")

    def requests_at(self, concurrency: int) -> int:
        return self.requests if self.requests is not None else max(4, 2 * concurrency)

    def serve_args(self) -> list[str]:
        args = [] if self.kv_memory is None else ["--kv-memory", self.kv_memory]
        return args + ([] if self.max_batch is None else ["--max-batch", str(self.max_batch)])


class ServeProcess:
    """``qinfer serve MODEL --port 0 ARGS...`` in a subprocess; ``url`` once its ready line is out. ``env``: added
    to the environment; ``keep``: lines of its output kept (None: all, as the server's tests read them)."""

    def __init__(self, model: str, args: list[str], env: dict[str, str] | None = None, keep: int | None = TAIL):
        import qinfer

        # the server imports the same qinfer as this process (a source tree or a worktree before the installed one)
        root = str(Path(qinfer.__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", "qinfer", "serve", model, "--host", "127.0.0.1", "--port", "0", *args]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})})
        self.lines: deque[str] = deque(maxlen=keep)
        self.url: str | None = None
        self.ready_line = ""
        self._said = threading.Event()  # the ready line, or the end of the output
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n").rsplit("\r", 1)[-1])  # a progress bar's last state
            match = READY.search(line)
            if match and self.url is None:
                self.url, self.ready_line = match.group(1), line.strip()
                self._said.set()
        self._said.set()

    @property
    def api(self) -> str:
        """The OpenAI base URL (``http://HOST:PORT/v1``)."""
        return f"{self.url}/v1"

    def log(self) -> str:
        return "\n".join(self.lines)

    def tail(self, n: int = 3) -> str:
        return " | ".join([line.strip() for line in self.lines if line.strip()][-n:]) or "(no output)"

    def wait_ready(self, timeout: float = START_TIMEOUT) -> str:
        if not self._said.wait(timeout):
            raise QinferError(f"qinfer serve was not ready after {timeout:.0f} s; its last lines: {self.tail()}")
        if self.url is None:
            status = self.process.wait(STOP_TIMEOUT)
            raise QinferError(f"qinfer serve exited with status {status} before it was ready; its last lines: "
                              f"{self.tail()}")
        return self.url

    def stop(self) -> int:
        """SIGTERM (a graceful shutdown), then the exit status; killed if it outstays ``STOP_TIMEOUT``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise QinferError(f"qinfer serve did not stop within {STOP_TIMEOUT} s of SIGTERM (killed); its last "
                              f"lines: {self.tail()}") from None


@contextlib.contextmanager
def serving(model: str, args: list[str], env: dict[str, str] | None = None, keep: int | None = TAIL,
            timeout: float = START_TIMEOUT):
    """A ready :class:`ServeProcess`; stopped on the way out, whatever ends the block (Ctrl-C included)."""
    server = ServeProcess(model, args, env, keep)
    try:
        server.wait_ready(timeout)
        yield server
    finally:
        if server.process.poll() is None:  # not stopped yet: the block failed or was interrupted
            with contextlib.suppress(QinferError):  # the error under way is the one to report
                server.stop()


@dataclass(frozen=True)
class Reply:
    """One streamed request as its client saw it; times in seconds on the client's clock."""

    sent: float
    first: float  # the first chunk carrying text (the finishing chunk if none did)
    last: float  # the chunk with the finish reason: the last token's
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def tpot(self) -> float | None:
        # by the usage's count, not the chunks': a chunk carries every token whose text is complete
        return (self.last - self.first) / (self.completion_tokens - 1) if self.completion_tokens > 1 else None


class Clients:
    """Requests to the server through the ``openai`` client, each on a prompt of its own drawn from a text."""

    def __init__(self, client, model_name: str, config: ServeBenchConfig, tokenizer, text_ids: list[int]):
        self.client, self.name, self.config, self.tokenizer, self.text = client, model_name, config, tokenizer, text_ids
        self.random = random.Random(config.seed)

    def prompt(self) -> list[int]:
        """``prompt_tokens`` ids: BOS (if the model has one), then a slice of the text from a random start."""
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        length = self.config.prompt_tokens - len(bos)
        start = self.random.randrange(0, len(self.text) - length)
        return bos + self.text[start:start + length]

    async def request(self, prompt: list[int], max_tokens: int) -> Reply:
        import openai

        chat = self.config.endpoint == "chat"
        common = dict(model=self.name, max_tokens=max_tokens, temperature=0, stream=True,
                      stream_options={"include_usage": True})
        sent = time.perf_counter()
        first = last = usage = finish = None
        try:
            if chat:
                text = self.tokenizer.decode(prompt)
                stream = await self.client.chat.completions.create(
                    messages=[{"role": "user", "content": text}], **common)
            else:
                stream = await self.client.completions.create(prompt=prompt, **common)
            async for chunk in stream:
                now = time.perf_counter()
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    if first is None and (choice.delta.content if chat else choice.text):
                        first = now
                    if choice.finish_reason is not None:
                        last, finish = now, choice.finish_reason
        except openai.OpenAIError as e:
            raise QinferError(f"a request to qinfer serve failed: {' '.join(str(e).split())}") from None
        if usage is None or finish is None:
            raise QinferError("qinfer serve's stream ended without a finish reason and usage")
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return Reply(sent, last if first is None else first, last, usage.completion_tokens, usage.prompt_tokens,
                     cached or 0, finish)

    async def closed_loop(self, n: int, concurrency: int, max_tokens: int, bar) -> list[Reply]:
        """``n`` requests, ``concurrency`` in flight at a time: each client sends its next as its last ends."""
        prompts = [self.prompt() for _ in range(n)]
        replies = []

        async def client():
            while prompts:
                replies.append(await self.request(prompts.pop(0), max_tokens))
                bar.update()

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return replies


def server_counters(url: str) -> dict[str, float]:
    """The server's ``/metrics`` samples, each name's values summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


@dataclass
class Level:
    """What every round at one concurrency gave."""

    concurrency: int
    replies: list[Reply] = dataclasses.field(default_factory=list)
    rounds: list[float] = dataclasses.field(default_factory=list)  # output tokens per second
    server: dict[str, float] = dataclasses.field(default_factory=dict)  # /metrics increments

    def add(self, replies: list[Reply], before: dict[str, float], after: dict[str, float]) -> None:
        wall = max(r.last for r in replies) - min(r.sent for r in replies)
        self.rounds.append(sum(r.completion_tokens for r in replies) / wall)
        self.replies += replies
        for name in ("qinfer_preemptions_total", "qinfer_time_to_first_token_seconds_sum",
                     "qinfer_time_to_first_token_seconds_count"):
            self.server[name] = self.server.get(name, 0.0) + after.get(name, 0.0) - before.get(name, 0.0)

    def summary(self, max_tokens: int) -> dict:
        ttft = [r.ttft for r in self.replies]
        tpot = [r.tpot for r in self.replies if r.tpot is not None]
        count = self.server["qinfer_time_to_first_token_seconds_count"]
        return {
            "concurrency": self.concurrency,
            "requests": len(self.replies) // len(self.rounds),
            "output_tok_s": statistics.median(self.rounds),
            "rounds_tok_s": self.rounds,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50) if tpot else None, "tpot_p99_s": percentile(tpot, 99) if tpot else None,
            "completion_tokens_mean": statistics.mean(r.completion_tokens for r in self.replies),
            "ended_early": sum(r.completion_tokens < max_tokens for r in self.replies),
            "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in self.replies),
            "cached_tokens": sum(r.cached_tokens for r in self.replies),
            "server_ttft_mean_s": self.server["qinfer_time_to_first_token_seconds_sum"] / count if count else None,
            "preemptions": round(self.server["qinfer_preemptions_total"]),
        }


async def measure(config: ServeBenchConfig, url: str, tokenizer, text_ids: list[int]) -> list[dict]:
    """Warm up, then ``rounds`` rounds over the concurrencies; a summary per concurrency."""
    from openai import AsyncOpenAI
    from tqdm import tqdm

    # the server takes its API key from QINFER_API_KEY when it is set
    client = AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get("QINFER_API_KEY") or "none", max_retries=0,
                         timeout=START_TIMEOUT)
    try:
        name = (await client.models.list()).data[0].id
        clients = Clients(client, name, config, tokenizer, text_ids)
        levels = {c: Level(c) for c in config.concurrency}
        total = sum(config.concurrency) + config.rounds * sum(config.requests_at(c) for c in levels)
        with tqdm(total=total, desc="serve_bench", unit="req") as bar:
            for c in levels:  # the first step of each batch size prepares its kernels' layouts
                await clients.closed_loop(c, c, min(WARM_UP_TOKENS, config.max_tokens), bar)
            for _ in range(config.rounds):
                for c, level in levels.items():
                    before = await asyncio.to_thread(server_counters, url)
                    replies = await clients.closed_loop(config.requests_at(c), c, config.max_tokens, bar)
                    level.add(replies, before, await asyncio.to_thread(server_counters, url))
        return [level.summary(config.max_tokens) for level in levels.values()]
    finally:
        await client.close()


def table(levels: list[dict]) -> str:
    def ms(seconds):
        return "-" if seconds is None else f"{1000 * seconds:.1f}"

    lines = ["concurrency  requests  output tok/s  TTFT p50 / p99 (s)  TPOT p50 / p99 (ms)  tokens/request  "
             "server TTFT (s)  preemptions  rounds (tok/s)"]
    for r in levels:
        server = "-" if r["server_ttft_mean_s"] is None else f"{r['server_ttft_mean_s']:.3f}"
        lines.append(f"{r['concurrency']:11d}  {r['requests']:8d}  {r['output_tok_s']:12.1f}  "
                     f"{r['ttft_p50_s']:8.3f} / {r['ttft_p99_s']:6.3f}  {ms(r['tpot_p50_s']):>9} / "
                     f"{ms(r['tpot_p99_s']):>7}  {r['completion_tokens_mean']:14.1f}  {server:>15}  "
                     f"{r['preemptions']:11d}  {', '.join(f'{x:.1f}' for x in r['rounds_tok_s'])}")
    return "\n".join(lines)


def headline(levels: list[dict]) -> str:
    low, high = min(levels, key=lambda r: r["concurrency"]), max(levels, key=lambda r: r["concurrency"])
    return (f"HTTP throughput at concurrency {high['concurrency']} = {high['output_tok_s'] / low['output_tok_s']:.1f}x "
            f"concurrency {low['concurrency']} ({high['output_tok_s']:.1f} vs {low['output_tok_s']:.1f} tok/s)")


def run_bench(config: ServeBenchConfig) -> list[dict]:
    """Start the server, measure, stop it (it must exit 0); a summary per concurrency."""
    from qinfer.evals.accuracy import load_text
    from qinfer.sources.resolve import resolve_model
    from qinfer.sources.tokenizer import Tokenizer

    try:
        import openai  # noqa: F401 (a dev extra of qinfer's, not a dependency)
    except ImportError:
        raise QinferError("serve_bench drives the server with the official openai client: pip install "
                          "'openai>=1.50,<4'") from None
    tokenizer = Tokenizer.from_folder(resolve_model(config.model))
    text, described = load_text(config.text)
    text_ids = tokenizer.encode(text, add_bos=False)
    if len(text_ids) <= 2 * config.prompt_tokens:
        raise QinferError(f"--text {config.text} has {len(text_ids)} tokens: too few to draw distinct "
                          f"{config.prompt_tokens}-token prompts from (give a longer text or fewer --prompt-tokens)")
    print(f"model {config.model}; {config.endpoint} of {config.prompt_tokens}-token prompts from {described}, "
          f"max_tokens {config.max_tokens}, greedy; {config.rounds} round(s); {os.cpu_count()} CPUs shared by the "
          "server and its clients")
    with serving(config.model, config.serve_args()) as server:
        print(server.ready_line)
        levels = asyncio.run(measure(config, server.url, tokenizer, text_ids))
        status = server.stop()
    if status != 0:
        raise QinferError(f"qinfer serve exited with status {status} after SIGTERM (0 expected); its last lines: "
                          f"{server.tail()}")
    return levels


@click.command(cls=Command)
@click.option("--model", default=None, help="A model folder, .gguf file or built-in name (default: the main job's "
              "GPTQ 4-bit gemma3-270m, which `qinfer demo` makes).")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Clients with a request in flight.")
@click.option("--requests", type=int, default=None, help="Requests per concurrency and round [default: 2 per "
              "client, at least 4].")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Tokens each request asks for.")
@click.option("--prompt-tokens", type=int, default=128, show_default=True, help="Each prompt's length.")
@click.option("--rounds", type=int, default=3, show_default=True, help="Rounds over the concurrencies (output "
              "tok/s is their median).")
@click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions", show_default=True,
              help="/v1/completions with the prompt's ids, or /v1/chat/completions with its text as a user message.")
@click.option("--kv-memory", default=None, help="The server's KV-cache memory (its default: 1GiB).")
@click.option("--max-batch", type=int, default=None, help="The server's running requests at most (its default: 64).")
@click.option("--text", default="heldout", show_default=True, help="The prompts' source: heldout (Persuasion) or "
              "a UTF-8 text file.")
@click.option("--seed", type=int, default=0, show_default=True, help="The draw of prompts.")
@click.option("--out", default="qinfer-results", show_default=True, help="Folder for serve_bench.json.")
def main(model, concurrency, requests, max_tokens, prompt_tokens, rounds, endpoint, kv_memory, max_batch, text, seed,
         out):
    """Throughput and latency of `qinfer serve` over HTTP, at several concurrencies."""
    from qinfer.evals.main_job import quantized_dir
    from qinfer.store.atomic import write_atomic

    if model is None:
        folder = quantized_dir("gemma3-270m", "gptq-w4g128")
        if not (folder / "config.json").exists():
            raise QinferError(f"no --model given and {folder} is not there: run `qinfer demo` first, or pass --model")
        model = str(folder)
    try:
        levels = tuple(int(c) for c in concurrency.split(","))
    except ValueError:
        raise QinferError(f"--concurrency {concurrency}: give numbers of clients separated by commas, e.g. 1,4,16") \
            from None
    config = ServeBenchConfig(model=model, concurrency=tuple(dict.fromkeys(levels)), requests=requests,
                              max_tokens=max_tokens, prompt_tokens=prompt_tokens, rounds=rounds, endpoint=endpoint,
                              kv_memory=kv_memory, max_batch=max_batch, text=text, seed=seed)
    results = run_bench(config)
    print()
    print(table(results))
    early = sum(r["ended_early"] for r in results)
    if early:
        print(f"{early} of {sum(r['requests'] for r in results) * rounds} requests ended (end of sequence) before "
              "max_tokens: the throughput counts the tokens they gave")
    path = Path(out) / "serve_bench.json"
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor()
              or platform.machine(), "cpus": os.cpu_count(), "config": dataclasses.asdict(config), "levels": results,
              "headline": headline(results)}
    write_atomic(path, json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    print(headline(results))


if __name__ == "__main__":
    main()
