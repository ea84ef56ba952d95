"""The command line's names for the settings library messages name in Python (`TightpackError.parameters`).

A message raised by the library says ``max_seq_length (7) must be ...``; ``tightpack pack`` prints
``--max-seq-length (7) must be ...``. Only the spellings an error lists are replaced, each where it
stands as a whole word, so the rest of the message is left as written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tightpack.errors import TightpackError

FLAGS = {
    "packed_sequence_size": "--pack-size",
    "max_seq_length": "--max-seq-length",
    "pad_seq_to_mult": "--pad-seq-to-mult",
    "tp": "--tp",
    "cp": "--cp",
    "sp": "--sp",
    "algorithm": "--algorithm",
    "balance_costs": "--balance-costs",
    "long_samples": "--long-samples",
    "pad_to_max_length": "--pad-to-max-length",
    "pad_cu_seqlens": "--pad-cu-seqlens",
    "workers": "--workers",
    "engine": "--engine",
    "engine='ray'": "--engine ray",
    "engine='local'": "--engine local",
    "ray_address": "--ray-address",
    "output_format": "--output-format",
    "output_format='npy'": "--output-format npy",
    "preference_layout": "--preference-layout",
    "skip_bad_lines=True": "--skip-bad-lines",
    "format": "--format",
    "format='tokens'": "--format tokens",
    "loss_on": "--loss-on",
    "template_vars": "--template-var",
    "input_key": "--input-key",
    "output_key": "--output-key",
    "input_key/output_key or format": "--input-key/--output-key or --format",
    "prompt_template": "--prompt-template",
    "truncate_fields": "--truncate-field",
    "truncation_method": "--truncation-method",
    "chat_truncation": "--chat-truncation",
    "vision": "--vision-processor",
    "model='qwen2_vl'": "--vision qwen2_vl",
    "media_root": "--media-root",
    "tokenizer": "--tokenizer",
    "tokenizer=None": "no --tokenizer",
    "tokenizer=PATH": "--tokenizer PATH",
    "overwrite=True": "--overwrite",
    "another output": "another --output",
    "an output": "an --output",
    "device='cpu'": "--device cpu",
    "pack_widths": "--pack-widths",
    "weights": "--weights",
    "mix_by": "--mix-by",
    "max_repetitions": "--max-repetitions",
    "total_tokens": "--mix-tokens",
    "total_packs": "--mix-packs",
    "window_packs": "--mix-window",
    "tolerance": "--mix-tolerance",
    "seed": "--seed",
    "MixtureConfig(weights=..., max_repetitions=...)": "--weights ... --max-repetitions",
}
"""Python spelling -> the flag of ``tightpack pack`` (and ``plan``, ``calibrate``) that sets it."""


def cli_text(text: str, parameters: Iterable[str]) -> str:
    """``text`` with each of ``parameters`` that `FLAGS` knows replaced by its flag.

    >>> cli_text("max_seq_length (7) must be at most packed_sequence_size (4)", ["max_seq_length",
    ...          "packed_sequence_size"])
    '--max-seq-length (7) must be at most --pack-size (4)'
    """
    for name in sorted(set(parameters) & FLAGS.keys(), key=len, reverse=True):
        text = re.sub(rf"(?<![\w.'=-]){re.escape(name)}(?![\w'=-])", FLAGS[name], text)
    return text


def cli_message(error: TightpackError) -> str:
    """The message of ``error`` as the command line prints it: one line, its flags named."""
    return " ".join(cli_text(str(error), error.parameters).split())
