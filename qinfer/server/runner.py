"""The engine behind the server: one thread steps it, while the asyncio loop takes requests and streams replies.

The :class:`~qinfer.engine.engine.Engine` is not thread-safe, so only the thread in :meth:`EngineRunner.run`
touches it. A handler calls :meth:`EngineRunner.submit`, which queues the request and returns an
``asyncio.Queue``; the engine's thread adds queued requests between steps, steps while any request has work, and
puts each request's :class:`~qinfer.engine.engine.Output` on its queue (the last one has a ``finish_reason``). A
request the engine refuses or a failed step puts a :class:`~qinfer.errors.QinferError` on the queue instead.
:meth:`abort` (a client gone) ends a request at the next step boundary and frees its blocks.

``qinfer serve`` runs the engine on the process's main thread, where the model was loaded, and the HTTP server
beside it: an engine stepped on a second thread made a 4-bit gemma3-270m decode step 1.3x as long, its kernels'
parallel regions slower (docs/results.md, "The server"; likely OpenMP's per-thread worker pools outnumbering the
cores, whose workers then sleep between regions).
"""

import asyncio
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence

from qinfer.engine.engine import Engine, Output
from qinfer.engine.sampling import SamplingParams
from qinfer.errors import QinferError


class Overloaded(QinferError):
    """More requests wait than the server's queue limit: the client should retry later."""


class Unavailable(QinferError):
    """The engine is stopping, or has failed: no request can run."""


class EngineRunner:
    def __init__(self, engine: Engine, max_waiting: int = 256, on_output: Callable[[Output], None] | None = None,
                 on_step: Callable[[], None] | None = None):
        """``max_waiting``: requests queued before :meth:`submit` refuses more (:class:`Overloaded`);
        ``on_output`` sees every request's last output and ``on_step`` runs after each step, both on the engine's
        thread (the server's metrics)."""
        self.engine, self.max_waiting = engine, max_waiting
        self.on_output, self.on_step = on_output, on_step
        self._cv = threading.Condition()
        self._adds: deque[tuple[str, list[int], SamplingParams, list[int] | None]] = deque()
        self._aborts: deque[str] = deque()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.failure: str | None = None  # why the engine's loop stopped, if it failed

    def stop(self) -> None:
        """Make :meth:`run` end every request (each gets its last output, finish reason "abort") and return."""
        with self._cv:
            self._stopping = True
            self._cv.notify()

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self._stopping

    @property
    def waiting(self) -> int:
        """Requests not yet running: queued here, or waiting in the scheduler."""
        return len(self._adds) + len(self.engine.scheduler.waiting)

    @property
    def running(self) -> int:
        return len(self.engine.scheduler.running)

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               context: Sequence[int] | None = None) -> asyncio.Queue:
        """Queue a request (call from the event loop); its outputs, or an error, arrive on the returned queue."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._cv:
            if not self.healthy:
                raise Unavailable(f"the engine is not running ({self.failure or 'shutting down'})")
            if self.waiting >= self.max_waiting:
                raise Overloaded(f"{self.waiting} requests are already waiting (the limit is {self.max_waiting}): "
                                 "retry later")
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
            self._adds.append((request_id, list(prompt_ids), params, None if context is None else list(context)))
            self._cv.notify()
        return queue

    def abort(self, request_id: str) -> None:
        """End a request at the next step boundary, if it is still running (its blocks are freed)."""
        with self._cv:
            if request_id in self._queues:
                self._aborts.append(request_id)
                self._cv.notify()

    def _post(self, request_id: str, item) -> None:
        """Hand ``item`` (an Output, or an error) to the request's queue; its last one forgets the request."""
        last = not isinstance(item, Output) or item.finished
        with self._cv:
            target = self._queues.pop(request_id, None) if last else self._queues.get(request_id)
        if last and isinstance(item, Output) and self.on_output is not None:
            self.on_output(item)
        if target is not None:
            loop, queue = target
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: no one is listening
                pass

    def run(self) -> None:
        """Step the engine until :meth:`stop` (requests submitted before this runs wait for it)."""
        try:
            while self._cycle():
                pass
        except Exception:  # a bug: said on the server's stderr; /health turns unhealthy
            self.failure = "the engine failed; the server's log has the details"
            traceback.print_exc(file=sys.stderr)
        finally:
            for request_id in list(self.engine.live):
                self._post(request_id, self.engine.abort(request_id))
            with self._cv:
                pending = [request_id for request_id, *_ in self._adds] + [i for i in self._queues]
                self._adds.clear()
            for request_id in dict.fromkeys(pending):
                self._post(request_id, Unavailable(f"the engine stopped ({self.failure or 'shutting down'})"))

    def _cycle(self) -> bool:
        """Take queued adds and aborts, then one step if there is work; False once stopping."""
        with self._cv:
            while not (self._adds or self._aborts or self._stopping or self.engine.has_work()):
                self._cv.wait()
            if self._stopping:
                return False
            adds, aborts = list(self._adds), list(self._aborts)
            self._adds.clear()
            self._aborts.clear()
        for request_id, prompt, params, context in adds:
            try:
                self.engine.add(request_id, prompt, params, context=context)
            except QinferError as e:  # checked before it was queued; this covers what changed since
                self._post(request_id, e)
        for request_id in aborts:
            out = self.engine.abort(request_id)
            if out is not None:
                self._post(request_id, out)
        if self.engine.has_work():
            try:
                outputs = self.engine.step()
            except QinferError as e:  # a step the engine refuses (out of memory): fail its requests, carry on
                for request_id in list(self.engine.live):
                    self.engine.abort(request_id)
                    self._post(request_id, Unavailable(f"the engine could not run this request: {e}"))
                return True
            for out in outputs:
                self._post(out.id, out)
            if self.on_step is not None:
                self.on_step()
        return True
