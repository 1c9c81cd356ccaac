"""jaxq.compare_timing: variants called round by round, paired ratios with an interval."""

import time

import pytest

import jaxq


def sleeper(seconds):
    def f(x):
        time.sleep(seconds)
        return x

    return f


def test_paired_speedups_order_variants_and_bracket_their_median():
    table = jaxq.compare_timing(
        {"slow": sleeper(0.004), "fast": sleeper(0.001), "same": sleeper(0.004)}, 1, rounds=12
    )
    assert [r.name for r in table.rows] == ["slow", "fast", "same"]
    slow, fast = table["slow"], table["fast"]
    assert slow.speedup == 1.0 and slow.interval == (1.0, 1.0)  # the baseline against itself
    assert fast.speedup > 2.0 and fast.ms < slow.ms  # 4 ms against 1 ms (sleep may overshoot)
    for r in table.rows:
        lo, hi = r.interval
        assert lo <= r.speedup <= hi
        assert len(r.times) == 12
    text = str(table)
    assert "fast" in text and "speed-up" in text and "interleaved" in text


def test_variants_are_interleaved_in_a_fresh_order_each_round():
    """Each round calls every variant once, in a random order: in a fixed order the variant
    called first ran slower, which showed a function 1.01x-1.5x faster than itself."""
    calls = []
    variants = {k: (lambda x, k=k: calls.append(k)) for k in ("a", "b", "c")}
    jaxq.compare_timing(variants, 0, rounds=60, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # warm-up
    rounds = [calls[i : i + 3] for i in range(3, len(calls), 3)]
    assert len(rounds) == 60 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    for k in "abc":  # every variant is called first, second and third, about equally often
        for position in range(3):
            assert 10 <= sum(r[position] == k for r in rounds) <= 30


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="at least one variant"):
        jaxq.compare_timing({}, 1)
    with pytest.raises(ValueError, match="rounds must be >= 1; got 0"):
        jaxq.compare_timing({"a": sleeper(0)}, 1, rounds=0)
    table = jaxq.compare_timing({"a": sleeper(0)}, 1, rounds=2)
    with pytest.raises(KeyError, match="no variant 'b'; variants: \\['a'\\]"):
        table["b"]
