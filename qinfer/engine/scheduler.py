"""Which tokens of which requests the next forward runs: continuous batching over the paged KV cache.

Each step has a budget of tokens (``max_step_tokens``) and of sequences (``max_running``). The scheduler spends
it in this order:

1. one token for each running request that is decoding (every token but its newest is cached), so a long
   prompt never stalls the others' tokens;
2. the next chunk of each running request still computing its prompt (or, after a preemption, its prompt and
   the tokens it had generated), oldest first;
3. waiting requests in arrival order, each with a first chunk, while tokens, sequences and free blocks allow
   (a request that does not fit waits; the ones behind it wait too, so arrival order holds).

Prompt chunks lie on a fixed grid: they end at multiples of ``prefill_chunk`` positions past the request's grid
origin (0, or where the cached prefix it started from ends), or at the prompt's end, and are never cut by the
budget (a chunk that does not fit waits for the next step), so a prompt is computed in the same pieces whatever
else runs. With kernels that sum each row on its own, a request's tokens then do not depend on the other
requests (the engine's batch invariance). The generated tokens of a preempted request are computed again as
decode rows, any number per step.

A running request that needs a block when none is free takes one from the most recently admitted request:
that request is preempted (its blocks freed, its computed tokens forgotten) and goes back to the front of the
queue, to be computed again from its prompt and the tokens it had generated. An accepted request is never
dropped, and the cache never runs out: only a request too long for the whole cache is refused, when added.

With ``prefix_caching``, every full block a request has computed is registered under its tokens and their
prefix (``kv_cache.block_key``); a request being admitted shares the blocks of the longest cached prefix of
its tokens instead of computing them, leaving at least its newest token to compute (its logits give the next
token), and its chunks start where that prefix ends. A preempted request admitted again takes only as much of
its cached prefix as ends on its grid, so its chunks are the ones it had: computed again, it gives the same
tokens. (A prompt that starts from another request's cached blocks is computed in other chunks than without
them, so its logits may differ in their last bits from an uncached run's, as in any engine.)

A request's ``tokens`` are its prompt and the tokens it has generated so far; ``computed`` of them have their
keys and values in the cache. A step runs ``tokens[computed : computed + n]`` for each scheduled request; the
engine then calls :meth:`Scheduler.advance` with what it sampled.
"""

from collections import deque
from dataclasses import dataclass, field

from qinfer.errors import QinferError
from qinfer.model.kv_cache import BlockTable, KVCache, OutOfBlocks, block_key


@dataclass(eq=False)
class Request:
    """One sequence the engine runs: its tokens, how many of them are cached, and its blocks."""

    id: str
    prompt: list[int]
    max_tokens: int
    generated: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are in the cache
    table: BlockTable = field(default_factory=BlockTable)
    preemptions: int = 0
    finished: bool = False
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache at the last admission
    origin: int = 0  # where its prompt's chunk grid starts: the cached prefix of its first admission
    keys: list[tuple] = field(default_factory=list)  # prefix-cache keys of its full blocks so far

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


@dataclass
class Scheduled:
    """``request`` runs ``tokens[start : start + count]`` this step; ``samples`` says whether its last position's
    logits give the request's next token (its prompt, and any recomputed tokens, are all in)."""

    request: Request
    start: int
    count: int

    @property
    def samples(self) -> bool:
        return self.start + self.count == len(self.request.tokens)


@dataclass
class Step:
    scheduled: list[Scheduled]
    preempted: list[Request]

    @property
    def tokens(self) -> int:
        return sum(s.count for s in self.scheduled)


