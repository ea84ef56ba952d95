"""The release floors of packed attention (tightpack.runtime.transformers_releases): the installed
transformers and torch pass for every implementation in the table, releases below a floor are refused
with the release, the floor and the fix, and `check_packable` refuses a model on such a release.

Older releases are named explicitly (``version=``), never faked into the installed package; the
environment with the oldest supported transformers (``make test-oldest``) runs these same tests there.
"""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest

from tests.tiny_families import tiny_model
from tightpack.errors import TightpackError
from tightpack.runtime.hf import PACKED_ATTENTION, check_packable
from tightpack.runtime.transformers_releases import (
    FAMILY_FLOORS,
    RELEASE_FLOORS,
    check_release,
    parse_release,
)

MASK_FROM_POSITIONS = ["eager", "sdpa", "flex_attention"]


@pytest.mark.parametrize("attention", sorted(RELEASE_FLOORS))
def test_the_installed_releases_pack_every_implementation_of_the_table(attention):
    installed = parse_release(version("transformers"))
    assert installed >= RELEASE_FLOORS[attention].transformers
    check_release(attention)  # installed transformers and torch: no refusal


def test_the_dependency_floor_is_the_first_release_that_packs_eager_and_sdpa():
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    floors = [
        re.search(r">=\s*([\d.]+)", req)
        for req in project["project"]["dependencies"]
        if req.startswith("transformers")
    ]
    assert [parse_release(floor.group(1)) for floor in floors if floor] == [
        RELEASE_FLOORS["sdpa"].transformers
    ]
    assert RELEASE_FLOORS["eager"] == RELEASE_FLOORS["sdpa"] == RELEASE_FLOORS["flex_attention"]


@pytest.mark.parametrize("attention", MASK_FROM_POSITIONS)
@pytest.mark.parametrize("release", ["4.45.0", "4.50.3", "4.52.4", "4.53.0", "4.53.3"])
def test_releases_before_the_packed_mask_are_refused_with_the_fix(attention, release):
    with pytest.raises(TightpackError) as refusal:
        check_release(attention, release, torch_version="2.6.0")
    message = str(refusal.value)
    assert f"transformers {release} does not keep packed sequences apart" in message
    assert f"attn_implementation={attention!r}" in message
    assert "first release that packs" in message and "pip install 'transformers>=4.54.0'" in message
    assert "attn_implementation='flash_attention_2'" in message, "an implementation this release packs"


@pytest.mark.parametrize("attention", MASK_FROM_POSITIONS)
def test_the_first_release_with_the_packed_mask_passes(attention):
    check_release(attention, "4.54.0", torch_version="2.6.0")
    check_release(attention, "5.24.0", torch_version="2.13.0+cpu")


def test_flash_attention_2_packs_from_4_44():
    check_release("flash_attention_2", "4.44.0", torch_version="2.4.0")
    with pytest.raises(TightpackError, match=r"transformers 4\.43\.0 .* 'transformers>=4\.44\.0'$"):
        check_release("flash_attention_2", "4.43.0")


@pytest.mark.parametrize("attention", MASK_FROM_POSITIONS)
def test_torch_before_2_6_is_refused_for_masks_built_from_positions(attention):
    with pytest.raises(TightpackError, match=r"torch 2\.5\.1 is too old .* 'torch>=2\.6\.0'"):
        check_release(attention, "4.54.0", torch_version="2.5.1")
    check_release("flash_attention_2", "4.54.0", torch_version="2.5.1")  # the kernel needs no mask


def test_an_implementation_outside_the_table_is_refused():
    with pytest.raises(TightpackError, match="'paged_attention' does not keep packed sequences apart"):
        check_release("paged_attention", "5.24.0")
    assert tuple(RELEASE_FLOORS) == PACKED_ATTENTION


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_check_packable_refuses_a_model_on_a_release_that_cannot_pack_it(attention):
    model = tiny_model("llama", attention=attention)
    check_packable(model)  # the installed release packs it
    with pytest.raises(TightpackError, match=rf"transformers 4\.53\.0 .*attn_implementation='{attention}'"):
        check_packable(model, transformers_release="4.53.0")
    check_packable(model, transformers_release="4.54.0")


def test_check_packable_refuses_gpt2_before_its_own_mask_reads_positions():
    model = tiny_model("gpt2")
    with pytest.raises(
        TightpackError, match=r"transformers 4\.54\.0 builds gpt2's attention mask .*>=4\.55\.0"
    ):
        check_packable(model, transformers_release="4.54.0")
    check_packable(model, transformers_release=".".join(map(str, FAMILY_FLOORS["gpt2"].release)))
    check_packable(tiny_model("llama"), transformers_release="4.54.0")  # Llama's mask reads them there


def test_check_packable_refuses_mamba2_before_its_layers_take_seq_idx():
    model = tiny_model("mamba2")
    with pytest.raises(
        TightpackError, match=r"transformers 5\.24\.0 gives mamba2's .*no sequence boundaries.*>=5\.25\.0"
    ):
        check_packable(model, transformers_release="5.24.0")
    check_packable(model, transformers_release="5.25.0")
