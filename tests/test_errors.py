"""Errors name settings as the caller spells them: Python parameters from the API, flags from the CLI.

`TightpackError.parameters` lists the Python spellings a message holds; the command line prints the
message with its flags in their place (`tightpack.cli.flags`).
"""

from __future__ import annotations

import json
import pickle
import re

import pytest

from tightpack.cli.flags import FLAGS, cli_text
from tightpack.errors import TightpackError
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare.formats import FormatConfig
from tightpack.prepare.vision_rows import VisionSpec
from tightpack.prepare.vision_sizes import VisionSizes

from .conftest import run_main, write_jsonl

BAD_PACK_CONFIGS = {
    "tiny-pack": {"packed_sequence_size": 1},
    "huge-pack": {"packed_sequence_size": 2**31},
    "cap-over-pack": {"max_seq_length": 100},
    "zero-multiple": {"pad_seq_to_mult": 0},
    "multiple-and-tp": {"pad_seq_to_mult": 8, "tp": 2},
    "zero-tp": {"tp": 0},
    "algorithm": {"algorithm": "nope"},
    "long-samples": {"long_samples": "nope"},
    "fixed-width-uneven": {"packed_sequence_size": 65, "cp": 2, "pad_to_max_length": True},
    "cu-seqlens-alone": {"pad_cu_seqlens": True},
    "engine": {"engine": "spark"},
    "zero-workers": {"workers": 0},
    "address-without-ray": {"ray_address": "auto"},
    "output-format": {"output_format": "csv"},
    "cap-below-multiple": {"max_seq_length": 7, "pad_seq_to_mult": 8},
    "vision-on-ray": {
        "format": FormatConfig(vision=VisionSpec(VisionSizes("qwen2_vl"))),
        "engine": "ray",
        "output_format": "npy",
    },
}
BAD_FORMATS = {
    "format": {"format": "x"},
    "loss-on": {"loss_on": "y"},
    "truncation-method": {"truncation_method": "z"},
    "chat-truncation": {"chat_truncation": "w"},
    "truncate-field": {"truncate_fields": ("nope",)},
}


def raised(settings: dict, kind: str) -> TightpackError:
    with pytest.raises(TightpackError) as error:
        if kind == "pack":
            PackConfig(**{"packed_sequence_size": 64, **settings}).validate()
        else:
            FormatConfig(**settings)
    return error.value


@pytest.mark.parametrize(
    ("settings", "kind"),
    [pytest.param(s, "pack", id=name) for name, s in BAD_PACK_CONFIGS.items()]
    + [pytest.param(s, "format", id=name) for name, s in BAD_FORMATS.items()],
)
def test_python_errors_name_python_parameters_and_the_cli_its_flags(settings, kind):
    error = raised(settings, kind)
    message = str(error)
    assert "--" not in message, message
    assert error.parameters, f"no parameters listed for {message!r}"
    assert any(name.split("=")[0] in settings or name in settings for name in error.parameters), message
    shown = cli_text(message, error.parameters)
    for name in error.parameters:
        assert name in message and name in FLAGS, (name, message)
        assert FLAGS[name] in shown, (name, shown)
    assert not re.search(r"(?<![\w-])(" + "|".join(map(re.escape, error.parameters)) + r")(?![\w=-])", shown)


def test_the_same_setting_reads_as_python_from_the_api_and_as_flags_from_the_cli(tmp_path):
    with pytest.raises(
        TightpackError, match=r"^max_seq_length \(100\) must be between 1 and packed_sequence_size \(64\)$"
    ):
        PackConfig(packed_sequence_size=64, max_seq_length=100).validate()
    source = write_jsonl(tmp_path / "rows.jsonl", [{"input": "q", "output": "a"}])
    run = run_main(["pack", source, "-o", tmp_path / "out", "--pack-size", "64", "--max-seq-length", "100"])
    assert run.returncode == 2
    assert run.stderr == "error: --max-seq-length (100) must be between 1 and --pack-size (64)\n"


def test_a_bad_row_names_skip_bad_lines_in_each_spelling(tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text('{"prompt": "q", "output": "a"}\n')
    with pytest.raises(TightpackError) as error:
        pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=64))
    assert str(error.value).endswith(
        "set input_key/output_key or format (fix the row, or pass skip_bad_lines=True)"
    )
    assert pickle.loads(pickle.dumps(error.value)).parameters == error.value.parameters  # from workers
    run = run_main(["pack", source, "-o", tmp_path / "out", "--pack-size", "64", "--workers", "1"])
    assert run.stderr.rstrip().endswith(
        "set --input-key/--output-key or --format (fix the row, or pass --skip-bad-lines)"
    ), run.stderr


def test_a_skipped_row_is_listed_with_flags_and_recorded_in_python_words(tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text('{"prompt": "q", "output": "a"}\n{"input": "q", "output": "a"}\n')
    args = ["pack", source, "-o", tmp_path / "out", "--pack-size", "64", "--workers", "1", "--skip-bad-lines"]
    run = run_main(args)
    assert run.returncode == 0, run.stderr
    reason = "missing key 'input' (keys found: output, prompt); set {} or {}"
    assert run.stderr.splitlines() == [
        f"skipped {source}:1: " + reason.format("--input-key/--output-key", "--format")
    ]
    [bad] = json.loads((tmp_path / "out" / "manifest.json").read_text())["bad_rows"]
    assert bad["reason"] == reason.format("input_key/output_key", "format")
