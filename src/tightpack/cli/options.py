"""The options ``tightpack pack`` and ``tightpack plan`` share: how rows become samples (vision included),
and the topology.

Each is an ``Annotated`` type to use as a parameter's annotation, so the two commands spell, document
and check them once; `format_config` turns the sample options into a `FormatConfig`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from tightpack.cli.app import Algorithm, ChatTruncation, Format, LongSamples, LossOn, TruncationMethod
from tightpack.errors import TightpackError
from tightpack.prepare import formats
from tightpack.prepare.vision_rows import VisionSpec
from tightpack.prepare.vision_sizes import VisionSizes

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
FormatOption = Annotated[
    Format,
    typer.Option(
        "--format",
        help="Row format: SFT samples (auto, prompt-completion, chat, tokens) or preference units "
        "(preference: prompt/chosen/rejected, kto: prompt/completion/label, groups: prompt/completions).",
    ),
]
LossOnOption = Annotated[
    LossOn, typer.Option(help="Chat loss: assistant turns, the last turn, or all tokens.")
]
InputKey = Annotated[str, typer.Option(help="Prompt key of prompt-completion rows.")]
OutputKey = Annotated[str, typer.Option(help="Completion key of prompt-completion rows.")]
MessagesKey = Annotated[str, typer.Option(help="Messages key of chat rows.")]
ToolsKey = Annotated[str, typer.Option(help="Tool schemas key of chat rows (passed to the chat template).")]
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
TemplateVars = Annotated[
    list[str] | None,
    typer.Option(
        "--template-var",
        metavar="NAME=VALUE",
        help="Chat template variable NAME=VALUE (repeatable), e.g. enable_thinking=false; VALUE is read "
        "as JSON when it parses as JSON (false, 3, [1]), else as a string.",
    ),
]
Seed = Annotated[int, typer.Option(help="Seed of first_fit_shuffle.")]
PackSeed = Annotated[
    int,
    typer.Option(
        help="Seed of first_fit_shuffle and, with --weights, of the mixture's subsampling and of the order "
        "of each pass over a source (docs/mixtures.md)."
    ),
]
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
VisionProcessor = Annotated[
    Path | None,
    typer.Option(
        help="Qwen-VL packing: the model's processor folder (what processor.save_pretrained writes: "
        "processor_config.json or preprocessor_config.json); chat rows may "
        "then hold image and video parts (docs/vision.md).",
    ),
]
VisionFamily = Annotated[
    str | None,
    typer.Option(
        "--vision",
        help="Model family of --vision-processor (qwen2_vl, qwen2_5_vl, qwen3_vl) when its "
        "config.json does not say.",
    ),
]
MediaRoot = Annotated[
    Path | None,
    typer.Option(help="Folder that relative media paths start from (default: the first input's folder)."),
]
Split = Annotated[str | None, typer.Option(help="Split of a Hugging Face dataset dictionary saved to disk.")]


def format_config(
    *,
    format: Format,
    input_key: str,
    output_key: str,
    prompt_template: str | None,
    messages_key: str = "messages",
    tools_key: str = "tools",
    loss_on: LossOn,
    truncate_field: str | None,
    truncation_method: TruncationMethod,
    chat_truncation: ChatTruncation,
    vision: VisionSpec | None = None,
    template_vars: list[str] | None = None,
) -> formats.FormatConfig:
    """The `FormatConfig` of the sample options."""
    return formats.FormatConfig(
        format=format.value,
        input_key=input_key,
        output_key=output_key,
        prompt_template=None if prompt_template is None else decode_escapes(prompt_template),
        messages_key=messages_key,
        tools_key=tools_key,
        loss_on=loss_on.value,
        truncate_fields=_fields(truncate_field),
        truncation_method=truncation_method.value,
        chat_truncation=chat_truncation.value,
        vision=vision,
        template_vars=template_variables(template_vars or []),
    )


def template_variables(options: list[str]) -> tuple[tuple[str, Any], ...]:
    """``--template-var NAME=VALUE`` options -> (name, value) pairs; a value that parses as JSON is
    that JSON value, any other is the string as given.

    >>> template_variables(["enable_thinking=false", "persona=a pirate", "n=3"])
    (('enable_thinking', False), ('persona', 'a pirate'), ('n', 3))
    """
    pairs = []
    for option in options:
        name, equals, value = option.partition("=")
        if not equals or not name.strip():
            raise TightpackError(f"--template-var {option!r} must be NAME=VALUE, e.g. enable_thinking=false")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        pairs.append((name.strip(), parsed))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise TightpackError(f"--template-var names a variable twice: {', '.join(names)}")
    return tuple(pairs)


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


def vision_spec(
    processor: Path | None, model: str | None, media_root: Path | None, inputs: list[Path] | None
) -> VisionSpec | None:
    """The vision settings of ``--vision-processor`` (None: text-only packing)."""
    if processor is None:
        if model is not None or media_root is not None:
            raise TightpackError(
                "--vision and --media-root need --vision-processor (the model's processor folder)"
            )
        return None
    root = media_root if media_root is not None else (inputs[0].parent if inputs else Path("."))
    return VisionSpec(VisionSizes.from_folder(processor, model), media_root=str(root.resolve()))
