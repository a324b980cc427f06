"""The reference engine's admission: a waiting request that does not fit the free device blocks
does not hold up shorter requests behind it, and it is overtaken only a bounded number of times
before admission waits for it."""

from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine, SamplingParams
from dynamo_flexkv.integrations.reference_engine.request import Request

CFG = EngineModelConfig.preset("tiny")
BS = CFG.block_size


def prompt(blocks: int, seed: int) -> list[int]:
    """A prompt of ``blocks`` full blocks, distinct per seed (no shared prefix)."""
    return [(seed * 131 + i) % CFG.vocab_size for i in range(blocks * BS)]


def step_until(engine: LLMEngine, done, limit: int = 10_000) -> list[Request]:
    """Steps until ``done(finished so far)``; the step bound turns a livelock into a failure."""
    finished: list[Request] = []
    for _ in range(limit):
        if done(finished):
            return finished
        engine.step()
        finished += engine.take_finished()
    raise AssertionError(f"not done after {limit} steps; finished: {[r.id for r in finished]}")


def test_short_requests_overtake_a_long_one_that_does_not_fit_and_the_long_one_runs_later():
    engine = LLMEngine(CFG, num_device_blocks=40, device_prefix_cache=False)
    # Holds 25 of 40 blocks for a while: the long request (20 blocks) cannot fit until it ends.
    engine.add_request(prompt(24, 1), SamplingParams(max_tokens=40), request_id="hog")
    engine.step()
    assert [r.id for r in engine.running] == ["hog"]
    engine.add_request(prompt(19, 2), SamplingParams(max_tokens=4), request_id="long")
    shorts = [
        engine.add_request(prompt(1, 10 + i), SamplingParams(max_tokens=2), request_id=f"short{i}") for i in range(3)
    ]
    finished = step_until(engine, lambda f: {r.id for r in f} >= set(shorts))
    assert "long" not in {r.id for r in finished} and any(r.id == "long" for r in engine.waiting)
    assert "hog" not in {r.id for r in finished}  # the short ones ran beside it, not after it
    finished += step_until(engine, lambda f: any(r.id == "long" for r in f))
    order = [r.id for r in finished]
    assert order.index("hog") < order.index("long")  # it waited for the blocks the hog held
    assert all(r.finish_reason == "length" for r in finished)
    assert engine.pool.num_available == engine.pool.num_blocks


def test_a_request_overtaken_often_enough_stops_admission_until_it_fits():
    limit = 2
    engine = LLMEngine(CFG, num_device_blocks=40, device_prefix_cache=False, max_overtakes=limit)
    engine.add_request(prompt(24, 1), SamplingParams(max_tokens=30), request_id="hog")
    engine.step()
    engine.add_request(prompt(19, 2), SamplingParams(max_tokens=4), request_id="long")
    for i in range(5):
        engine.add_request(prompt(1, 10 + i), SamplingParams(max_tokens=2), request_id=f"short{i}")
    engine.step()
    # Only `limit` short requests went past it; the rest wait behind it although they would fit.
    assert sorted(r.id for r in engine.running) == ["hog", "short0", "short1"]
    long = next(r for r in engine.waiting if r.id == "long")
    assert long.overtaken == limit
    finished = step_until(engine, lambda f: any(r.id == "long" for r in f))
    order = [r.id for r in finished]
    # short2..4 were admitted only once the long one had been admitted.
    assert all(order.index(f"short{i}") > order.index("hog") for i in (2, 3, 4))
    assert not engine.waiting or all(r.id.startswith("short") for r in engine.waiting)
    step_until(engine, lambda f: not engine.has_unfinished())
    assert engine.pool.num_available == engine.pool.num_blocks


def test_max_overtakes_zero_is_first_come_first_served():
    engine = LLMEngine(CFG, num_device_blocks=40, device_prefix_cache=False, max_overtakes=0)
    engine.add_request(prompt(24, 1), SamplingParams(max_tokens=30), request_id="hog")
    engine.step()
    engine.add_request(prompt(19, 2), SamplingParams(max_tokens=4), request_id="long")
    engine.add_request(prompt(1, 10), SamplingParams(max_tokens=2), request_id="short")
    engine.step()
    assert [r.id for r in engine.running] == ["hog"]
