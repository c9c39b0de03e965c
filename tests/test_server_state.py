"""ServerState's engine thread against a scripted engine: every engine call on
one thread, calls served between steps while the engine is busy, a failing
step failing its requests without stopping the server, and a clear error
after stop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest

from mlx_attn.serve.server_state import ServerState


class ScriptedEngine:
    """Each request yields ``max_tokens`` outputs, one per step; a step takes
    ``step_seconds``; ``fail_steps`` steps raise first. Records the thread of
    every call."""

    def __init__(self, step_seconds=0.002, fail_steps=0):
        self.step_seconds, self.fail_steps = step_seconds, fail_steps
        self.left: dict = {}
        self.threads: set[int] = set()
        self.steps = 0
        self.model = SimpleNamespace(config=SimpleNamespace())

    def _called(self):
        self.threads.add(threading.get_ident())

    @property
    def idle(self):
        self._called()
        return not self.left

    def submit(self, rid, prompt, max_tokens, **_):
        self._called()
        self.left[rid] = max_tokens

    def cancel(self, rid):
        self._called()
        return int(self.left.pop(rid, None) is not None)

    def step(self):
        self._called()
        self.steps += 1
        time.sleep(self.step_seconds)
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("the model failed")
        outputs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            outputs.append(SimpleNamespace(request_id=rid, token=7, finished=self.left[rid] == 0))
            if self.left[rid] == 0:
                del self.left[rid]
        return outputs


def state_of(engine):
    return ServerState(lambda: engine, SimpleNamespace(eos_token_ids={0}), "scripted")


@contextlib.asynccontextmanager
async def serving(engine):
    """A started state over ``engine``, stopped on the way out."""
    state = state_of(engine)
    await state.start()
    try:
        yield state
    finally:
        await state.stop()


async def drain(queue, count, timeout=10.0):
    got = []
    for _ in range(count):
        item = await asyncio.wait_for(queue.get(), timeout)
        got.append(item)
        if isinstance(item, Exception):
            break
    return got


def test_every_engine_call_is_on_one_thread_and_all_tokens_arrive():
    engine = ScriptedEngine()

    async def main():
        async with serving(engine) as state:
            submitted = [await state.submit([1, 2], 5 + i, None) for i in range(3)]
            got = await asyncio.gather(*(drain(queue, 5 + i) for i, (_, queue) in enumerate(submitted)))
        return submitted, got

    submitted, got = asyncio.run(main())
    assert [len(g) for g in got] == [5, 6, 7]
    assert all(o.request_id == rid for (rid, _), g in zip(submitted, got) for o in g)
    assert all(g[-1].finished for g in got)
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads


def test_a_call_is_served_between_steps_of_a_busy_engine():
    engine = ScriptedEngine(step_seconds=0.01)

    async def main():
        async with serving(engine) as state:
            await state.submit([1], 200, None)  # ~2 s of steps
            await asyncio.sleep(0.05)
            started = time.perf_counter()
            steps_then = await state.call(lambda: engine.steps)
            waited = time.perf_counter() - started
            busy = await state.call(lambda: not engine.idle)
        return steps_then, waited, busy

    steps_then, waited, busy = asyncio.run(main())
    assert busy, "the engine should still be generating"
    assert 0 < steps_then < 200
    assert waited < 0.5, f"a call waited {waited:.2f} s behind the engine's steps"


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving():
    engine = ScriptedEngine(fail_steps=1)

    async def main():
        async with serving(engine) as state:
            _, first = await state.submit([1], 3, None)
            failed = await drain(first, 3)
            _, second = await state.submit([1], 3, None)
            served = await drain(second, 3)
        return failed, served

    failed, served = asyncio.run(main())
    assert len(failed) == 1 and isinstance(failed[0], RuntimeError) and "model failed" in str(failed[0])
    assert len(served) == 3 and served[-1].finished


def test_calls_after_stop_are_a_clear_error_not_a_hang():
    engine = ScriptedEngine()

    async def main():
        async with serving(engine) as state:
            pass
        return state

    state = asyncio.run(main())
    with pytest.raises(RuntimeError, match="engine thread has stopped"):
        state.call_blocking(lambda: None, timeout=5.0)


def test_close_stops_a_state_that_never_started():
    state = state_of(ScriptedEngine())
    assert state.call_blocking(lambda: 41 + 1) == 42
    state.close()
    assert not state._thread.is_alive()
