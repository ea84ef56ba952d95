"""Fit a `CostModel` in seconds to measured step times of packs (issue 13, calibration).

A pack of sequences ``s`` is timed (forward + backward); its time is modelled as::

    seconds ≈ per_pack + linear * sum(s) + quadratic * sum(s**2) [+ per_sequence * len(s)]

`fit_cost_model` solves this by non-negative least squares and returns a `CostFit`: the `CostModel`
(without the intercept: every rank pays ``per_pack`` once per pack, so it does not change which rank
is slowest when ranks take equal pack counts), the intercept, R², the residuals and the measurements.
Numpy only; the timing itself lives in `tightpack.runtime.calibration`, the cost model in
`tightpack.core.cost_model`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from tightpack.core.cost_model import CostModel
from tightpack.errors import TightpackError

__all__ = ["CostFit", "fit_cost_model"]

_FORMAT = "tightpack-cost-fit/1"
"""The ``format`` key of `CostFit.to_dict`."""

_RANK_TOLERANCE = 1e-9
"""Singular values of the column-scaled design below this fraction of the largest count as zero."""


@dataclass(frozen=True)
class CostFit:
    """A cost model fitted to measured pack times, with the statistics of the fit.

    Attributes:
        model: the fitted `CostModel` (``unit`` as given to `fit_cost_model`, "seconds" by default).
        per_pack: the fitted intercept, seconds per pack, ``>= 0``: a constant each pack costs whatever
            its composition, so it is reported but not part of ``model``.
        r2: coefficient of determination, ``1 - SS_res / SS_tot`` (1.0 when every time is equal and
            fitted exactly).
        relative_rmse: root mean square of the residuals over the mean measured time.
        sum_lengths: float64 ``[m]``, ``sum(s)`` of each measured pack (tokens).
        sum_squares: float64 ``[m]``, ``sum(s**2)`` of each measured pack (tokens²).
        num_sequences: float64 ``[m]``, ``len(s)`` of each measured pack.
        seconds: float64 ``[m]``, the measured time of each pack.
        residuals: float64 ``[m]``, measured minus predicted seconds.
        labels: ``m`` descriptions of the packs (e.g. ``"512 = 4 x 128"``), or empty.
    """

    model: CostModel
    per_pack: float
    r2: float
    relative_rmse: float
    sum_lengths: np.ndarray
    sum_squares: np.ndarray
    num_sequences: np.ndarray
    seconds: np.ndarray
    residuals: np.ndarray
    labels: tuple[str, ...] = field(default=())

    @property
    def predicted(self) -> np.ndarray:
        """float64 ``[m]``: the fitted time of each measured pack, intercept included."""
        return self.seconds - self.residuals

    def to_dict(self) -> dict:
        """The JSON form: ``format``, ``cost_model`` (`CostModel.to_dict`), ``per_pack``, ``r2``,
        ``relative_rmse`` and ``measurements`` (one object per measured pack)."""
        rows = []
        for i in range(len(self.seconds)):
            row = {
                "sum_lengths": float(self.sum_lengths[i]),
                "sum_squares": float(self.sum_squares[i]),
                "num_sequences": float(self.num_sequences[i]),
                "seconds": float(self.seconds[i]),
                "predicted": float(self.predicted[i]),
                "residual": float(self.residuals[i]),
            }
            if self.labels:
                row = {"label": self.labels[i], **row}
            rows.append(row)
        return {
            "format": _FORMAT,
            "cost_model": self.model.to_dict(),
            "per_pack": self.per_pack,
            "r2": self.r2,
            "relative_rmse": self.relative_rmse,
            "measurements": rows,
        }


def fit_cost_model(
    sum_lengths: ArrayLike,
    sum_squares: ArrayLike,
    num_sequences: ArrayLike,
    seconds: ArrayLike,
    *,
    per_sequence: bool = True,
    unit: str = "seconds",
    labels: Sequence[str] | None = None,
) -> CostFit:
    """Fit ``seconds ≈ per_pack + linear·Σs + quadratic·Σs² (+ per_sequence·n)`` with all terms ``>= 0``.

    Non-negative least squares, solved exactly: with at most four unknowns every subset of active
    columns is solved by ordinary least squares on column-scaled data (``Σs²`` is ~1e3-1e6 times
    ``Σs``), and the best solution whose coefficients are all ``>= 0`` wins. A coefficient that
    would be negative is thereby clamped to 0 and the others refitted.

    Args:
        sum_lengths: ``[m]``, ``Σs`` of each measured pack (tokens).
        sum_squares: ``[m]``, ``Σs²`` of each measured pack (tokens²).
        num_sequences: ``[m]``, the number of sequences ``n`` of each pack.
        seconds: ``[m]``, the measured time of each pack (e.g. the median of several runs).
        per_sequence: fit the per-sequence term; ``False`` fixes it at 0.
        unit: the ``unit`` of the returned `CostModel`.
        labels: optional ``m`` strings describing the packs, kept in the result.

    Raises:
        TightpackError: arrays of different lengths or not 1-D; fewer measurements than unknowns + 1;
            a non-finite or negative value; a design that cannot separate the terms (the message says
            which packs to add); or timings that no term explains (all coefficients fitted to 0).

    Three terms, times generated exactly from ``0.5 + 2·Σs + 0.01·Σs²``:

    >>> sums = np.array([256, 256, 256, 512, 512, 512])
    >>> counts = np.array([1, 4, 16, 1, 4, 16])
    >>> squares = sums**2 / counts
    >>> fit = fit_cost_model(sums, squares, counts, 0.5 + 2 * sums + 0.01 * squares)
    >>> round(fit.model.linear, 9), round(fit.model.quadratic, 9), round(fit.per_pack, 9), fit.r2
    (2.0, 0.01, 0.5, 1.0)
    """
    columns = {
        "sum_lengths": sum_lengths,
        "sum_squares": sum_squares,
        "num_sequences": num_sequences,
        "seconds": seconds,
    }
    arrays = {name: _as_measurements(name, values) for name, values in columns.items()}
    sizes = {name: len(array) for name, array in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise TightpackError(f"the measurement arrays must have one length each; got {sizes}")
    count = sizes["seconds"]
    labels = () if labels is None else tuple(str(label) for label in labels)
    if labels and len(labels) != count:
        raise TightpackError(f"labels has {len(labels)} entries for {count} measurements")

    names = ["per_pack", "linear", "quadratic"] + (["per_sequence"] if per_sequence else [])
    design = np.column_stack(
        [np.ones(count), arrays["sum_lengths"], arrays["sum_squares"]]
        + ([arrays["num_sequences"]] if per_sequence else [])
    )
    if count < len(names) + 1:
        raise TightpackError(
            f"{count} measurements cannot fit {len(names)} unknowns ({', '.join(names)}); measure at least "
            f"{len(names) + 1} packs of different compositions"
        )
    _check_separable(design, names)

    target = arrays["seconds"]
    coefficients = _nonnegative_least_squares(design, target)
    if not coefficients[1:].any():
        raise TightpackError(
            "every cost coefficient was fitted to 0: the measured times do not grow with pack length or "
            "composition; measure wider packs (e.g. pack_widths 512,1024,2048), more repeats, or a "
            "larger model",
            parameters=("pack_widths",),
        )
    residuals = target - design @ coefficients
    squared_residuals = float(residuals @ residuals)
    spread = float(((target - target.mean()) ** 2).sum())
    if spread > 0:
        r2 = 1.0 - squared_residuals / spread
    else:
        r2 = 1.0 if squared_residuals == 0 else 0.0
    mean_time = float(target.mean())
    relative_rmse = float(np.sqrt(squared_residuals / count) / mean_time) if mean_time > 0 else 0.0
    fitted = dict(zip(names, (float(c) for c in coefficients), strict=True))
    model = CostModel(
        linear=fitted["linear"],
        quadratic=fitted["quadratic"],
        per_sequence=fitted.get("per_sequence", 0.0),
        unit=unit,
    )
    return CostFit(
        model=model,
        per_pack=fitted["per_pack"],
        r2=r2,
        relative_rmse=relative_rmse,
        sum_lengths=arrays["sum_lengths"],
        sum_squares=arrays["sum_squares"],
        num_sequences=arrays["num_sequences"],
        seconds=target,
        residuals=residuals,
        labels=labels,
    )


def _as_measurements(name: str, values) -> np.ndarray:
    """``values`` as a fresh float64 ``[m]`` array, checked 1-D, finite and non-negative."""
    try:
        array = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise TightpackError(f"{name} must be numbers, got {type(values).__name__}") from None
    if array.ndim != 1:
        raise TightpackError(f"{name} must be one-dimensional, got shape {array.shape}")
    if not np.isfinite(array).all():
        position = int(np.flatnonzero(~np.isfinite(array))[0])
        raise TightpackError(f"{name} must be finite; measurement {position} is {array[position]}")
    if len(array) and array.min() < 0:
        position = int(np.argmin(array))
        raise TightpackError(f"{name} must be non-negative; measurement {position} is {array[position]}")
    return array


def _check_separable(design: np.ndarray, names: list[str]) -> None:
    """Raise `TightpackError` unless the columns of ``design`` ``[m, k]`` are linearly independent.

    The message names the missing variation: pack widths (Σs), compositions at one width (Σs² / Σs),
    or sequence counts (n) that do not simply follow Σs².
    """
    scaled = design / np.abs(design).max(axis=0).clip(min=np.finfo(np.float64).tiny)
    singular = np.linalg.svd(scaled, compute_uv=False)
    if singular[-1] > _RANK_TOLERANCE * singular[0]:
        return
    sums, squares = design[:, 1], design[:, 2]
    advice = []
    if np.ptp(sums) == 0:
        advice.append("every pack has the same Σs: time several pack widths (e.g. 256, 512, 1024)")
    ratios = squares / np.where(sums > 0, sums, 1.0)
    if np.ptp(ratios) <= 1e-12 * max(float(ratios.max()), 1.0):
        advice.append(
            "every pack has the same Σs²/Σs ratio: at each width time several compositions, from one "
            "sequence filling the pack to many short ones (W = 1 x W, 4 x W/4, 16 x W/16)"
        )
    if not advice and "per_sequence" in names:
        advice.append(
            "the sequence count follows Σs and Σs²: add mixed packs (one long sequence plus many short "
            "ones) or fit without the per-sequence term"
        )
    if not advice:
        advice.append("add packs of other widths and compositions")
    raise TightpackError(
        f"the measurements cannot separate the terms {', '.join(names)}: " + "; ".join(advice)
    )


def _nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Exact NNLS of ``design`` ``[m, k]`` (k <= 4) against ``target`` ``[m]``: float64 ``[k]``, ``>= 0``.

    The NNLS optimum is the ordinary least squares fit on its own support; so the best fit with
    non-negative coefficients over all ``2**k - 1`` supports is the optimum.
    """
    scale = np.abs(design).max(axis=0).clip(min=np.finfo(np.float64).tiny)
    scaled = design / scale
    columns = design.shape[1]
    best = np.zeros(columns)
    best_error = float(target @ target)
    for size in range(1, columns + 1):
        for support in itertools.combinations(range(columns), size):
            chosen = list(support)
            solution, *_ = np.linalg.lstsq(scaled[:, chosen], target, rcond=None)
            if (solution < 0).any():
                continue
            residual = target - scaled[:, chosen] @ solution
            error = float(residual @ residual)
            if error < best_error * (1 - 1e-12):
                best_error = error
                best = np.zeros(columns)
                best[chosen] = solution
    return best / scale
