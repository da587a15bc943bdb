"""What MQAR gives away without retrieval (chapter 9, eq-tr-no-retrieval).

`make_mqar` queries every written key once and shows each answer right after
its query, so a model that never links a key to its value can still rule out
the values already answered. `no_retrieval_accuracy` is the exact expected
accuracy of the best such predictor; `no_retrieval_score` the same predictor's
expected accuracy on a given batch. These tests tie both to the generator and
tie chapter 9's stored no-retrieval levels (the recall sweep's and the first, small
sweep's) to them, so that a level cannot drift from the task it is drawn for.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fixedstate.recall import (NO_RETRIEVAL_STRATEGIES, MQARBatch, make_mqar, no_retrieval_accuracy, no_retrieval_se,
                               no_retrieval_score, score_mqar)

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "chapters" / "09_training.ipynb"
SWEEP = json.loads((ROOT / "results" / "mqar_sweep.json").read_text())["settings"]
RECALL = json.loads((ROOT / "results" / "mqar_recall.json").read_text())["settings"]
GLUE_MIME = "application/papermill.record/text/plain"


def sweep_test_set(n_pairs):
    """The sweep's held-out test set, drawn as `fixedstate.training.train` draws it."""
    return make_mqar(SWEEP["n_test"], SWEEP["vocab_size"], n_pairs, SWEEP["seq_len"],
                     rng=np.random.default_rng((12345, n_pairs)))


def glued(name):
    """The value chapter 9 stored under a glued name."""
    for cell in json.loads(CHAPTER.read_text())["cells"]:
        for out in cell.get("outputs", []):
            if out.get("metadata", {}).get("scrapbook", {}).get("name") == name:
                return float(out["data"][GLUE_MIME])
    raise AssertionError(f"chapter 9 glues no value named {name}")


def brute_force(n_values, n_pairs, n_queries):
    """Expected accuracy of the most-frequent-remaining predictor, by enumerating every draw.

    Every tuple of values (uniform, independent) and every ordered choice of queried
    pairs (uniform) is equally likely under make_mqar; ties are averaged over.
    """
    total, count = 0.0, 0
    for values in itertools.product(range(n_values), repeat=n_pairs):
        for order in itertools.permutations(range(n_pairs), n_queries):
            remaining = Counter(values)
            for i in order:
                top = max(remaining.values())
                tied = [v for v, c in remaining.items() if c == top]
                total += (values[i] in tied) / len(tied) / n_queries
                remaining[values[i]] -= 1
                if remaining[values[i]] == 0:
                    del remaining[values[i]]
            count += 1
    return total / count


def test_the_small_sweeps_levels_in_the_chapter_are_the_predictor_on_its_test_sets():
    levels = [no_retrieval_score(sweep_test_set(n)) for n in SWEEP["n_pairs"]]
    assert glued("small_level_low") == round(min(levels), 2)
    assert glued("small_level_high") == round(max(levels), 2)
    for n, level in zip(SWEEP["n_pairs"], levels):
        # the test set's level is the generator's expectation, up to the test set's sampling
        assert abs(level - no_retrieval_accuracy(SWEEP["vocab_size"], n)) < 0.01


@pytest.mark.parametrize(("seq_len", "n_pairs"), RECALL["lengths"])
def test_the_recall_sweeps_levels_in_the_chapter_are_h_n_over_n_and_the_predictor_on_its_test_sets(seq_len, n_pairs):
    """With distinct values M_r = 1 in eq-tr-no-retrieval: the level is H_N / N, on every test set exactly."""
    harmonic = sum(1 / r for r in range(1, n_pairs + 1)) / n_pairs
    exact = no_retrieval_accuracy(RECALL["vocab_size"], n_pairs, distinct_values=True)
    test = make_mqar(RECALL["n_test"], RECALL["vocab_size"], n_pairs, seq_len, distinct_values=True,
                     rng=np.random.default_rng((RECALL["test_seed"], n_pairs)))
    assert exact == pytest.approx(harmonic, rel=1e-12)
    assert no_retrieval_score(test) == pytest.approx(harmonic, rel=1e-12)
    assert glued(f"rc_noret_{seq_len}") == round(harmonic, 3)


@pytest.mark.parametrize(("n_values", "n_pairs", "n_queries"), [(1, 1, 1), (2, 2, 2), (2, 2, 1), (3, 3, 3),
                                                                (3, 3, 2), (3, 2, 2), (4, 4, 4), (4, 3, 2)])
def test_exact_formula_equals_enumeration_of_every_draw(n_values, n_pairs, n_queries):
    vocab = 2 * n_values + 1                   # make_mqar's split: n_values keys, n_values values
    assert no_retrieval_accuracy(vocab, n_pairs, n_queries=n_queries) == pytest.approx(
        brute_force(n_values, n_pairs, n_queries), rel=1e-12)


