"""Next-token sampling (mlx_attn.lm.sampling): greedy, temperature, top-k,
top-p, min-p, the repetition penalty, and refused parameters."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_attn.lm.sampling import apply_repetition_penalty, make_sampler

LOGITS = mx.array([[2.0, 1.0, 0.5, -1.0, 0.0, 3.0]])


def frequencies(sampler, n=4000, seed=0, logits=LOGITS):
    mx.random.seed(seed)
    draws = np.array(sampler(mx.broadcast_to(logits, (n, logits.shape[1]))))
    return np.bincount(draws, minlength=logits.shape[1]) / n


def test_greedy_and_degenerate_filters_pick_the_argmax():
    assert make_sampler(0.0)(LOGITS).item() == 5
    for sampler in (make_sampler(1.0, top_k=1), make_sampler(1.0, top_p=1e-6), make_sampler(1.0, min_p=0.99)):
        assert set(np.unique(np.array(sampler(mx.broadcast_to(LOGITS, (200, 6)))))) == {5}


def test_temperature_sampling_follows_softmax():
    for temperature in (1.0, 0.5):
        expected = np.exp(np.array(LOGITS[0]) / temperature)
        expected /= expected.sum()
        got = frequencies(make_sampler(temperature))
        assert np.abs(got - expected).max() < 0.03, (got, expected)


def test_top_k_top_p_and_min_p_restrict_the_support():
    assert set(np.nonzero(frequencies(make_sampler(1.0, top_k=2)))[0]) == {0, 5}
    probs = np.exp(np.array(LOGITS[0]))
    probs /= probs.sum()  # sorted: 5 (0.56), 0 (0.21), 1 (0.08), ...
    assert set(np.nonzero(frequencies(make_sampler(1.0, top_p=0.7)))[0]) == {5, 0}
    assert set(np.nonzero(frequencies(make_sampler(1.0, min_p=0.3)))[0]) == {5, 0}
    # renormalised among the survivors
    got = frequencies(make_sampler(1.0, top_k=2))
    assert abs(got[5] - probs[5] / (probs[5] + probs[0])) < 0.03


def test_seeded_sampling_is_reproducible():
    sampler = make_sampler(1.0)
    assert np.array_equal(frequencies(sampler, seed=3), frequencies(sampler, seed=3))


def test_repetition_penalty():
    out = np.array(apply_repetition_penalty(mx.array([[2.0, -2.0, 1.0]]), [0, 1, 1], 2.0))
    np.testing.assert_allclose(out, [[1.0, -4.0, 1.0]])
    with pytest.raises(ValueError):
        apply_repetition_penalty(LOGITS, [0], 0.0)


def test_extreme_temperatures_never_give_nan():
    # a tiny temperature is greedy in effect; a huge one is uniform
    assert set(np.unique(np.array(make_sampler(1e-30)(mx.broadcast_to(LOGITS, (200, 6)))))) == {5}
    got = frequencies(make_sampler(1e30))
    assert np.abs(got - 1 / 6).max() < 0.03
    big = mx.array([[3e38, -3e38, 0.0]])  # float32 extremes
    assert set(np.unique(np.array(make_sampler(0.5)(mx.broadcast_to(big, (50, 3)))))) == {0}


@given(
    logits=st.lists(st.one_of(st.floats(-(2.0**120), 2.0**120, width=32), st.just(-math.inf)), min_size=1, max_size=12)
    .filter(lambda row: any(math.isfinite(x) for x in row)),
    temperature=st.one_of(st.just(0.0), st.floats(1e-30, 1e30)),
    top_k=st.integers(0, 14),
    top_p=st.floats(1e-9, 1.0),
    min_p=st.floats(0.0, 0.999),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_valid_parameters_sample_a_finite_logit(logits, temperature, top_k, top_p, min_p, seed):
    """Whatever the (valid) parameters, the token drawn is an index of a
    finite logit, and with top_k it is among the k largest."""
    mx.random.seed(seed)
    row = np.array(logits, dtype=np.float32)
    token = make_sampler(temperature, top_k, top_p, min_p)(mx.array(row)[None]).item()
    assert 0 <= token < len(row) and np.isfinite(row[token])
    if top_k:
        assert row[token] >= np.sort(row)[-min(top_k, len(row))]


# ---------------------------------------------------------------- hostile input
@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(temperature=math.nan), "temperature must be finite"),
    (dict(temperature=math.inf), "temperature must be finite"),
    (dict(temperature="0.7"), "temperature must be a number, got str"),
    (dict(temperature=None), "temperature must be a number, got NoneType"),
    (dict(temperature=True), "temperature must be a number, got bool"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_k=2.5), "top_k must be an integer, got float"),
    (dict(top_k="3"), "top_k must be an integer, got str"),
    (dict(top_p=0.0), r"top_p must be > 0.0"),
    (dict(top_p=1.5), r"top_p must be <= 1.0"),
    (dict(top_p=math.nan), "top_p must be finite"),
    (dict(top_p=-math.inf), "top_p must be finite"),
    (dict(min_p=1.0), r"min_p must be < 1.0"),
    (dict(min_p=-0.1), r"min_p must be >= 0.0"),
    (dict(min_p=math.nan), "min_p must be finite"),
    (dict(min_p=[0.1]), "min_p must be a number, got list"),
])
def test_invalid_sampling_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_sampler(**kwargs)


@pytest.mark.parametrize("penalty, message", [
    (0.0, "repetition_penalty must be > 0"), (-1.0, "must be > 0"), (math.nan, "must be finite"),
    (math.inf, "must be finite"), ("2", "must be a number, got str"), (None, "must be a number"),
])
def test_invalid_repetition_penalties(penalty, message):
    with pytest.raises(ValueError, match=message):
        apply_repetition_penalty(LOGITS, [0], penalty)
