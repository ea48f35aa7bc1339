"""Quality scorers: the rules every registered scorer keeps, then each one's formula."""

from __future__ import annotations

import itertools

import pytest

from gateway.shadow.scorers import SCORERS, QualityScorer, scorer_problems

TEXTS = [
    "",
    " ",
    "The capital of France is Paris.",
    "the capital of  France is\nParis.",
    "Paris is the capital of France.",
    "Lyon.",
    "東京は日本の首都です。",
    "a " * 500,
]


@pytest.fixture(params=sorted(SCORERS), ids=lambda name: f"scorer {name}")
def scorer(request: pytest.FixtureRequest) -> QualityScorer:
    return SCORERS[request.param]


def test_every_scorer_is_registered_under_its_own_name(scorer: QualityScorer) -> None:
    assert SCORERS[scorer.name] is scorer


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_every_scorer_gives_equal_answers_a_full_score(scorer: QualityScorer, text: str) -> None:
    assert scorer.score(text, text) == 1.0


def test_every_scorer_stays_within_zero_and_one_on_any_pair(scorer: QualityScorer) -> None:
    for primary, shadow in itertools.product(TEXTS, repeat=2):
        assert 0.0 <= scorer.score(primary, shadow) <= 1.0, (primary, shadow)


def test_every_scorer_gives_an_answer_unlike_the_primary_less_than_a_full_score(scorer: QualityScorer) -> None:
    assert scorer.score("The capital of France is Paris.", "Lyon.") < 1.0


@pytest.mark.parametrize(
    ("name", "primary", "shadow", "expected"),
    [
        pytest.param("exact", "Paris is big.", "Paris  is\nbig. ", 1.0, id="exact ignores how whitespace runs"),
        pytest.param("exact", "Paris is big.", "paris is big.", 0.0, id="exact minds the case"),
        pytest.param("exact", "", "   ", 1.0, id="exact sees two blank answers as equal"),
        pytest.param("jaccard", "a b c", "b c d", 0.5, id="jaccard is shared words over all words"),
        pytest.param("jaccard", "A b", "a B b", 1.0, id="jaccard folds case and counts each word once"),
        pytest.param("jaccard", "a b", "c d", 0.0, id="jaccard gives disjoint answers zero"),
        pytest.param("jaccard", "", "", 1.0, id="jaccard gives two empty answers one"),
        pytest.param("jaccard", "", "a", 0.0, id="jaccard gives an empty answer against words zero"),
        pytest.param("length_ratio", "abcd", "ab", 0.5, id="length_ratio is the shorter over the longer"),
        pytest.param("length_ratio", "ab", "abcd", 0.5, id="length_ratio is symmetric"),
        pytest.param("length_ratio", "", "", 1.0, id="length_ratio gives two empty answers one"),
        pytest.param("length_ratio", "", "abc", 0.0, id="length_ratio gives an empty answer against text zero"),
    ],
)
def test_each_scorer_follows_its_formula(name: str, primary: str, shadow: str, expected: float) -> None:
    assert SCORERS[name].score(primary, shadow) == pytest.approx(expected)


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_a_registered_scorer_has_no_problem(name: str) -> None:
    assert scorer_problems(name) == []


def test_an_unknown_scorer_is_a_problem_that_lists_the_known_ones() -> None:
    (problem,) = scorer_problems("bleu")
    assert problem == "unknown scorer 'bleu' (known: exact, jaccard, length_ratio)"