def test_exact_formula_agrees_with_a_simulation_of_make_mqar():
    vocab, n_pairs = 32, 8
    scores = [no_retrieval_score(make_mqar(100, vocab, n_pairs, 32, rng=np.random.default_rng((7, s))))
              for s in range(40)]
    mean, se = np.mean(scores), np.std(scores, ddof=1) / np.sqrt(len(scores))
    assert 0 < se < 0.01
    assert abs(mean - no_retrieval_accuracy(vocab, n_pairs)) < 4 * se


def test_closed_forms():
    # one pair: the only value left is the answer
    assert no_retrieval_accuracy(3, 1) == 1.0
    # every value distinct (many values): 1 / (number left), averaged over the queries
    assert no_retrieval_accuracy(2 ** 20 + 1, 3) == pytest.approx((1 / 3 + 1 / 2 + 1) / 3, abs=1e-5)
    # two value tokens, two pairs: the first query is right with probability 1/2 * 1 (both values the
    # same) + 1/2 * 1/2 (a tie of two), the second always
    assert no_retrieval_accuracy(5, 2) == pytest.approx((0.75 + 1) / 2, rel=1e-13)
    # two pairs over values drawn from V: first query right with prob (1 + 1/V) / 2, the second always
    v = 16
    assert no_retrieval_accuracy(2 * v, 2) == pytest.approx(((1 + 1 / v) / 2 + 1) / 2, rel=1e-13)


@pytest.mark.parametrize("n_pairs", SWEEP["n_pairs"])
def test_ruling_out_answered_values_beats_guessing_and_most_frequent_is_best(n_pairs):
    batch = sweep_test_set(n_pairs)
    best, uniform_rest, uniform_context = (no_retrieval_score(batch, strategy=s) for s in NO_RETRIEVAL_STRATEGIES)
    chance = 1 / batch.value_tokens.size
    assert chance < uniform_context < uniform_rest < best < 1


def test_a_model_that_retrieves_scores_one_and_the_level_is_far_below():
    batch = sweep_test_set(8)
    predictions = np.full(batch.tokens.shape, -1)
    for b, t in zip(*np.nonzero(batch.targets >= 0)):
        context = list(batch.tokens[b, 0:2 * batch.n_pairs])
        predictions[b, t] = context[context.index(batch.tokens[b, t]) + 1]     # the value after its key
    assert score_mqar(predictions, batch.targets) == 1.0
    assert no_retrieval_score(batch) < 0.5


def test_score_averages_ties_instead_of_drawing_them():
    # one sequence, two pairs with distinct values: the first query is a tie of two
    tokens = np.array([[1, 5, 2, 6, 0, 2, 6, 1, 5, 0]])
    targets = np.array([[-1, -1, -1, -1, -1, 6, -1, 5, -1, -1]])
    batch = MQARBatch(tokens, targets, 9, 2, np.arange(1, 5), np.arange(5, 9))
    assert no_retrieval_score(batch) == 0.75
    assert no_retrieval_score(batch, strategy="uniform_context") == 0.5


@pytest.mark.parametrize("strategy", NO_RETRIEVAL_STRATEGIES)
def test_per_query_probabilities_average_to_the_score(strategy):
    batch = sweep_test_set(8)
    hits = no_retrieval_score(batch, strategy=strategy, per_query=True)
    assert hits.shape == batch.targets.shape
    assert np.array_equal(np.isnan(hits), batch.targets < 0)
    assert np.all((hits[~np.isnan(hits)] >= 0) & (hits[~np.isnan(hits)] <= 1))
    assert np.nanmean(hits) == pytest.approx(no_retrieval_score(batch, strategy=strategy), rel=1e-12)
    if strategy == "most_frequent":             # every key is queried: the last answer is the one value left
        last = [row[~np.isnan(row)][-1] for row in hits]
        assert np.all(np.array(last) == 1.0)


