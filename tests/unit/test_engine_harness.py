"""The e2e output comparison (``hybridkv.cli.harness.llm_engine.matches``) on constructed logprobs.

Every e2e correctness check and every planted-fault control rests on this decision, so
its rule is pinned here without an engine: agree within the tolerance on every top-k
logprob both runs list up to the first differing token; excuse that token only as a
near-tie seen from BOTH runs; compare nothing after it.
"""

from __future__ import annotations

import math

from hybridkv.cli.harness.llm_engine import LOGPROB_TOL, TOP_LOGPROBS, Completion, compare, matches


def _c(tokens: list[int], tops: list[dict[int, float]]) -> Completion:
    """A completion whose chosen token at each position is ``tokens[i]`` with ``tops[i]``."""
    return Completion(tokens, [t[tok] for tok, t in zip(tokens, tops)], 0, tops)


BASE = [{5: -0.5, 6: -1.5, 7: -2.0}, {8: -0.2, 9: -2.5}, {10: -0.1, 11: -3.0}]


def test_identical_outputs_match() -> None:
    assert matches(_c([5, 8, 10], BASE), _c([5, 8, 10], BASE))


def test_small_bf16_noise_matches_and_noise_beyond_the_tolerance_does_not() -> None:
    noisy = [{k: v + LOGPROB_TOL / 2 for k, v in t.items()} for t in BASE]
    assert matches(_c([5, 8, 10], BASE), _c([5, 8, 10], noisy))
    off = [dict(t) for t in BASE]
    off[1][8] += 2 * LOGPROB_TOL  # the chosen token's logprob
    assert not matches(_c([5, 8, 10], BASE), _c([5, 8, 10], off))


def test_a_runner_up_moving_beyond_the_tolerance_fails_even_with_equal_tokens() -> None:
    """Wrong KV can keep the argmax and still move the distribution: the top-k sees it."""
    off = [dict(t) for t in BASE]
    off[0][7] -= 3 * LOGPROB_TOL
    assert not matches(_c([5, 8, 10], BASE), _c([5, 8, 10], off))


def test_a_near_tie_seen_by_both_runs_excuses_the_flip_and_later_tokens_are_not_compared() -> None:
    served = [{5: -0.69, 6: -0.70}, {8: -0.2}, {10: -0.1}]
    recompute = [{6: -0.69, 5: -0.70}, {99: -0.01}, {98: -5.0}]  # later positions unrelated
    assert matches(_c([5, 8, 10], served), _c([6, 99, 98], recompute))
    result = compare(_c([5, 8, 10], served), _c([6, 99, 98], recompute))
    assert result.tie_at == 0


def test_a_tie_seen_from_one_side_only_fails() -> None:
    """The served run lists the recompute's token as a close runner-up, but the
    recompute does not list the served token at all (or far below its choice)."""
    served = [{5: -0.69, 6: -0.70}]
    recompute_missing = [{6: -0.1, 7: -3.0}]
    recompute_far = [{6: -0.1, 5: -0.1 - 5 * LOGPROB_TOL}]
    assert not matches(_c([5], served), _c([6], recompute_missing))
    assert not matches(_c([5], served), _c([6], recompute_far))
    assert not matches(_c([6], recompute_far), _c([5], served))


def test_a_flip_with_a_clear_gap_fails() -> None:
    served = [{5: -0.1, 6: -0.1 - 3 * LOGPROB_TOL}]
    recompute = [{6: -0.1, 5: -0.1 - 3 * LOGPROB_TOL}]
    assert not matches(_c([5], served), _c([6], recompute))


def test_a_divergence_after_agreeing_positions_is_judged_at_that_position() -> None:
    served = BASE[:1] + [{8: -0.69, 9: -0.70}]
    recompute = BASE[:1] + [{9: -0.69, 8: -0.70}]
    assert compare(_c([5, 8], served), _c([5, 9], recompute)).tie_at == 1
    bad = BASE[:1] + [{9: -0.1, 8: -2.0}]
    assert not matches(_c([5, 8], served), _c([5, 9], bad))


def test_garbage_kv_nan_and_different_lengths_fail() -> None:
    nan = [{5: math.nan, 6: -1.5, 7: -2.0}] + BASE[1:]
    assert not matches(_c([5, 8, 10], BASE), _c([5, 8, 10], nan))
    assert not matches(_c([5, 8, 10], BASE), _c([5, 8], BASE[:2]))


def test_without_top_k_a_flip_can_never_pass_as_a_tie() -> None:
    """Completions from ``logprobs=0`` carry only the chosen token: a flip then fails
    (strict), which is why generate() asks for TOP_LOGPROBS."""
    a = Completion([5], [-0.69], 0)
    b = Completion([6], [-0.69], 0)
    assert not matches(a, b)
    assert TOP_LOGPROBS >= 5
