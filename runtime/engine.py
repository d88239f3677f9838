"""`Engine`: one Session serving many concurrent callers (the HTTP server's core, usable from asyncio).

The engine owns the session. Callers `submit` requests from the event loop and read their tokens from
`stream`; a worker thread runs the session's incremental API (`Session.add_request / step / abort`,
runtime/session.py) in a loop, so the steps run off the event loop:

    event loop                       worker thread
    submit() --- intake queue --->   add_request (waits in the session for a free cache slot)
    abort()  --- abort queue  --->   Session.abort (the slot is free for the next step)
                                     step(): admit what fits (prefill), one decode step / MTP round for
    stream() <-- asyncio.Queue ---   every running request, each request's new tokens handed over

A failing step fails the requests it ran (RequestFailed) and the loop goes on with the others.
`observer` (optional) hears of admissions, tokens and finishes: the server's Prometheus metrics.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from dsv4c.runtime.session import Session, StepError, StepOutput

PREFIX_STATS_EVERY = 0.25  # seconds between two reads of the prefix cache's stats for the observer
IDLE_WAKE = 0.5  # seconds an idle worker waits for work before it looks (and refreshes the gauges) again

log = logging.getLogger("dsv4c.engine")


@dataclass(frozen=True)
class RequestSpec:
    """What a request asks for: prompt token ids and `Session.add_request`'s sampling arguments."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()


class QueueFull(RuntimeError):
    """The waiting queue holds `max_waiting` requests already."""


class RequestFailed(RuntimeError):
    """The step running this request failed (`status`: the HTTP status the server answers with)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass
class Handle:
    """One submitted request: its spec, its token queue and its timeline (perf_counter seconds)."""

    id: int
    spec: RequestSpec
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_admitted: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    n_generated: int = 0
    session_id: int | None = None  # the session's request id, once the worker added it
    outcome: str | None = None  # stop | length | aborted | error


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is reading any more
        pass


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


class Observer(Protocol):
    def admitted(self, h: Handle) -> None: ...
    def finished(self, h: Handle, stats: dict | None) -> None: ...
    def gauges(self, running: int, waiting: int, slots_in_use: int) -> None: ...
    def prefix_cache(self, stats: dict) -> None: ...


class Engine:
    def __init__(self, sess: Session, max_waiting: int = 256, observer: Observer | None = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting: must be >= 1, got {max_waiting}")
        self.sess, self.max_waiting, self.observer = sess, max_waiting, observer
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._intake: list[Handle] = []
        self._aborts: list[Handle] = []
        self._by_sid: dict[int, Handle] = {}
        self._n_waiting = 0  # submitted, not admitted yet (intake + the session's waiting queue)
        self._ids = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.failed_steps = 0
        self._prefix_due = 0.0  # when the observer next gets the prefix cache's stats

    # ---- the event loop's side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dsv4c-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def waiting(self) -> int:
        return self._n_waiting

    def submit(self, spec: RequestSpec) -> Handle:
        """Queue a request (call on the event loop). QueueFull when max_waiting requests wait already."""
        with self._lock:
            if self._n_waiting >= self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests; --max-waiting)")
            h = Handle(next(self._ids), spec, asyncio.get_running_loop())
            self._n_waiting += 1
            self._intake.append(h)
        self._wake.set()
        return h

    def abort(self, h: Handle) -> None:
        """Stop a request (a client went away); its slot is free for the next step."""
        if h.outcome is None:
            with self._lock:
                self._aborts.append(h)
            self._wake.set()

    async def stream(self, h: Handle) -> AsyncIterator[StepOutput]:
        """The request's StepOutputs until it finishes; raises RequestFailed if its step failed. Leaving
        early (the consumer is cancelled or closes the generator) aborts the request."""
        try:
            while True:
                item = await h.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if h.outcome is None:
                self.abort(h)

    # ---- the worker thread ------------------------------------------------------------------------
    def _run(self) -> None:
        sess = self.sess
        while not self._stop:
            self._wake.clear()
            self._take_intake()
            if not sess.has_unfinished():
                self._gauges()
                self._wake.wait(IDLE_WAKE)
                continue
            try:
                outs = sess.step()
            except StepError as e:
                self.failed_steps += 1
                log.exception("engine step failed; failing requests %s", e.request_ids)
                for sid in e.request_ids:
                    h = self._by_sid.pop(sid, None)
                    if h is not None:
                        if h.t_admitted is None:  # failed while being admitted
                            self._unwait(h)
                        self._finish(h, "error", None, RequestFailed(f"the engine step failed: {e.cause!r}"))
                continue
            self.steps += 1
            batch: dict[asyncio.AbstractEventLoop, list] = {}
            for o in outs:
                self._deliver(o, batch)
            for loop, items in batch.items():  # one wake-up of each event loop per step
                _call(loop, _put_all, items)
            self._gauges()

    def _take_intake(self) -> None:
        with self._lock:
            new, self._intake = self._intake, []
            aborts, self._aborts = self._aborts, []
        for h in new:
            s = h.spec
            try:
                h.session_id = self.sess.add_request(list(s.prompt_ids), max_new_tokens=s.max_tokens,
                                                     temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                                     seed=s.seed, stop=list(s.stop), logprobs=s.logprobs,
                                                     presence_penalty=s.presence_penalty,
                                                     frequency_penalty=s.frequency_penalty,
                                                     repetition_penalty=s.repetition_penalty, min_p=s.min_p,
                                                     logit_bias=s.logit_bias)
            except ValueError as e:  # the server checks first; this is the session's word on it
                self._unwait(h)
                self._finish(h, "error", None, RequestFailed(str(e), status=400))
                continue
            self._by_sid[h.session_id] = h
        for h in aborts:
            if h.outcome is not None:
                continue
            if h.session_id is not None:
                self.sess.abort(h.session_id)
                self._by_sid.pop(h.session_id, None)
            if h.t_admitted is None:
                self._unwait(h)
            self._finish(h, "aborted", None, RequestFailed("the request was aborted (the client went away)", 499))

    def _deliver(self, o: StepOutput, batch: dict) -> None:
        h = self._by_sid.get(o.request_id)
        if h is None:
            return
        now = time.perf_counter()
        if o.admitted is not None:
            h.t_admitted = o.admitted
            self._unwait(h)
            if self.observer is not None:
                self.observer.admitted(h)
        if o.tokens:
            h.t_first = h.t_first or now
            h.t_last = now
            h.n_generated += len(o.tokens)
        batch.setdefault(h.loop, []).append((h.queue, o))
        if o.finish_reason is not None:
            del self._by_sid[o.request_id]
            self._finish(h, o.finish_reason, o.stats, None)

    def _finish(self, h: Handle, outcome: str, stats: dict | None, error: Exception | None) -> None:
        h.outcome = outcome
        if error is not None:
            _call(h.loop, h.queue.put_nowait, error)
        if self.observer is not None:
            self.observer.finished(h, stats)

    def _unwait(self, h: Handle) -> None:
        with self._lock:
            self._n_waiting -= 1

    def _gauges(self) -> None:
        if self.observer is None:
            return
        waiting, running = self.sess.live_counts()
        now = time.perf_counter()
        # read on the thread that changes it; stats() walks the block table, so while requests run not every step
        if self.sess.prefix is not None and (now >= self._prefix_due or not (waiting or running)):
            self._prefix_due = now + PREFIX_STATS_EVERY
            self.observer.prefix_cache(self.sess.prefix.stats())
        self.observer.gauges(running, self._n_waiting, running)
