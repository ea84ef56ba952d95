"""Alignment arithmetic: the multiple derived from TP/CP/SP, the length cap, and aligned lengths.

Expected values are derived by hand from the formula of contract section 2.4:
``m = lcm(2*cp if cp > 1 else 1, cp*tp if sp and tp > 1 else 1)``, and for a stored length ``s``
(runtime ``r = s - 1``) with cap ``L``: ``target = min(floor(L/m)*m, ceil(r, m))``, stored ``target + 1``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tightpack.core.alignment import aligned_lengths, alignment_multiple, ceil_to_multiple, length_cap
from tightpack.errors import TightpackError


class TestAlignmentMultiple:
    @pytest.mark.parametrize(
        ("tp", "cp", "sp", "expected"),
        [
            # The four rows of the issue.
            (1, 1, False, 1),
            (4, 1, True, 4),
            (1, 2, False, 4),
            (2, 2, True, 4),
            # Without SP, TP does not split the token dimension: lcm(1, 1) = 1.
            (4, 1, False, 1),
            (8, 1, False, 1),
            # SP with TP1 changes nothing: the second term needs tp > 1.
            (1, 1, True, 1),
            # CP alone: 2*cp chunks.
            (1, 3, False, 6),
            (1, 4, False, 8),
            # CP with TP but no SP: only the CP term, lcm(4, 1).
            (4, 2, False, 4),
            # CP4/TP2/SP: lcm(8, 8) = 8.
            (2, 4, True, 8),
            # TP3/CP2/SP: lcm(4, 6) = 12 (neither term divides the other).
            (3, 2, True, 12),
            # TP4/CP2/SP: lcm(4, 8) = 8.
            (4, 2, True, 8),
            # TP8/SP: lcm(1, 8) = 8.
            (8, 1, True, 8),
            # TP3/CP3/SP: lcm(6, 9) = 18.
            (3, 3, True, 18),
        ],
    )
    def test_formula_table(self, tp, cp, sp, expected):
        assert alignment_multiple(tp=tp, cp=cp, sp=sp) == expected

    def test_defaults_mean_no_alignment(self):
        assert alignment_multiple() == 1

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"tp": 0}, r"tp must be a positive integer, got 0"),
            ({"tp": -2}, r"tp must be a positive integer, got -2"),
            ({"cp": 0}, r"cp must be a positive integer, got 0"),
            ({"cp": -1, "tp": 2, "sp": True}, r"cp must be a positive integer, got -1"),
        ],
    )
    def test_invalid_parallel_sizes(self, kwargs, message):
        with pytest.raises(TightpackError, match=message):
            alignment_multiple(**kwargs)

    def test_arguments_are_keyword_only(self):
        with pytest.raises(TypeError, match="positional argument"):
            alignment_multiple(2, 2)  # type: ignore[misc]


class TestCeilToMultiple:
    @pytest.mark.parametrize(
        ("value", "multiple", "expected"),
        [(0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (7, 1, 7), (12, 12, 12), (13, 12, 24)],
    )
    def test_scalars(self, value, multiple, expected):
        assert ceil_to_multiple(value, multiple) == expected

    def test_arrays(self):
        result = ceil_to_multiple(np.array([0, 1, 7, 8, 9, 16], dtype=np.int64), 8)
        assert result.tolist() == [0, 8, 8, 8, 16, 16]


class TestLengthCap:
    @pytest.mark.parametrize(
        ("max_length", "multiple", "expected"),
        [
            (4096, 1, 4096),
            (16, 8, 16),  # exact multiple: unchanged
            (17, 8, 16),  # one above: rounded down
            (23, 8, 16),  # one below the next multiple
            (24, 8, 24),
            (8, 8, 8),  # boundary: max_length == m is the smallest allowed
            (100, 12, 96),
            (1, 1, 1),
        ],
    )
    def test_floor_to_multiple(self, max_length, multiple, expected):
        assert length_cap(max_length, multiple) == expected

    @pytest.mark.parametrize(("max_length", "multiple"), [(7, 8), (1, 2), (0, 1), (15, 16)])
    def test_max_length_below_the_multiple(self, max_length, multiple):
        with pytest.raises(
            TightpackError,
            match=rf"max_seq_length \({max_length}\) must be at least the effective padding multiple "
            rf"\({multiple}\)",
        ):
            length_cap(max_length, multiple)

    @pytest.mark.parametrize("multiple", [0, -4])
    def test_invalid_multiple(self, multiple):
        with pytest.raises(
            TightpackError, match=rf"pad_seq_to_mult must be a positive integer, got {multiple}"
        ):
            length_cap(64, multiple)


def stored_after_alignment(stored: list[int], max_length: int, multiple: int) -> list[int]:
    """Stored lengths after pre-padding/capping, through the library: runtime = stored - 1."""
    runtime = np.array(stored, dtype=np.int64) - 1
    cap = length_cap(max_length, multiple)
    return (aligned_lengths(runtime, multiple, cap) + 1).tolist()


class TestAlignedLengths:
    def test_megatron_bridge_contract_cap_16(self):
        # L=16, m=8: runtime 15, 16, 19, 20; ceil to 8 gives 16, 16, 24, 24; capped at 16 -> stored 17.
        assert stored_after_alignment([16, 17, 20, 21], max_length=16, multiple=8) == [17, 17, 17, 17]

    def test_megatron_bridge_contract_cap_32(self):
        # L=32, m=8: stored 17 -> r 16 (a multiple) -> stays 17; stored 18 -> r 17 -> 24 -> stored 25.
        assert stored_after_alignment([17, 18], max_length=32, multiple=8) == [17, 25]

    def test_cap_reached_exactly_and_exceeded(self):
        # L=32, m=8: r=25..32 ceil to 32; r=33 would ceil to 40 but is capped at 32.
        assert stored_after_alignment([26, 33, 34, 100], max_length=32, multiple=8) == [33, 33, 33, 33]

    def test_cap_not_a_multiple_of_m_is_floored(self):
        # L=20, m=8: cap 16, so r=17 (which would ceil to 24) becomes 16.
        assert stored_after_alignment([18], max_length=20, multiple=8) == [17]

    @pytest.mark.parametrize("multiple", [1, 4, 8])
    def test_exact_multiples_are_unchanged(self, multiple):
        runtime = np.arange(0, 65, multiple, dtype=np.int64)
        np.testing.assert_array_equal(aligned_lengths(runtime, multiple, 64), runtime)

    def test_multiple_one_only_caps(self):
        runtime = np.array([0, 1, 5, 63, 64, 65, 1000])
        assert aligned_lengths(runtime, 1, 64).tolist() == [0, 1, 5, 63, 64, 64, 64]

    def test_zero_length_stays_zero(self):
        assert aligned_lengths(np.array([0]), 8, 16).tolist() == [0]

    def test_one_above_and_one_below_a_multiple(self):
        assert aligned_lengths(np.array([7, 8, 9, 15, 16, 17]), 8, 64).tolist() == [8, 8, 16, 16, 16, 24]

    def test_empty_input(self):
        result = aligned_lengths(np.array([], dtype=np.int64), 4, 16)
        assert result.shape == (0,)

    def test_accepts_lists_and_returns_int64(self):
        result = aligned_lengths([3, 9], 4, 16)
        assert result.dtype == np.int64
        assert result.tolist() == [4, 12]

    def test_input_is_not_modified(self):
        runtime = np.array([3, 9, 30], dtype=np.int64)
        aligned_lengths(runtime, 4, 16)
        assert runtime.tolist() == [3, 9, 30]

    @given(
        runtime=st.lists(st.integers(min_value=0, max_value=10_000), max_size=50),
        multiple=st.integers(min_value=1, max_value=64),
        max_length=st.integers(min_value=1, max_value=5_000),
    )
    def test_properties(self, runtime, multiple, max_length):
        if max_length < multiple:
            with pytest.raises(TightpackError, match="must be at least the effective padding multiple"):
                length_cap(max_length, multiple)
            return
        cap = length_cap(max_length, multiple)
        assert cap % multiple == 0 and max_length - multiple < cap <= max_length
        r = np.array(runtime, dtype=np.int64)
        target = aligned_lengths(r, multiple, cap)
        assert target.shape == r.shape
        wanted = np.minimum(r, cap)
        assert (target % multiple == 0).all(), "every target is a multiple of m"
        assert (target <= cap).all(), "no target above the cap"
        assert (target >= wanted).all(), "short samples are padded, never cut"
        assert (target - wanted < multiple).all(), "less than one multiple of padding"
