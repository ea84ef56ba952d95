"""The options ``tightpack pack`` and ``tightpack plan`` share: how rows become samples, and the topology.

Each is an ``Annotated`` type to use as a parameter's annotation, so the two commands spell, document
and check them once; `format_config` turns the sample options into a `FormatConfig`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from tightpack.cli.app import Algorithm, ChatTruncation, Format, LongSamples, LossOn, TruncationMethod
from tightpack.prepare import formats
from tightpack.prepare.vision_rows import VisionSpec

Inputs = Annotated[
    list[Path] | None,
    typer.Argument(
        help="JSONL or Parquet files. None: the embedded default corpus (chitchat conversations)."
    ),
]
TokenizerOption = Annotated[
    str | None,
    typer.Option(help="Hugging Face tokenizer folder or tokenizer.json (default: built-in GPT-2)."),
]
FormatOption = Annotated[Format, typer.Option("--format", help="Sample format.")]
LossOnOption = Annotated[
    LossOn, typer.Option(help="Chat loss: assistant turns, the last turn, or all tokens.")
]
InputKey = Annotated[str, typer.Option(help="Prompt key of prompt-completion rows.")]
OutputKey = Annotated[str, typer.Option(help="Completion key of prompt-completion rows.")]
PromptTemplate = Annotated[
    str | None,
    typer.Option(
        help='Prompt template, ending with the output key (default "{input} {output}"); the escapes '
        "\\n, \\t and \\\\ are decoded (a newline, a tab, a backslash)."
    ),
]
AlgorithmOption = Annotated[Algorithm, typer.Option(help="Packing algorithm.")]
PadSeqToMult = Annotated[
    int | None, typer.Option(help="Per-sequence alignment multiple (or derive it from --tp/--cp/--sp).")
]
Tp = Annotated[int, typer.Option(help="Tensor parallel size (for the alignment multiple).")]
Cp = Annotated[int, typer.Option(help="Context parallel size (for the alignment multiple).")]
Sp = Annotated[bool, typer.Option("--sp", help="Sequence parallelism (for the alignment multiple).")]
LongSamplesOption = Annotated[
    LongSamples,
    typer.Option(help="Samples above the cap: truncate (trim the prompt, keep the answer), drop, or error."),
]
TruncateField = Annotated[
    str | None,
    typer.Option(
        help="Prompt-completion: template fields trimmed first, comma-separated (default: the input "
        "key; 'none': cut the sample at its end)."
    ),
]
TruncationMethodOption = Annotated[
    TruncationMethod,
    typer.Option(help="Trim a field's end (right: keep its start) or its start (left: keep its end)."),
]
ChatTruncationOption = Annotated[
    ChatTruncation,
    typer.Option(
        help="Chat: drop the oldest rounds, then trim user text, keeping the system turn and the last "
        "round (oldest-turns), or cut the end (end)."
    ),
]
Seed = Annotated[int, typer.Option(help="Seed of first_fit_shuffle.")]
Reuse = Annotated[
    bool,
    typer.Option(
        "--reuse/--no-reuse",
        help="Reuse the cached token store of the same inputs, tokenizer and format ($TIGHTPACK_CACHE).",
    ),
]
SkipBadLines = Annotated[
    bool, typer.Option("--skip-bad-lines", help="Skip and count bad rows instead of stopping.")
]
Split = Annotated[str | None, typer.Option(help="Split of a Hugging Face dataset dictionary saved to disk.")]


def format_config(
    *,
    format: Format,
    input_key: str,
    output_key: str,
    prompt_template: str | None,
    loss_on: LossOn,
    truncate_field: str | None,
    truncation_method: TruncationMethod,
    chat_truncation: ChatTruncation,
    vision: VisionSpec | None = None,
) -> formats.FormatConfig:
    """The `FormatConfig` of the sample options."""
    return formats.FormatConfig(
        format=format.value,
        input_key=input_key,
        output_key=output_key,
        prompt_template=None if prompt_template is None else decode_escapes(prompt_template),
        loss_on=loss_on.value,
        truncate_fields=_fields(truncate_field),
        truncation_method=truncation_method.value,
        chat_truncation=chat_truncation.value,
        vision=vision,
    )


_ESCAPES = re.compile(r"\\([nt\\])")
_ESCAPED = {"n": "\n", "t": "\t", "\\": "\\"}


def decode_escapes(template: str) -> str:
    r"""A template typed on a command line, its ``\n``, ``\t`` and ``\\`` decoded: a shell passes
    ``"Q: {input}\nA: {output}"`` with a backslash and an ``n``, which would be trained on as such.
    Other backslashes stay. (A template from Python or a configuration file is already text.)

    >>> decode_escapes(r"Q: {input}\nA:\t{output} \\n \d")
    'Q: {input}\nA:\t{output} \\n \\d'
    """
    return _ESCAPES.sub(lambda match: _ESCAPED[match.group(1)], template)


def _fields(option: str | None) -> tuple[str, ...] | None:
    """``--truncate-field``: None (the default field), ``none`` (no field), or names separated by commas."""
    if option is None:
        return None
    if option.strip().lower() == "none":
        return ()
    return tuple(name.strip() for name in option.split(",") if name.strip())
