"""The telemetry bench compares modes round by round: one noisy round must not decide the figure."""

from __future__ import annotations

import pytest

from loadtests.proofs.telemetry_overhead import median_ratio


def test_a_round_hit_by_other_work_does_not_move_the_median() -> None:
    traced = [900.0, 905.0, 300.0, 910.0, 895.0]  # round 3: the traced gateway was starved
    metrics_only = [1000.0, 1000.0, 1000.0, 1000.0, 1000.0]
    assert median_ratio(traced, metrics_only) == pytest.approx(0.9)


def test_rounds_are_paired_so_a_slow_machine_in_both_cancels() -> None:
    traced = [900.0, 450.0, 900.0, 450.0]  # rounds 2 and 4: the whole machine at half speed
    metrics_only = [1000.0, 500.0, 1000.0, 500.0]
    assert median_ratio(traced, metrics_only) == pytest.approx(0.9)


def test_no_rounds_give_no_ratio_and_unpaired_rounds_are_refused() -> None:
    assert median_ratio([], []) == 0.0
    with pytest.raises(ValueError, match="longer"):
        median_ratio([1.0], [1.0, 2.0])