class Scheduler:
    def __init__(self, cache: KVCache, max_step_tokens: int = 512, max_running: int = 64, prefill_chunk: int = 256,
                 prefix_caching: bool = True):
        if max_running < 1 or prefill_chunk < 1 or max_step_tokens < max_running + prefill_chunk:
            raise QinferError(f"the engine's step budget of {max_step_tokens} tokens must hold a token for each of "
                              f"{max_running} running sequences and a prompt chunk of {prefill_chunk} (all >= 1)")
        self.cache, self.max_step_tokens, self.max_running = cache, max_step_tokens, max_running
        self.prefill_chunk, self.prefix_caching = prefill_chunk, prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first

    def add(self, request: Request) -> None:
        """Queue ``request``; refuse one whose prompt and ``max_tokens`` could not fit in the whole cache."""
        self.check(len(request.prompt), request.max_tokens)
        self.waiting.append(request)

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request whose prompt and ``max_tokens`` could not fit in the whole cache."""
        need = -(-(prompt_tokens + max_tokens) // self.cache.block_size)
        if need > self.cache.num_blocks:
            raise QinferError(f"{prompt_tokens} prompt tokens + {max_tokens} to generate need {need} KV-cache "
                              f"blocks; the cache has {self.cache.num_blocks}: raise --kv-memory, or shorten the "
                              "request")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """The next step's tokens (see the module docstring)."""
        scheduled, preempted = [], []
        for request in list(self.running):  # 1. decodes (the budget holds one for each: see __init__)
            if request in self.running and self._decoding(request) and self._fit(request, 1, scheduled, preempted):
                scheduled.append(Scheduled(request, request.computed, 1))
        for request in list(self.running):  # 2. running requests still computing
            if request not in self.running or self._decoding(request):
                continue
            count = self._chunk(request, self._budget(scheduled))
            if count == 0:
                break
            if self._fit(request, count, scheduled, preempted):
                scheduled.append(Scheduled(request, request.computed, count))
        while self.waiting and len(self.running) < self.max_running and not preempted:  # 3. admissions
            request = self.waiting[0]
            hit = self._cached_prefix(request)
            if not request.preemptions:  # its first admission: its grid starts where the cached prefix ends
                request.origin = min(hit, len(request.prompt))
            count = self._chunk(request, self._budget(scheduled), start=hit)
            if count == 0 or not self._admit(request, hit, count):
                break  # it waits for tokens or blocks; so do the ones behind it
            self.waiting.popleft()
            self.running.append(request)
            scheduled.append(Scheduled(request, request.computed, count))
        return Step(scheduled, preempted)

    def _budget(self, scheduled: list[Scheduled]) -> int:
        return self.max_step_tokens - sum(s.count for s in scheduled)

    def advance(self, step: Step, sampled: dict[str, int]) -> list[Request]:
        """Record what ``step`` computed and the tokens sampled for the requests that sample (by id); returns the
        requests that finished (``max_tokens`` reached, or marked ``finished`` by the caller's stop checks), whose
        blocks are freed."""
        done = []
        for s in step.scheduled:
            request = s.request
            request.computed = s.start + s.count
            if self.prefix_caching:
                self._register(request)
            if s.samples and request.id in sampled:
                request.generated.append(sampled[request.id])
                if len(request.generated) >= request.max_tokens:
                    request.finished = True
            if request.finished:
                self.finish(request)
                done.append(request)
        return done

    def finish(self, request: Request) -> None:
        """Stop ``request`` (done, or aborted) and free its blocks."""
        request.finished = True
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request.table)

    def _decoding(self, request: Request) -> bool:
        return request.computed >= len(request.prompt) and request.computed == len(request.tokens) - 1

    def _chunk(self, request: Request, budget: int, start: int | None = None) -> int:
        """How many tokens ``request`` runs next from ``start`` (default: ``computed``) within ``budget``: the rest
        of its prompt chunk, whole or not at all; past its prompt, as many as the budget allows."""
        start = request.computed if start is None else start
        prompt = len(request.prompt)
        if start < prompt:
            count = min(prompt, self._boundary(request, start)) - start
            return count if count <= budget else 0
        return min(len(request.tokens) - start, budget)

    def _boundary(self, request: Request, position: int) -> int:
        """The first chunk boundary of ``request``'s grid past ``position``: multiples of ``prefill_chunk`` from
        its origin on (before the origin, from 0 up to the origin)."""
        C, origin = self.prefill_chunk, request.origin
        if position < origin:
            return min(origin, (position // C + 1) * C)
        return origin + ((position - origin) // C + 1) * C

    def _on_grid(self, request: Request, position: int) -> int:
        """The last boundary of ``request``'s grid at or before ``position``."""
        C, origin = self.prefill_chunk, request.origin
        return position // C * C if position < origin else origin + (position - origin) // C * C

    def _fit(self, request: Request, count: int, scheduled: list[Scheduled], preempted: list[Request]) -> bool:
        """Reserve blocks for ``count`` more of ``request``'s tokens, preempting the newest requests while none are
        free (and taking back what this step had scheduled for them); False if ``request`` itself was preempted."""
        while not self._reserve(request, request.computed + count):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            scheduled[:] = [s for s in scheduled if s.request is not victim]
            if victim is request:
                return False
        return True

    def _reserve(self, request: Request, length: int) -> bool:
        try:
            self.cache.reserve(request.table, length)
        except OutOfBlocks:
            return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and put it first in the queue, to be computed again from its first token."""
        self.running.remove(request)
        self.cache.free(request.table)
        request.computed = 0
        request.preemptions += 1
        self.waiting.appendleft(request)

    # the prefix cache

    def _keys(self, request: Request, blocks: int) -> list[tuple]:
        """The keys of ``request``'s first ``blocks`` full blocks (extending the ones it has)."""
        P, tokens = self.cache.block_size, request.tokens
        while len(request.keys) < blocks:
            i = len(request.keys)
            request.keys.append(block_key(request.keys[-1] if i else None, tuple(tokens[i * P:(i + 1) * P])))
        return request.keys[:blocks]

    def _cached_prefix(self, request: Request) -> int:
        """How many of ``request``'s tokens the prefix cache holds that it may take (see the module docstring)."""
        if not self.prefix_caching:
            return 0
        P, pool = self.cache.block_size, self.cache.pool
        hit = 0
        for key in self._keys(request, (len(request.tokens) - 1) // P):  # its newest token is left to compute
            if pool.lookup(key) is None:
                break
            hit += P
        if request.preemptions and hit < len(request.prompt):  # computed again: in the chunks it had
            hit = self._on_grid(request, hit)
        return hit

    def _admit(self, request: Request, hit: int, count: int) -> bool:
        """Give a waiting ``request`` the cached blocks of its first ``hit`` tokens and blocks for ``count`` more;
        all or nothing."""
        cached = [self.cache.pool.lookup(key) for key in request.keys[:hit // self.cache.block_size]]
        self.cache.pool.share(cached)  # first: a cached free block must not be handed out as a new one
        request.table.blocks = cached
        if not self._reserve(request, hit + count):
            self.cache.free(request.table)
            return False
        request.computed = request.cached_tokens = hit
        return True

    def _register(self, request: Request) -> None:
        """Register ``request``'s full computed blocks in the prefix cache."""
        full = request.computed // self.cache.block_size
        for block, key in zip(request.table.blocks[:full], self._keys(request, full)):
            self.cache.pool.register(block, key)
