"""The server's bridge to the engine: the engine and the one thread that
alone calls it, stepping it back to back while it has work.

Every engine call (submit, step, cancel) runs on that thread, so the engine is
never touched from two threads; generated tokens go to per-request asyncio
queues through the event loop. Calls from the event loop (submits, metrics)
and cancels (a client that went away) are taken between two steps; a cancel
frees the request's pages before the next step. The thread steps again as soon
as a step ends: a step does not wait for the event loop to take the previous
step's tokens (two thread hand-offs, ~0.27 ms each on a busy 2-core CPU, when
the loop scheduled every step)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Hashable

from mlx_attn.serve.api_error import APIError

__all__ = ["ServerState"]


class _Active:
    """A request the server is serving: its queue of engine outputs."""

    def __init__(self, queue: asyncio.Queue):
        self.queue = queue
        self.started = asyncio.Event()  # its first output (or an error) arrived: its prompt's pages are computed


_STOP = object()  # the engine thread's last call


class ServerState:
    """The engine, the thread that alone calls it, and the event loop's side:
    the requests being served and their queues."""

    def __init__(self, make_engine, tokenizer, model_name: str, *, default_max_tokens: int = 512,
                 default_temperature: float = 0.0, max_requests: int = 256):
        """``make_engine()`` builds the engine on its own thread: MLX streams
        are per thread, so its arrays are made where they are used."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.default_temperature = default_temperature
        self.max_requests = max_requests  # being served at once (running or waiting); more get 429
        self.created = int(time.time())
        self.engine = None
        self._active: dict[Hashable, _Active] = {}  # touched on the event loop's thread only
        self._wakeup = threading.Condition()  # guards _calls, _cancels and _paused
        self._calls: list[tuple] = []  # (fn, args, future) to run on the engine thread between steps
        self._cancels: list[Hashable] = []
        self._paused = False  # a step failed: no stepping until the next call or cancel
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start(): stepping delivers to it
        self._ids = itertools.count()
        self.generated_tokens = 0
        self.requests_total = 0
        self.cancelled_requests = 0  # cancelled in the engine before they ended (disconnects, stop strings)
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._serve, name="mlx-attn-engine", daemon=True)
        self._thread.start()
        self.engine = self.call_blocking(make_engine)

    @property
    def context(self) -> int | None:
        return getattr(self.engine.model.config, "max_position_embeddings", None)

    async def start(self) -> None:
        with self._wakeup:
            self._loop = asyncio.get_running_loop()
            self._wakeup.notify()

    async def stop(self) -> None:
        from mlx_attn import _ext

        # Empty the engine thread's compile cache while Python can still free
        # its entries (freed at the thread's exit, they abort a process that
        # is already shutting down).
        await self.call(_ext.forget_thread_compile_cache)
        await asyncio.wrap_future(self._post(_STOP, ()))
        self._thread.join()
        self._loop = None

    def close(self) -> None:
        """Stop the engine thread from outside an event loop (a state that was never started)."""
        if self._thread.is_alive():
            self.call_blocking(_STOP)
            self._thread.join()

    def _post(self, fn, args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wakeup:
            if not self._thread.is_alive() and self.engine is not None:
                raise RuntimeError("the server's engine thread has stopped")
            self._calls.append((fn, args, future))
            self._paused = False
            self._wakeup.notify()
        return future

    def call_blocking(self, fn, *args, timeout: float = 60.0):
        """Run ``fn`` on the engine's thread from another thread (tests, tools)."""
        return self._post(fn, args).result(timeout)

    async def call(self, fn, *args):
        """Run ``fn`` on the engine's thread (between two steps)."""
        return await asyncio.wrap_future(self._post(fn, args))

    def check_room(self, count: int) -> None:
        """429 unless ``count`` more requests fit under ``max_requests``."""
        if len(self._active) + count > self.max_requests:
            raise APIError(429, f"the server is serving its limit of {self.max_requests} requests; retry later",
                           None, "rate_limit_exceeded")

    async def submit(self, prompt: list[int], max_tokens: int, sampling,
                     constraint=None, speculative: bool = True) -> tuple[Hashable, asyncio.Queue]:
        self.check_room(1)
        rid = f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()

        constrained = {} if constraint is None else {"constraint": constraint}  # engines without constraints too

        def submit():
            self.engine.submit(rid, prompt, max_tokens, stop_token_ids=sorted(self.tokenizer.eos_token_ids),
                               sampling=sampling, speculative=speculative, **constrained)

        self._active[rid] = _Active(queue)  # counts against the limit from now on
        try:
            await self.call(submit)
        except BaseException:
            self._active.pop(rid, None)
            raise
        self.requests_total += 1
        return rid, queue

    async def first_output(self, rid: Hashable) -> None:
        """Wait for a request's first output (its prompt is in the pages)."""
        active = self._active.get(rid)
        if active is not None:
            await active.started.wait()

    def cancel(self, rid: Hashable) -> None:
        """Cancel from the event loop (also a cancelled task's cleanup):
        applied on the engine thread before its next step."""
        if self._active.pop(rid, None) is None:
            return
        with self._wakeup:
            self._cancels.append(rid)
            self._paused = False
            self._wakeup.notify()

    def finished(self, rid: Hashable) -> None:
        self._active.pop(rid, None)

    @property
    def idle(self) -> bool:
        """No request is being served and the engine has nothing left."""
        return not self._active and not self._cancels and self.engine.idle

    # ------------------------------------------------------------ the engine thread
    def _stepping(self) -> bool:
        """Whether the engine thread should step now (under _wakeup)."""
        return self._loop is not None and not self._paused and self.engine is not None and not self.engine.idle

    def _serve(self) -> None:
        """The engine thread: calls and cancels between steps; steps while the engine has work."""
        while True:
            with self._wakeup:
                while not self._calls and not self._cancels and not self._stepping():
                    self._wakeup.wait()
                calls, self._calls = self._calls, []
                cancels, self._cancels = self._cancels, []
            for at, (fn, args, future) in enumerate(calls):
                if fn is _STOP:
                    with self._wakeup:
                        later, self._calls = calls[at + 1:] + self._calls, []
                    for _, _, pending in later:
                        pending.set_exception(RuntimeError("the server's engine thread has stopped"))
                    future.set_result(None)
                    return
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn(*args))
                except BaseException as error:  # noqa: BLE001  the caller gets it
                    future.set_exception(error)
            for rid in cancels:
                self.cancelled_requests += self.engine.cancel(rid)
            with self._wakeup:
                stepping, loop = self._stepping(), self._loop
            if not stepping:
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # noqa: BLE001  the model failed: fail its requests, keep serving
                with self._wakeup:
                    self._paused = True
                self._to_loop(loop, self._fail_active, error)
                continue
            if outputs:
                self._to_loop(loop, self._deliver, outputs)

    def _to_loop(self, loop, fn, arg) -> None:
        try:
            loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop closed without stop(): nobody to deliver to, stop stepping
            with self._wakeup:
                if self._loop is loop:
                    self._loop = None

    # ------------------------------------------------------------ the event loop's side
    def _deliver(self, outputs) -> None:
        for output in outputs:
            self.generated_tokens += 1
            active = self._active.get(output.request_id)
            if active is not None:
                active.queue.put_nowait(output)
                active.started.set()

    def _fail_active(self, error: Exception) -> None:
        for rid in list(self._active):
            self._active[rid].queue.put_nowait(error)
            self._active[rid].started.set()
            self.cancel(rid)

    def metrics(self) -> str:
        stats = self.engine.stats()
        elapsed = max(time.monotonic() - self.started, 1e-9)
        lines = []

        def metric(name, kind, help_text, value):
            lines.extend([f"# HELP mlx_attn_{name} {help_text}", f"# TYPE mlx_attn_{name} {kind}",
                          f"mlx_attn_{name} {value}"])

        metric("requests_running", "gauge", "Requests with pages in the pool.", stats["running"])
        metric("requests_waiting", "gauge", "Requests waiting for admission.", stats["waiting"])
        metric("requests_total", "counter", "Requests accepted.", self.requests_total)
        metric("pages_total", "gauge", "Pages in the pool.", stats["pages_total"])
        metric("pages_used", "gauge", "Pages held by requests.", stats["pages_held"])
        metric("pages_cached", "gauge", "Pages held by no request, kept for the prefix cache.",
               stats["pages_cached"])
        metric("pages_free", "gauge", "Free pages.", stats["pages_free"])
        metric("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache / prompt tokens.",
               stats["prefix_hit_rate"])
        metric("prefix_reuse_enabled", "gauge", "1 when cached pages may serve a prompt's prefix; 0 for models "
               "with recurrent layers (hybrid) without saved states, whose prompts are computed whole.",
               stats["prefix_reuse"])
        if "state_snapshots" in stats:
            metric("state_snapshots", "gauge", "Recurrent states saved at page boundaries for prefix reuse "
                   "(hybrid models).", stats["state_snapshots"])
        metric("requests_cancelled_total", "counter", "Requests cancelled before they ended.",
               self.cancelled_requests)
        metric("preemptions_total", "counter", "Requests preempted for pages.", stats["preemptions"])
        metric("generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens)
        metric("draft_tokens_total", "counter", "Tokens proposed by speculative drafting and verified.",
               stats["draft_tokens"])
        metric("accepted_draft_tokens_total", "counter", "Proposed tokens the model accepted.",
               stats["accepted_draft_tokens"])
        drafter_lines = []
        for counter, key, help_text in (("drafter_tokens_total", "draft_tokens", "Tokens proposed and verified, "
                                         "by drafter (ngram: prompt lookup; draft: the draft model)."),
                                        ("drafter_accepted_tokens_total", "accepted_draft_tokens",
                                         "Proposed tokens the model accepted, by drafter.")):
            drafter_lines += [f"# HELP mlx_attn_{counter} {help_text}", f"# TYPE mlx_attn_{counter} counter"]
            drafter_lines += [f'mlx_attn_{counter}{{drafter="{name}"}} '
                              f'{stats[key] if stats.get("drafter") == name else 0}' for name in ("ngram", "draft")]
        lines.extend(drafter_lines)
        metric("generated_tokens_per_second", "gauge", "Tokens generated per second since start.",
               self.generated_tokens / elapsed)
        return "\n".join(lines) + "\n"
