"""The ratios bench_extract.py prints over --rounds (testkit.rounds): each capture phase against its own
round's (a)."""

from __future__ import annotations

from testkit.rounds import round_ratios


def rate(v: float) -> dict:
    return {"tokens_per_s": v}


def test_each_round_is_set_against_its_own_a():
    rounds = [
        {
            "a": {"uniform": rate(100), "mixed": rate(50)},
            "b": {"uniform": rate(90), "mixed": rate(40), "uniform_shm": rate(95)},
        },
        {
            "a": {"uniform": rate(80), "mixed": rate(50)},
            "b": {"uniform": rate(80), "mixed": rate(45), "uniform_shm": rate(76)},
        },
        {"a": {"uniform": rate(100), "mixed": rate(100)}, "b": {"uniform": rate(97), "mixed": rate(99)}},
    ]
    lines = round_ratios(rounds)
    assert lines[0] == "b/a uniform: rounds 0.90 1.00 0.97; median 0.97, 0.90-1.00"
    assert lines[1] == "b/a mixed: rounds 0.80 0.90 0.99; median 0.90, 0.80-0.99"
    # to /dev/shm: against (a)'s uniform rate of the same round, in the rounds that wrote one
    assert lines[2] == "b/a uniform_shm: rounds 0.95 0.95; median 0.95, 0.95-0.95"
    assert len(lines) == 3  # no (f): nothing made up


def test_a_round_without_a_is_left_out():
    rounds = [
        {"b": {"uniform": rate(90)}},  # (a) failed this round: no ratio from another round's (a)
        {"a": {"uniform": rate(100)}, "b": {"uniform": rate(90)}, "f": {"uniform": rate(95)}},
    ]
    assert round_ratios(rounds) == [
        "b/a uniform: rounds 0.90; median 0.90, 0.90-0.90",
        "f/a uniform: rounds 0.95; median 0.95, 0.95-0.95",
    ]


def test_the_compiled_baseline_p_is_read_beside_a():
    # (p) is (a) compiled: (f) and (g) are compiled too, so f/p is the like-for-like ratio
    rounds = [{"a": {"uniform": rate(100)}, "p": {"uniform": rate(110)}, "f": {"uniform": rate(99)}}]
    assert round_ratios(rounds) == [
        "f/a uniform: rounds 0.99; median 0.99, 0.99-0.99",
        "f/p uniform: rounds 0.90; median 0.90, 0.90-0.90",
    ]
