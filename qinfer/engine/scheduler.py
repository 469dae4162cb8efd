"""Which tokens of which requests the next forward runs: continuous batching over the paged KV cache.

Each step has a budget of tokens (``max_step_tokens``) and of sequences (``max_running``). The scheduler spends
it first come, first served:

1. the running requests, oldest first: one token each for those decoding, and the next chunk of the prompt
   for those still prefilling (a long prompt is cut into chunks, so it never stalls the others' tokens);
2. then waiting requests, in arrival order, each with a first chunk of its prompt, while tokens, sequences and
   free blocks allow (a request that does not fit waits; the ones behind it wait too, so arrival order holds).

A running request that needs a block when none is free takes one from the most recently admitted request:
that request is preempted (its blocks freed, its computed tokens forgotten) and goes back to the front of the
queue, to be computed again from its prompt and the tokens it had generated. An accepted request is never
dropped, and the cache never runs out: only a request too long for the whole cache is refused, when added.

A request's ``tokens`` are its prompt and the tokens it has generated so far; ``computed`` of them have their
keys and values in the cache. A step runs ``tokens[computed : computed + n]`` for each scheduled request; the
engine then calls :meth:`Scheduler.advance` with what it sampled.
"""

from collections import deque
from dataclasses import dataclass, field

from qinfer.errors import QinferError
from qinfer.model.kv_cache import BlockTable, KVCache, OutOfBlocks


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
    def __init__(self, cache: KVCache, max_step_tokens: int = 512, max_running: int = 64):
        if max_step_tokens < 1 or max_running < 1:
            raise QinferError("the engine needs a step budget of at least one token and one sequence")
        self.cache, self.max_step_tokens, self.max_running = cache, max_step_tokens, max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first

    def add(self, request: Request) -> None:
        """Queue ``request``; refuse one whose prompt and ``max_tokens`` could not fit in the whole cache."""
        need = -(-(len(request.prompt) + request.max_tokens) // self.cache.block_size)
        if need > self.cache.num_blocks:
            raise QinferError(f"request {request.id}: {len(request.prompt)} prompt tokens + {request.max_tokens} "
                              f"to generate need {need} KV-cache blocks; the cache has {self.cache.num_blocks}: raise "
                              "--kv-memory, or shorten the request")
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """The next step's tokens (see the module docstring)."""
        budget, scheduled, preempted = self.max_step_tokens, [], []
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted a moment ago, to make room for an older one
                continue
            count = min(len(request.tokens) - request.computed, budget)
            while not self._reserve(request, request.computed + count):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request in self.running:
                scheduled.append(Scheduled(request, request.computed, count))
                budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not preempted:
            request = self.waiting[0]
            count = min(len(request.tokens) - request.computed, budget)
            if not self._reserve(request, request.computed + count):
                break  # it waits for blocks; so do the ones behind it
            self.waiting.popleft()
            self.running.append(request)
            scheduled.append(Scheduled(request, request.computed, count))
            budget -= count
        return Step(scheduled, preempted)

    def advance(self, step: Step, sampled: dict[str, int]) -> list[Request]:
        """Record what ``step`` computed and the tokens sampled for the requests that sample (by id); returns the
        requests that finished (``max_tokens`` reached, or marked ``finished`` by the caller's stop checks), whose
        blocks are freed."""
        done = []
        for s in step.scheduled:
            request = s.request
            request.computed = s.start + s.count
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
