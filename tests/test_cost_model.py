"""Tests of `tightpack.core.cost_model`: FLOPs against hand counts, pack costs against a Python loop.

Hand count of the tiny model (h=8, L=2, f=16, n=2 heads, g=1 group, V=10, head width 4, q=8), one
token, one layer, forward, each GEMM ``2mkn``:

- Q ``2*8*8 = 128``, K and V ``2*8*4 = 64`` each, output ``2*8*8 = 128``: 384;
- SwiGLU MLP, three ``8x16`` matrices: ``3 * 2*8*16 = 768`` (two matrices: 512);
- logits (once, not per layer): ``2*8*10 = 160``.

Linear, training: ``3 * (2 * (384 + 768) + 160) = 7392``; forward only without SwiGLU:
``2 * (384 + 512) + 160 = 1952``. Attention per sequence, one layer, forward: ``QK^T`` and attention
over values, ``2 heads * 2*s*4*s`` each, ``32 s**2``; causal halves it. Quadratic, training, causal:
``3 * 2 * 16 = 96``; forward only, non-causal: ``2 * 32 = 64``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core.cost_model import COST_MODELS, CostModel, CostSpread, cost_spread
from tightpack.core.planner import ALGORITHMS, PackPlan, plan_packs
from tightpack.errors import TightpackError

from .conftest import examples

TINY = {
    "hidden_size": 8,
    "num_layers": 2,
    "ffn_hidden_size": 16,
    "num_attention_heads": 2,
    "num_query_groups": 1,
    "vocab_size": 10,
}


# --- from_model ------------------------------------------------------------------------------------


class TestFromModel:
    def test_tiny_training_causal_swiglu(self):
        model = CostModel.from_model(**TINY)
        assert (model.linear, model.quadratic, model.per_sequence, model.unit) == (7392.0, 96.0, 0.0, "flops")

    def test_tiny_forward_noncausal_two_matrix_mlp(self):
        model = CostModel.from_model(**TINY, swiglu=False, causal=False, training=False)
        assert (model.linear, model.quadratic) == (1952.0, 64.0)

    def test_multi_head_default_and_kv_channels(self):
        # No GQA: K and V cost as much as Q, 4*8*8*2 = 512 per layer; the hand count with groups = heads.
        mha = CostModel.from_model(**{**TINY, "num_query_groups": None}, training=False, causal=False)
        assert mha.linear == 2 * (512 + 768) + 160
        # kv_channels 8 doubles q (16): projections 4*8*16*1.5 = 768, attention 2*2*16 = 64 per layer.
        wide = CostModel.from_model(**TINY, kv_channels=8, training=False, causal=False)
        assert (wide.linear, wide.quadratic) == (2 * (768 + 768) + 160, 2 * 64)

    def test_training_is_three_forwards(self):
        forward = CostModel.from_model(**TINY, training=False)
        training = CostModel.from_model(**TINY)
        assert (training.linear, training.quadratic) == (3 * forward.linear, 3 * forward.quadratic)

    def test_llama_8b_preset(self):
        model = CostModel.named("llama-8b")
        # Per token about 6 x 7.5e9 non-embedding-lookup parameters.
        assert model.linear == 45_027_950_592.0
        assert model.quadratic == 3 * 32 * 2 * 4096  # 3 passes x L x (4 q / 2 for causal)
        assert model == COST_MODELS["llama-8b"]

    @pytest.mark.parametrize(
        ("change", "match"),
        [
            ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
            ({"num_layers": 2.5}, "num_layers must be a positive integer"),
            ({"num_query_groups": 3, "num_attention_heads": 4}, "num_query_groups=3 must divide"),
            ({"hidden_size": 1, "num_attention_heads": 2, "num_query_groups": 2}, "pass kv_channels"),
        ],
    )
    def test_bad_sizes(self, change, match):
        with pytest.raises(TightpackError, match=match):
            CostModel.from_model(**{**TINY, **change})


# --- crossover -------------------------------------------------------------------------------------


class TestCrossover:
    def test_formula(self):
        model = CostModel(linear=6.0, quadratic=0.5)
        s = model.crossover_length()
        assert s == 12.0
        assert model.quadratic * s**2 == model.linear * s

    def test_tiny_and_llama(self):
        assert CostModel.from_model(**TINY).crossover_length() == 7392 / 96
        assert CostModel.named("llama-8b").crossover_length() == 57256.0
        assert CostModel.named("llama-1b").crossover_length() == 37712.0

    def test_no_quadratic_or_no_linear(self):
        assert CostModel(linear=1.0, quadratic=0.0).crossover_length() == math.inf
        assert CostModel(linear=0.0, quadratic=1.0).crossover_length() == 0.0


# --- validation ------------------------------------------------------------------------------------


class TestValidation:
    @pytest.mark.parametrize(
        ("fields", "match"),
        [
            (
                {"linear": -1.0, "quadratic": 1.0},
                r"CostModel.linear must be finite and non-negative, got -1.0",
            ),
            ({"linear": 1.0, "quadratic": math.nan}, "CostModel.quadratic must be finite"),
            ({"linear": 1.0, "quadratic": 1.0, "per_sequence": -2}, "per_sequence must be finite"),
            ({"linear": 0, "quadratic": 0.0}, "all coefficients zero"),
            ({"linear": "1", "quadratic": 1.0}, "linear must be a number"),
            ({"linear": True, "quadratic": 1.0}, "linear must be a number"),
            ({"linear": 1.0, "quadratic": 1.0, "unit": ""}, "unit must be a non-empty string"),
        ],
    )
    def test_bad_coefficients(self, fields, match):
        with pytest.raises(TightpackError, match=match):
            CostModel(**fields)

    def test_coefficients_become_floats(self):
        model = CostModel(linear=np.int64(2), quadratic=1)
        assert type(model.linear) is float and type(model.quadratic) is float

    @pytest.mark.parametrize(
        ("lengths", "match"),
        [
            ([3, -1], r"non-negative, got -1 at index 1"),
            ([[1, 2]], r"one-dimensional, got shape \(1, 2\)"),
            ([1.0, math.inf], "finite"),
            (["a"], "must be numbers"),
        ],
    )
    def test_bad_lengths(self, lengths, match):
        with pytest.raises(TightpackError, match=match):
            CostModel(linear=1.0, quadratic=1.0).sequence_costs(lengths)


# --- evaluation ------------------------------------------------------------------------------------


def python_pack_costs(model: CostModel, plan: PackPlan, lengths: list[int]) -> list[float]:
    """The slow reference: a loop over packs and their samples, in plan order."""
    costs = []
    for pack in plan:
        total = 0.0
        for sample in pack.tolist():
            s = lengths[sample]
            total += model.linear * s + model.quadratic * s * s + model.per_sequence
        costs.append(total)
    return costs


class TestPackCosts:
    def test_sequence_costs(self):
        model = CostModel(linear=3.0, quadratic=2.0, per_sequence=5.0, unit="seconds")
        costs = model.sequence_costs(np.array([0, 1, 10], dtype=np.int32))
        assert costs.dtype == np.float64
        assert costs.tolist() == [5.0, 10.0, 235.0]
        assert model.sequence_costs([]).shape == (0,)

    @settings(max_examples=examples(100), deadline=None)
    @given(
        lengths=st.lists(st.integers(0, 64), max_size=60),
        algorithm=st.sampled_from(sorted(ALGORITHMS)),
        seed=st.integers(0, 2**16),
        coefficients=st.tuples(st.floats(0, 1e6), st.floats(0, 1e3), st.floats(0, 1e4)),
    )
    def test_matches_python_loop(self, lengths, algorithm, seed, coefficients):
        linear, quadratic, per_sequence = coefficients
        if linear == quadratic == per_sequence == 0:
            linear = 1.0
        model = CostModel(linear=linear, quadratic=quadratic, per_sequence=per_sequence)
        plan = plan_packs(lengths, 64, algorithm=algorithm, seed=seed)
        costs = model.pack_costs(plan, lengths)
        assert costs.dtype == np.float64 and costs.shape == (len(plan),)
        np.testing.assert_allclose(costs, python_pack_costs(model, plan, lengths), rtol=1e-12)
        # Sum over packs equals the sum over samples: every sample is counted once.
        np.testing.assert_allclose(costs.sum(), model.sequence_costs(lengths).sum(), rtol=1e-9)

    @settings(max_examples=examples(100), deadline=None)
    @given(
        sizes=st.lists(st.integers(0, 4), max_size=12),
        data=st.data(),
    )
    def test_empty_packs_and_raw_csr(self, sizes, data):
        """Random CSR with empty packs anywhere (first, last, consecutive): each empty pack costs 0."""
        total = sum(sizes)
        lengths = data.draw(st.lists(st.integers(0, 1000), min_size=total, max_size=total))
        order = np.asarray(data.draw(st.permutations(range(total))), dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        plan = PackPlan(order=order, offsets=offsets)
        model = CostModel(linear=1.5, quadratic=0.25, per_sequence=7.0, unit="seconds")
        expected = python_pack_costs(model, plan, lengths)
        for spec in (plan, (order, offsets)):
            costs = model.pack_costs(spec, lengths)
            np.testing.assert_allclose(costs, expected, rtol=1e-12)
            assert (costs[np.asarray(sizes, dtype=np.int64) == 0] == 0).all()

    def test_empty_plan_and_trailing_empty_pack(self):
        model = CostModel(linear=1.0, quadratic=1.0)
        empty = PackPlan(order=np.zeros(0, np.int64), offsets=np.zeros(1, np.int64))
        assert model.pack_costs(empty, []).shape == (0,)
        plan = PackPlan(order=np.array([0, 1]), offsets=np.array([0, 0, 2, 2, 2]))
        assert model.pack_costs(plan, [2, 3]).tolist() == [0.0, 18.0, 0.0, 0.0]

    def test_long_sample_costs_more_than_many_short(self):
        model = CostModel.named("llama-8b")
        plan = PackPlan(order=np.arange(65), offsets=np.array([0, 1, 65]))
        long, short = model.pack_costs(plan, [8192] + [128] * 64)
        assert long / short == pytest.approx((57256 + 8192) / (57256 + 128))

    @pytest.mark.parametrize(
        ("plan", "lengths", "match"),
        [
            ((np.array([0, 3]), np.array([0, 2])), [1, 2], r"samples 0..3 but lengths has 2 entries"),
            ((np.array([0, 1]), np.array([0, 3])), [1, 2], "end at len\\(order\\)=2"),
            ((np.array([0, 1]), np.array([0, 2, 1, 2])), [1, 2], "never decrease"),
            ((np.array([0.0]), np.array([0, 1])), [1], "order must be integers"),
            ([np.array([0]), np.array([0, 1])], [1], "expected a PackPlan or an \\(order, offsets\\) pair"),
            ((np.array([0]), np.array([0, 1])), [-4], "non-negative"),
        ],
    )
    def test_bad_plans(self, plan, lengths, match):
        with pytest.raises(TightpackError, match=match):
            CostModel(linear=1.0, quadratic=1.0).pack_costs(plan, lengths)


# --- JSON, presets, resolve -------------------------------------------------------------------------


class TestPersistence:
    def test_round_trip_through_file(self, tmp_path):
        model = CostModel(linear=1.25e-6, quadratic=3.5e-11, per_sequence=2e-5, unit="seconds")
        path = tmp_path / "cost.json"
        model.save(path)
        assert json.loads(path.read_text())["unit"] == "seconds"
        assert CostModel.load(path) == model
        assert CostModel.from_dict(model.to_dict()) == model
        assert [p.name for p in tmp_path.iterdir()] == ["cost.json"]  # no temporary left behind

    def test_presets_round_trip(self, tmp_path):
        for name, model in COST_MODELS.items():
            model.save(tmp_path / f"{name}.json")
            assert CostModel.load(tmp_path / f"{name}.json") == model

    @pytest.mark.parametrize(
        ("data", "match"),
        [
            ([1, 2], "expected a JSON object, got list"),
            ({"linear": 1.0, "quadratic": 1.0, "unit": "flops"}, "'format' is None"),
            (
                {"format": "tightpack-cost-model/1", "linear": 1.0, "unit": "flops"},
                r"missing keys \['quadratic'\]",
            ),
            (
                {"format": "tightpack-cost-model/1", "linear": 1.0, "quadratic": 1, "unit": "s", "x": 1},
                r"unknown keys \['x'\]",
            ),
            (
                {"format": "tightpack-cost-model/1", "linear": -1.0, "quadratic": 1, "unit": "s"},
                "non-negative",
            ),
        ],
    )
    def test_from_dict_errors(self, data, match):
        with pytest.raises(TightpackError, match=match):
            CostModel.from_dict(data)


class TestResolve:
    def test_cost_model_is_returned(self):
        model = CostModel(linear=1.0, quadratic=2.0)
        assert CostModel.resolve(model) is model

    def test_preset_names(self):
        assert CostModel.resolve("llama-8b") is COST_MODELS["llama-8b"]
        assert CostModel.resolve("llama-1b") == CostModel.named("llama-1b")

    def test_paths(self, tmp_path):
        model = CostModel(linear=4.0, quadratic=0.0, unit="seconds")
        path = tmp_path / "m.json"
        model.save(path)
        assert CostModel.resolve(path) == model
        assert CostModel.resolve(str(path)) == model

    def test_unknown_name(self):
        with pytest.raises(
            TightpackError, match=r"unknown cost model 'gpt-5'; choose one of llama-1b, llama-8b"
        ):
            CostModel.named("gpt-5")

    def test_neither_preset_nor_file(self, tmp_path):
        with pytest.raises(TightpackError, match=r"neither a preset \(llama-1b, llama-8b\).*no such file"):
            CostModel.resolve("llama-70b")
        with pytest.raises(TightpackError, match="a folder, not a JSON file"):
            CostModel.resolve(tmp_path)

    def test_bad_files(self, tmp_path):
        broken = tmp_path / "broken.json"
        broken.write_text("{not json")
        with pytest.raises(TightpackError, match="is not valid JSON"):
            CostModel.resolve(broken)
        other = tmp_path / "other.json"
        other.write_text(json.dumps({"pack_size": 4096}))
        with pytest.raises(TightpackError, match=r"other.json'.*'format' is None"):
            CostModel.resolve(other)

    def test_wrong_type(self):
        with pytest.raises(TightpackError, match="must be a CostModel, a preset name or a path, got int 3"):
            CostModel.resolve(3)


# --- spread ----------------------------------------------------------------------------------------


class TestCostSpread:
    def test_known_array(self):
        # mean 2, max 4, population variance (1 + 1 + 4) / 3 = 2, std sqrt(2), cv sqrt(2) / 2.
        spread = cost_spread(np.array([1.0, 1.0, 4.0]))
        assert spread == CostSpread(count=3, mean=2.0, max=4.0, max_over_mean=2.0, cv=math.sqrt(2) / 2)

    def test_balanced(self):
        assert cost_spread([5.0] * 4) == CostSpread(count=4, mean=5.0, max=5.0, max_over_mean=1.0, cv=0.0)

    def test_empty_and_zero(self):
        assert cost_spread([]) == CostSpread(count=0, mean=0.0, max=0.0, max_over_mean=1.0, cv=0.0)
        assert cost_spread([0.0, 0.0]) == CostSpread(count=2, mean=0.0, max=0.0, max_over_mean=1.0, cv=0.0)

    def test_one_busy_pack(self):
        spread = cost_spread([0.0, 0.0, 0.0, 8.0])
        assert (spread.mean, spread.max_over_mean, spread.cv) == (2.0, 4.0, math.sqrt(3))

    @pytest.mark.parametrize(
        ("costs", "match"),
        [([1.0, -1.0], "non-negative"), ([math.nan], "finite"), ([[1.0]], "one-dimensional")],
    )
    def test_bad_costs(self, costs, match):
        with pytest.raises(TightpackError, match=match):
            cost_spread(costs)
