"""The equivalence probe on preference rows: both layouts pass on families that keep branches apart,
and a model that lets a branch lose its prompt or see its sibling is refused before training."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_families import tiny_model
from tightpack.core.preference_units import PreferenceUnits
from tightpack.errors import TightpackError
from tightpack.runtime.equivalence import PackingLeakError, check_packing
from tightpack.runtime.equivalence.probe import ProbeSkipped
from tightpack.runtime.preference_batch import build_preference_row


@pytest.fixture(scope="module")
def units() -> PreferenceUnits:
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, 500, (n,), generator=generator).tolist()

    return PreferenceUnits.from_lists(
        [tokens(30), tokens(12)], [tokens(20), tokens(9), tokens(4), tokens(6)], [2, 2]
    )


FAMILIES = [
    ("llama", "sdpa"),
    ("llama", "eager"),
    ("qwen2", "sdpa"),
    ("mistral", "sdpa"),
    ("gemma2", "eager"),
]


@pytest.mark.parametrize("layout", ["pairs", "shared-prefix"])
@pytest.mark.parametrize(("family", "attention"), FAMILIES)
def test_a_family_that_keeps_branches_apart_passes_in_both_layouts(family, attention, layout, units):
    """Mistral (a window of 24 on every layer) and Gemma 2 (a window of 24 on every other layer): the
    shared-prefix mask replaces the ones transformers builds, so it must apply their windows."""
    model = tiny_model(family, attention=attention)
    report = check_packing(model, build_preference_row(units, layout, pad_to_multiple_of=4))
    assert report.passed and report.cross_sequence == 0.0, report.summary()
    assert report.leak > 1e-3, "the calibration shows what a sibling's leak is for this model"


class MaskDropping(torch.nn.Module):
    """A user's wrapper that forwards everything but ``attention_mask``: transformers then reads the
    positions alone, and a branch, whose positions go on from the prompt, starts a sequence of its own."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, attention_mask=None, **kwargs):
        return self.inner(**kwargs)


def test_a_model_that_drops_the_mask_is_refused(units):
    batch = build_preference_row(units, "shared-prefix")
    with pytest.raises(PackingLeakError, match="not computed as alone") as failure:
        check_packing(MaskDropping(tiny_model("llama")), batch)
    assert failure.value.report.unpacked_gap > 0.1 * failure.value.report.contaminated_gap


class SiblingLeaking(torch.nn.Module):
    """A wrapper that replaces the mask by one causal mask per unit: branches see their siblings."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        causal = torch.ones(input_ids.shape[1], input_ids.shape[1], dtype=torch.bool).tril()[None, None]
        mask = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
        return self.inner(input_ids=input_ids, attention_mask=mask, **kwargs)


def test_a_model_whose_branches_see_their_siblings_is_refused(units):
    batch = build_preference_row(units, "shared-prefix")
    with pytest.raises(PackingLeakError, match="see each other"):
        check_packing(SiblingLeaking(tiny_model("llama")), batch)


def test_a_shared_prefix_row_for_flash_attention_is_refused_with_the_fix(units):
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(TightpackError, match="layout='pairs'"):
        check_packing(model, build_preference_row(units, "shared-prefix"))


def test_a_row_of_single_branches_gives_no_probe(units):
    kto = PreferenceUnits.from_lists([[5, 6, 7]], [[8, 9, 10]], [1], labels=[True])
    with pytest.raises(ProbeSkipped, match="no unit of two or more branches"):
        check_packing(tiny_model("llama"), build_preference_row(kto, "shared-prefix"))