def test_per_query_probabilities_give_the_spread_of_a_predictor_that_draws_its_ties():
    # a predictor that names one of the most frequent remaining values, drawn at random, scored
    # many times on one small batch: its score's mean and spread follow from the probabilities
    batch = make_mqar(16, 32, 8, 32, rng=np.random.default_rng(3))
    hits = no_retrieval_score(batch, per_query=True)
    q = hits[~np.isnan(hits)]
    # which values tie for most frequent before each query depends on the answers, not on the guesses:
    # each query's tie is fixed, and every run draws one of its values; all runs are drawn at once
    runs = 3000
    rng = np.random.default_rng(0)
    right = np.zeros(runs)
    for row, target in zip(batch.tokens, batch.targets):
        remaining = Counter(int(v) for v in row[1:16:2])
        for t in np.nonzero(target >= 0)[0]:
            top = max(remaining.values())
            tied = np.array(sorted(v for v, c in remaining.items() if c == top))
            right += tied[rng.integers(0, tied.size, size=runs)] == target[t]
            remaining[int(target[t])] -= 1
            remaining += Counter()          # drop the values used up
    scores = right / q.size
    spread = np.sqrt(np.sum(q * (1 - q))) / q.size
    assert abs(np.mean(scores) - q.mean()) < 4 * spread / np.sqrt(len(scores))
    assert np.std(scores, ddof=1) == pytest.approx(spread, rel=0.06)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="vocab_size"):
        no_retrieval_accuracy(2, 1)
    with pytest.raises(ValueError, match="n_pairs"):
        no_retrieval_accuracy(32, 0)
    with pytest.raises(ValueError, match="n_pairs"):
        no_retrieval_accuracy(32, 16)
    with pytest.raises(ValueError, match="n_queries"):
        no_retrieval_accuracy(32, 4, n_queries=5)
    with pytest.raises(ValueError, match="batch"):
        no_retrieval_score(np.zeros((2, 4), dtype=int))
    with pytest.raises(ValueError, match="strategy"):
        no_retrieval_score(sweep_test_set(4), strategy="oracle")
    with pytest.raises(ValueError, match="per_query"):
        no_retrieval_score(sweep_test_set(4), per_query="yes")
    empty = dataclasses.replace(sweep_test_set(4), targets=np.full((SWEEP["n_test"], SWEEP["seq_len"]), -1))
    with pytest.raises(ValueError, match="batch"):
        no_retrieval_score(empty)


def test_standard_error_of_identical_sequences_is_the_spread_of_the_ties_alone():
    # every sequence the same: the sequences add no variance, and the standard error is the spread of a
    # predictor that draws its ties, as the previous test measures it, over all the batch's queries
    one = make_mqar(1, 32, 8, 32, rng=np.random.default_rng(5))
    batch = dataclasses.replace(one, tokens=np.repeat(one.tokens, 6, axis=0), targets=np.repeat(one.targets, 6, axis=0))
    q = no_retrieval_score(batch, per_query=True)
    q = q[~np.isnan(q)]
    assert no_retrieval_se(batch) == pytest.approx(np.sqrt(np.sum(q * (1 - q))) / q.size, rel=1e-12)


def test_standard_error_falls_as_the_batch_grows_and_needs_two_sequences():
    small = no_retrieval_se(make_mqar(16, 32, 8, 64, rng=np.random.default_rng(6)))
    large = no_retrieval_se(make_mqar(256, 32, 8, 64, rng=np.random.default_rng(6)))
    assert 2.5 < small / large < 6.5                 # about sqrt(16) = 4
    with pytest.raises(ValueError, match="batch: expected at least two sequences"):
        no_retrieval_se(make_mqar(1, 32, 8, 32, rng=np.random.default_rng(5)))


# ----------------------------------------------------------------------------- Zoology's draw: distinct values

def test_distinct_values_draws_each_sequences_values_without_repeats_and_keeps_the_default_draw():
    batch = make_mqar(50, 40, 12, 60, rng=3, distinct_values=True)
    for row in batch.tokens:
        values = row[1:24:2]
        assert len(set(values.tolist())) == 12 and np.all(np.isin(values, batch.value_tokens))
    plain = make_mqar(20, 40, 12, 60, rng=5)
    again = make_mqar(20, 40, 12, 60, rng=5, distinct_values=False)
    np.testing.assert_array_equal(plain.tokens, again.tokens)
    with pytest.raises(ValueError, match="distinct_values"):
        make_mqar(2, 20, 4, 40, distinct_values=1)


@pytest.mark.parametrize("n_pairs, n_queries", [(1, None), (8, None), (32, None), (32, 16)])
def test_the_baseline_with_distinct_values_is_the_harmonic_sum_and_the_batches_own(n_pairs, n_queries):
    m = n_pairs if n_queries is None else n_queries
    exact = no_retrieval_accuracy(128, n_pairs, n_queries=n_queries, distinct_values=True)
    assert abs(exact - sum(1 / (n_pairs - j) for j in range(m)) / m) < 1e-15
    batch = make_mqar(40, 128, n_pairs, 4 * n_pairs + 4, n_queries=n_queries, rng=1, distinct_values=True)
    # with distinct values every sequence scores the same: the batch's exact score is the expectation
    assert abs(no_retrieval_score(batch) - exact) < 1e-12
