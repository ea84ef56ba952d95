"""Tests of `tightpack.runtime.calibration` and ``tightpack calibrate``: the varlen attention is exact,
a real (tiny, CPU) calibration returns a well-formed fit. No assertion on wall-clock times or on R²:
a loaded machine is noisy."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from tightpack.cli.calibrate_command import parse_model_config, parse_pack_widths
from tightpack.core.cost_model import CostModel
from tightpack.errors import TightpackError
from tightpack.runtime.calibration import (
    build_calibration_model,
    calibrate_cost_model,
    calibration_compositions,
    packed_inputs,
)

LENGTHS = [37, 64, 5, 22]


def _per_token_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """CE of each next-token prediction within one sequence, ``[tokens - 1]``."""
    return torch.nn.functional.cross_entropy(logits[0, :-1], input_ids[0, 1:], reduction="none")


@pytest.fixture(scope="module")
def model():
    return build_calibration_model({"num_hidden_layers": 2}, seed=3)


class TestVarlenAttention:
    def test_packed_row_equals_separate_runs(self, model):
        inputs = packed_inputs(LENGTHS, model.config.vocab_size, torch.Generator().manual_seed(1))
        model.zero_grad(set_to_none=True)
        packed = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False)
        starts = np.cumsum([0, *LENGTHS])
        packed_losses = [
            _per_token_losses(packed.logits[:, a:b], inputs["input_ids"][:, a:b])
            for a, b in itertools.pairwise(starts)
        ]
        torch.cat(packed_losses).sum().backward()
        packed_grads = [p.grad.clone() for p in model.parameters()]

        model.zero_grad(set_to_none=True)
        separate_losses = []
        for a, b in itertools.pairwise(starts):
            ids = inputs["input_ids"][:, a:b]
            separate_losses.append(_per_token_losses(model(input_ids=ids, use_cache=False).logits, ids))
        torch.cat(separate_losses).sum().backward()
        for mine, theirs in zip(packed_losses, separate_losses, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
        for mine, theirs in zip(packed_grads, [p.grad for p in model.parameters()], strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
        model.zero_grad(set_to_none=True)

    def test_the_boundaries_matter(self, model):
        """Without position restarts the row is one sequence: the logits after the first one change."""
        inputs = packed_inputs(LENGTHS, model.config.vocab_size, torch.Generator().manual_seed(1))
        with torch.no_grad():
            packed = model(
                input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False
            )
            whole = model(input_ids=inputs["input_ids"], use_cache=False)
        assert (packed.logits[0, LENGTHS[0] :] - whole.logits[0, LENGTHS[0] :]).abs().max() > 1e-3

    def test_cu_seq_lens_give_the_same_result(self, model):
        inputs = packed_inputs(LENGTHS, model.config.vocab_size, torch.Generator().manual_seed(2))
        bounds = torch.tensor(np.cumsum([0, *LENGTHS]), dtype=torch.int32)
        with torch.no_grad():
            by_positions = model(**inputs, use_cache=False).logits
            by_bounds = model(**inputs, use_cache=False, cu_seq_lens_q=bounds).logits
        torch.testing.assert_close(by_positions, by_bounds, atol=1e-6, rtol=0)

    def test_an_attention_mask_is_refused(self, model):
        inputs = packed_inputs(LENGTHS, model.config.vocab_size, torch.Generator().manual_seed(2))
        with pytest.raises(TightpackError, match="takes no attention_mask"):
            model(
                input_ids=inputs["input_ids"],
                attention_mask=torch.ones(1, 4, sum(LENGTHS), sum(LENGTHS)),
                use_cache=False,
            )


class TestModelAndPacks:
    def test_building_leaves_the_global_rng_alone(self):
        torch.manual_seed(123)
        expected = torch.rand(3)
        torch.manual_seed(123)
        first = build_calibration_model(seed=5)
        after = torch.rand(3)
        torch.testing.assert_close(after, expected)
        second = build_calibration_model(seed=5)
        for a, b in zip(first.parameters(), second.parameters(), strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)

    def test_compositions_fill_each_width_and_vary_the_squares(self):
        packs = calibration_compositions([256, 512])
        assert {sum(p) for p in packs} == {256, 512}
        assert min(min(p) for p in packs) >= 16
        for width in (256, 512):
            ratios = {sum(s * s for s in p) / width for p in packs if sum(p) == width}
            assert len(ratios) >= 5

    def test_packed_inputs_restart_positions_and_mask_the_first_label(self):
        inputs = packed_inputs([3, 2], 50, torch.Generator().manual_seed(0))
        assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
        assert inputs["labels"][0, [0, 3]].tolist() == [-100, -100]
        assert (inputs["labels"][0, [1, 2, 4]] == inputs["input_ids"][0, [1, 2, 4]]).all()

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"pack_widths": (512, 512)}, "at least two different widths"),
            ({"pack_widths": (8, 512)}, "integers >= 16"),
            ({"repeats": 0}, "repeats must be an integer >= 1"),
            ({"warmup": -1}, "warmup must be an integer >= 0"),
            ({"threads": 0}, "threads must be a positive integer"),
            ({"model_config": [1]}, "model_config must be a dict"),
            ({"model_config": {"hidden_sise": 64}}, r"\['hidden_sise'\] are not LlamaConfig keys"),
            ({"model_config": {"hidden_size": 130}}, "LlamaConfig rejects.*not a multiple"),
            ({"model_config": {"num_key_value_heads": 3}}, "multiple of num_key_value_heads=3"),
        ],
    )
    def test_bad_arguments(self, kwargs, match):
        with pytest.raises(TightpackError, match=match):
            calibrate_cost_model(**kwargs)


def test_a_real_tiny_calibration(tmp_path):
    threads = torch.get_num_threads()
    calls = []
    fit = calibrate_cost_model(
        pack_widths=(256, 1024),
        repeats=2,
        threads=1,
        progress=lambda done, total, label: calls.append((done, total)),
    )
    assert torch.get_num_threads() == threads
    assert calls[-1] == (3, 3)
    packs = calibration_compositions([256, 1024])
    assert len(fit.seconds) == len(fit.labels) == len(packs)
    assert fit.labels[0] == "256 = 1 x 256"
    np.testing.assert_array_equal(fit.sum_lengths, [sum(p) for p in packs])
    np.testing.assert_array_equal(fit.num_sequences, [len(p) for p in packs])
    assert np.isfinite(fit.seconds).all() and (fit.seconds > 0).all()
    assert np.isfinite(fit.residuals).all()
    model = fit.model
    assert model.unit == "seconds"
    assert min(model.linear, model.quadratic, model.per_sequence, fit.per_pack) >= 0
    assert math.isfinite(fit.r2) and fit.r2 <= 1.0
    path = tmp_path / "calibrated.json"
    model.save(path)
    assert CostModel.resolve(str(path)) == model
    json.dumps(fit.to_dict())


@pytest.mark.parametrize("text", ["256,x", "256,,512", "", "1.5,2"])
def test_parse_pack_widths_refuses_non_integers(text):
    with pytest.raises(TightpackError, match="--pack-widths must be comma-separated integers"):
        parse_pack_widths(text)


def test_parse_model_config(tmp_path):
    assert parse_model_config('{"num_hidden_layers": 3}') == {"num_hidden_layers": 3}
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 64}')
    assert parse_model_config(str(path)) == {"hidden_size": 64}
    with pytest.raises(TightpackError, match="neither a JSON object nor an existing JSON file"):
        parse_model_config(str(tmp_path / "missing.json"))
    with pytest.raises(TightpackError, match="neither a JSON object"):
        parse_model_config(str(tmp_path))  # a folder is not a file either
    path.write_text("[1, 2]")
    with pytest.raises(TightpackError, match="must be a JSON object of LlamaConfig keys"):
        parse_model_config(str(path))


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tightpack.cli", "calibrate", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_cli_writes_a_loadable_model_and_its_fit(tmp_path):
    output = tmp_path / "model.json"
    done = _cli(
        "-o", str(output), "--pack-widths", "128,256", "--repeats", "1", "--warmup", "0", "--threads", "1",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    model = CostModel.load(output)
    assert model.unit == "seconds"
    fit = json.loads((tmp_path / "model.fit.json").read_text())
    assert CostModel.from_dict(fit["cost_model"]) == model
    assert len(fit["measurements"]) == len(calibration_compositions([128, 256]))
    assert "crossover length" in done.stdout and "256 = 1 x 256" in done.stdout


@pytest.mark.parametrize("widths", ["256,x", "512"])
def test_cli_bad_pack_widths_exit_2_with_one_line(tmp_path, widths):
    done = _cli("-o", str(tmp_path / "m.json"), "--pack-widths", widths, cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "pack" in lines[0]
    assert not (tmp_path / "m.json").exists()
