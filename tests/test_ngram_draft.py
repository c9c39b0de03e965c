"""The prompt-lookup drafter: longest recent n-gram match, bounded proposals."""

import pytest

from mlx_attn.lm.ngram_draft import NgramDrafter, propose_ngram


def test_copies_what_followed_the_longest_recent_match():
    # "1 2 3" occurs earlier followed by 4 5 6; the 1-gram "3" alone also matches at 9 -> 7
    tokens = [1, 2, 3, 4, 5, 6, 9, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(tokens, 3) == [4, 5, 6]
    assert propose_ngram(tokens, 3, max_ngram=1) == [7, 8, 1]  # the most recent "3"


def test_most_recent_occurrence_wins():
    tokens = [5, 1, 10, 5, 1, 20, 5, 1]
    assert propose_ngram(tokens, 1) == [20]


def test_count_bounds_and_end_of_sequence():
    tokens = [1, 2, 3, 1, 2]
    assert propose_ngram(tokens, 10) == [3, 1, 2]  # what exists after the match, no more
    assert propose_ngram(tokens, 1) == [3]
    assert propose_ngram(tokens, 0) == []


def test_no_recurrence_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], 4) == []
    assert propose_ngram([7], 4) == []
    assert propose_ngram([], 4) == []


def test_min_ngram_refuses_short_matches():
    tokens = [1, 9, 2, 9]  # only the 1-gram "9" recurs
    assert propose_ngram(tokens, 2, min_ngram=1) == [2, 9]
    assert propose_ngram(tokens, 2, min_ngram=2) == []


def test_window_limits_the_search():
    tokens = [4, 8] + [0] * 10 + [1, 4]
    assert propose_ngram(tokens, 1) == [8]
    assert propose_ngram(tokens, 1, window=5) == []


def test_drafter_checks_its_lengths():
    assert NgramDrafter(3, 2).propose([1, 2, 3, 1, 2], 2) == [3, 1]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(2, 3)
    with pytest.raises(ValueError, match="max_ngram"):
        NgramDrafter(0)
