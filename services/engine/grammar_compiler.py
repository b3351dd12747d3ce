"""Grammar compiles, bounded: each structured-output constraint is compiled by xgrammar
once (an LRU of compiled grammars), on a few threads of the compiler's own, never on the
engine thread, within a time limit.

    submit(constraint) -> Future   a hit: done at once; a constraint already compiling:
                                   that compile's outcome; else queued for a thread
    a compile thread   -> the compiled grammar, or ValueError: it cannot compile, or it
                                   ran past the time limit

At most `max_pending` distinct compiles are queued or running; past that, `submit` raises
AtCapacity (RESOURCE_EXHAUSTED with a retry hint). xgrammar cannot be interrupted: a
compile past the time limit fails its requests at once, but keeps its thread until it
returns and counts as pending until then. The bound is what protects the worker: at
worst every compile thread is busy and `max_pending` compiles wait. The threads are
daemons, so a worker that stops never waits for a runaway compile.
"""

from __future__ import annotations

import json
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING

from ..common.capacity import AtCapacity
from ..common.sampling_params import StructuredOutput
from .structured_output import GrammarState

if TYPE_CHECKING:  # xgrammar itself is imported on first use
    from xgrammar import CompiledGrammar

CACHE_SIZE = 64  # compiled grammars kept, least recently used first out


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe. The workers
    compile before the engine thread admits, and hand the compiled grammar to the
    admission; the offline API compiles before it adds."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                 timeout_s: float, threads: int, max_pending: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self.threads = threads
        self.max_pending = max_pending
        self._lock = threading.Lock()  # the cache, the pending compiles, the threads
        self._init_lock = threading.Lock()  # xgrammar's compiler, made on first use
        self._compiler = None
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple, Future] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []

    def cached(self, constraint: StructuredOutput) -> CompiledGrammar | None:
        """The compiled grammar if the cache holds it, else None; never compiles."""
        with self._lock:
            return self._hit(constraint.key)

    def _hit(self, key: tuple) -> CompiledGrammar | None:
        """The cached grammar, now the most recently used, or None (under the lock)."""
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def submit(self, constraint: StructuredOutput) -> Future:
        """A future of the compiled grammar, the caller's own (cancelling it touches no
        other caller). AtCapacity if `max_pending` compiles are queued or running."""
        mine: Future = Future()
        key = constraint.key
        with self._lock:
            hit = self._hit(key)
            if hit is not None:
                mine.set_result(hit)
                return mine
            job = self._pending.get(key)
            if job is None:
                if len(self._pending) >= self.max_pending:
                    raise AtCapacity(f"structured output: {len(self._pending)} grammar "
                                     f"compiles queued or running (limit {self.max_pending})")
                job = self._pending[key] = Future()
                self._jobs.put((constraint, job))
                if not self._workers:  # an engine that never sees a constraint has none
                    self._workers = [threading.Thread(target=self._work, daemon=True,
                                                      name=f"grammar-compile-{i}")
                                     for i in range(self.threads)]
                    for t in self._workers:
                        t.start()
        job.add_done_callback(lambda done: _forward(done, mine))
        return mine

    def compile(self, constraint: StructuredOutput):
        """The compiled grammar, waiting for it (the offline API); ValueError naming the
        problem if it cannot compile in time, AtCapacity if the queue is full."""
        return self.submit(constraint).result()

    def matcher(self, constraint: StructuredOutput,
                compiled: CompiledGrammar | None = None) -> GrammarState:
        """A request's own matcher (cheap), over `compiled` or else the cached grammar:
        the engine thread calls this, so it never compiles (ValueError instead)."""
        import xgrammar as xgr

        compiled = compiled if compiled is not None else self.cached(constraint)
        if compiled is None:
            raise ValueError(f"structured output {constraint.kind}: not compiled; compile "
                             "it before adding the request (grammars.submit)")
        return GrammarState(xgr.GrammarMatcher(compiled), constraint.start_after)

    def close(self) -> None:
        """The threads end after the compile each runs (daemons: nobody waits)."""
        with self._lock:
            for _ in self._workers:
                self._jobs.put(None)
            self._workers = []

    # ---- the compile threads ------------------------------------------------------------

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            self._run(*item)

    def _run(self, constraint: StructuredOutput, job: Future) -> None:
        compiled, error = None, None
        try:
            compiler = self._xgr()  # the first one reads the vocabulary: not timed
            timer = threading.Timer(self.timeout_s, _settle, (job, None, ValueError(
                f"structured output {constraint.kind}: not compiled within the time limit "
                f"of {self.timeout_s:g}s (grammar_compile_timeout_s); simplify it")))
            timer.daemon = True
            timer.start()
            try:
                compiled = _compile(compiler, constraint)
            finally:
                timer.cancel()
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and others
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            error = ValueError(f"structured output {constraint.kind}: cannot compile: {msg}")
        with self._lock:
            del self._pending[constraint.key]
            if compiled is not None:  # even past the time limit: a retry finds it
                self._cache[constraint.key] = compiled
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        _settle(job, compiled, error)

    def _xgr(self):
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids)
                # Our LRU is the only cache: xgrammar's own would grow without bound with
                # every distinct schema a long-running server sees.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler


def _settle(job: Future, compiled, error: Exception | None) -> None:
    """The compile's outcome, or the time limit's, whichever comes first."""
    try:
        if error is not None:
            job.set_exception(error)
        else:
            job.set_result(compiled)
    except InvalidStateError:  # the other came first
        pass


def _forward(job: Future, mine: Future) -> None:
    if not mine.set_running_or_notify_cancel():  # that caller left
        return
    if job.exception() is not None:
        mine.set_exception(job.exception())
    else:
        mine.set_result(job.result())


def _compile(compiler, c: StructuredOutput):
    import xgrammar as xgr

    # Compact JSON (no free whitespace): small models left free to emit whitespace can
    # emit it forever, and a parse does not care.
    if c.kind == "json":
        return compiler.compile_json_schema(c.spec, any_whitespace=False)
    if c.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if c.kind == "regex":
        return compiler.compile_regex(c.spec)
    if c.kind == "choice":
        alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in c.choices)
        return compiler.compile_grammar(f"root ::= {alts}")
    # "grammar": GBNF (xgrammar's EBNF); a Lark grammar, as vLLM's guidance backend
    # takes, is read too. The EBNF error is reported when neither parses.
    try:
        return compiler.compile_grammar(c.spec)
    except Exception as ebnf_error:  # noqa: BLE001
        try:
            return compiler.compile_grammar(xgr.Grammar.from_lark(c.spec))
        except Exception:  # noqa: BLE001
            raise ebnf_error from None
