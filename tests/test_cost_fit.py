"""Tests of `tightpack.core.cost_fit`: exact recovery, noise, non-negativity and every error path."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tightpack.core.cost_fit import CostFit, fit_cost_model
from tightpack.core.cost_model import CostModel
from tightpack.errors import TightpackError


def _design(widths=(256, 512, 1024), counts=(1, 2, 4, 8, 16)):
    """Σs, Σs², n of packs of ``k`` equal sequences per width, plus one mixed pack (W/2 + 8 x W/16)."""
    sums, squares, numbers = [], [], []
    for width in widths:
        for count in counts:
            sums.append(width)
            squares.append(width**2 / count)
            numbers.append(count)
        sums.append(width)
        squares.append((width / 2) ** 2 + 8 * (width / 16) ** 2)
        numbers.append(9)
    return np.array(sums, float), np.array(squares, float), np.array(numbers, float)


def _times(sums, squares, numbers, per_pack=2e-3, linear=5e-5, quadratic=3e-8, per_sequence=4e-4):
    return per_pack + linear * sums + quadratic * squares + per_sequence * numbers


class TestRecovery:
    def test_exact_data_recovers_every_coefficient(self):
        sums, squares, numbers = _design()
        fit = fit_cost_model(sums, squares, numbers, _times(sums, squares, numbers))
        assert isinstance(fit, CostFit)
        assert fit.model.linear == pytest.approx(5e-5, rel=1e-9)
        assert fit.model.quadratic == pytest.approx(3e-8, rel=1e-9)
        assert fit.model.per_sequence == pytest.approx(4e-4, rel=1e-9)
        assert fit.per_pack == pytest.approx(2e-3, rel=1e-9)
        assert fit.model.unit == "seconds"
        assert fit.r2 == pytest.approx(1.0)
        assert fit.relative_rmse == pytest.approx(0.0, abs=1e-9)
        np.testing.assert_allclose(fit.residuals, 0.0, atol=1e-12)
        np.testing.assert_allclose(fit.predicted, fit.seconds)

    def test_without_per_sequence_term(self):
        sums, squares, numbers = _design()
        seconds = _times(sums, squares, numbers, per_sequence=0.0)
        fit = fit_cost_model(sums, squares, numbers, seconds, per_sequence=False, unit="ms")
        assert fit.model.per_sequence == 0.0
        assert fit.model.quadratic == pytest.approx(3e-8, rel=1e-9)
        assert fit.model.unit == "ms"

    def test_noisy_data_fits_worse_than_perfectly(self):
        sums, squares, numbers = _design()
        clean = _times(sums, squares, numbers)
        noisy = clean * np.random.default_rng(7).normal(1.0, 0.05, size=clean.shape)
        fit = fit_cost_model(sums, squares, numbers, noisy)
        assert 0.5 < fit.r2 < 1.0
        assert fit.relative_rmse > 0
        np.testing.assert_allclose(fit.residuals, noisy - fit.predicted)
        assert fit.model.linear >= 0 and fit.model.quadratic >= 0 and fit.model.per_sequence >= 0
        assert fit.per_pack >= 0

    def test_a_coefficient_that_would_be_negative_is_clamped_to_zero(self):
        sums, squares, numbers = _design()
        # Times that fall with the sequence count: ordinary least squares gives per_sequence < 0.
        seconds = _times(sums, squares, numbers, per_sequence=-1e-4)
        unconstrained = np.linalg.lstsq(
            np.column_stack([np.ones_like(sums), sums, squares, numbers]), seconds, rcond=None
        )[0]
        assert unconstrained[3] < 0
        fit = fit_cost_model(sums, squares, numbers, seconds)
        assert fit.model.per_sequence == 0.0
        assert fit.model.linear > 0 and fit.model.quadratic > 0
        assert fit.r2 < 1.0

    def test_the_fitted_model_saves_and_resolves(self, tmp_path):
        sums, squares, numbers = _design()
        fit = fit_cost_model(sums, squares, numbers, _times(sums, squares, numbers))
        path = tmp_path / "model.json"
        fit.model.save(path)
        assert CostModel.resolve(str(path)) == fit.model

    def test_to_dict_is_json(self):
        sums, squares, numbers = _design(widths=(256, 512), counts=(1, 4))
        labels = [f"pack {i}" for i in range(len(sums))]
        fit = fit_cost_model(sums, squares, numbers, _times(sums, squares, numbers), labels=labels)
        data = json.loads(json.dumps(fit.to_dict()))
        assert data["format"] == "tightpack-cost-fit/1"
        assert CostModel.from_dict(data["cost_model"]) == fit.model
        assert len(data["measurements"]) == len(sums)
        assert data["measurements"][0]["label"] == "pack 0"
        assert set(data) >= {"per_pack", "r2", "relative_rmse"}

    def test_inputs_are_not_modified(self):
        sums, squares, numbers = _design()
        seconds = _times(sums, squares, numbers)
        before = seconds.copy()
        fit = fit_cost_model(sums, squares, numbers, seconds)
        fit.seconds[0] = -1.0
        np.testing.assert_array_equal(seconds, before)


class TestErrors:
    def test_too_few_measurements(self):
        with pytest.raises(TightpackError, match="4 measurements cannot fit 4 unknowns"):
            fit_cost_model([1, 2, 3, 4], [1, 4, 9, 16], [1, 1, 1, 2], [1, 2, 3, 4])
        with pytest.raises(TightpackError, match="3 measurements cannot fit 3 unknowns"):
            fit_cost_model([1, 2, 3], [1, 4, 9], [1, 1, 1], [1, 2, 3], per_sequence=False)

    @pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
    def test_non_finite_or_negative_input(self, bad):
        sums, squares, numbers = _design()
        seconds = _times(sums, squares, numbers)
        seconds[3] = bad
        with pytest.raises(TightpackError, match=r"seconds must be .*measurement 3"):
            fit_cost_model(sums, squares, numbers, seconds)

    def test_mismatched_lengths(self):
        with pytest.raises(TightpackError, match="one length each"):
            fit_cost_model([1, 2, 3, 4, 5], [1, 4, 9, 16, 25], [1, 1, 1, 1, 1], [1, 2, 3])

    def test_not_one_dimensional(self):
        with pytest.raises(TightpackError, match="sum_lengths must be one-dimensional"):
            fit_cost_model([[1, 2]], [1, 4], [1, 1], [1, 2])

    def test_labels_must_match(self):
        sums, squares, numbers = _design()
        with pytest.raises(TightpackError, match="labels has 1 entries"):
            fit_cost_model(sums, squares, numbers, _times(sums, squares, numbers), labels=["x"])

    def test_one_composition_per_width_cannot_separate_the_quadratic_term(self):
        sums = np.array([256.0, 512, 1024, 2048, 4096])
        squares = sums**2  # one sequence per pack: Σs²/Σs = Σs, but 16 x W/16 would change it
        numbers = np.ones_like(sums)
        seconds = 1e-3 + 1e-5 * sums + 1e-9 * squares
        fit = fit_cost_model(sums, squares, numbers, seconds, per_sequence=False)  # separable without n
        assert fit.model.quadratic == pytest.approx(1e-9, rel=1e-6)
        with pytest.raises(TightpackError, match="sequence count"):
            fit_cost_model(sums, squares, numbers, seconds)

    def test_same_ratio_everywhere(self):
        sums = np.array([256.0, 256, 512, 512, 1024])
        squares = sums * 64.0  # every pack is W / 64 sequences of 64: the same Σs²/Σs
        numbers = sums / 64.0
        with pytest.raises(TightpackError, match=r"same Σs²/Σs ratio.*16 x W/16"):
            fit_cost_model(sums, squares, numbers, 1e-3 + 1e-5 * sums, per_sequence=False)

    def test_one_width_cannot_separate_the_linear_term(self):
        sums = np.full(6, 512.0)
        counts = np.array([1, 2, 4, 8, 16, 32], float)
        with pytest.raises(TightpackError, match="same Σs: time several pack widths"):
            fit_cost_model(sums, sums**2 / counts, counts, 1e-3 + 1e-8 * sums**2 / counts, per_sequence=False)

    def test_all_coefficients_zero(self):
        sums, squares, numbers = _design()
        with pytest.raises(TightpackError, match="every cost coefficient was fitted to 0"):
            fit_cost_model(sums, squares, numbers, np.full(len(sums), 0.05))
        falling = 0.5 - 1e-4 * sums  # times that shrink as packs grow: only the intercept survives
        with pytest.raises(TightpackError, match="wider packs"):
            fit_cost_model(sums, squares, numbers, falling)
