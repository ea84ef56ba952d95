"""The packed-data rules (D1...): ids, severities and summaries, as docs/validation-rules.md lists them."""

from __future__ import annotations

from dataclasses import dataclass

from tightpack.config.report import Severity

SAMPLE_ROWS = 512
"""Rows read from packs without a manifest (a fixed, seeded sample of row groups), unless ``deep``."""
SPECS = "dataset.offline_packing_specs"


@dataclass(frozen=True)
class DataRule:
    """One packed-data rule, as docs/validation-rules.md lists it.

    Attributes:
        id: ``D1``, ``D2``, ...
        severities: what its findings can be: ``("error",)``, ``("warning",)`` or both (by case).
        section: the contract sections that state it.
        summary: one line of Markdown for the table.
    """

    id: str
    severities: tuple[Severity, ...]
    section: str
    summary: str


DATA_RULES: tuple[DataRule, ...] = (
    DataRule(
        "D1",
        ("error", "warning"),
        "§2.1",
        "every packed path the configuration names (or `--packed`) exists and resolves to packed files; a "
        "missing `packed_metadata_path` is W when nothing reads it (Parquet without `pad_cu_seqlens`)",
    ),
    DataRule(
        "D2",
        ("error", "warning"),
        "§2.9, §2.10",
        "the packs' size P (manifest, else metadata `pack_size`) fits `packed_sequence_size`, "
        "`dataset.seq_length` and `model.seq_length` (E: larger, rows overflow the width; W: smaller, "
        "packs fill less than configured)",
    ),
    DataRule(
        "D3",
        ("error", "warning"),
        "§6, §2.4",
        "the packs' alignment multiple (manifest `pad_seq_to_mult`) is a multiple of k (E when 2*CP does "
        "not divide it: CP slicing; W when only CP*TP of sequence parallelism does not, as T2)",
    ),
    DataRule(
        "D4",
        ("warning",),
        "§2.10",
        "the packs' multiple equals `pad_seq_to_mult` (None: 1). W only: at read time the reference tests "
        "just m > 1 (padded boundaries, logical lengths without trailing EOS), so a different multiple "
        "that D3 accepts changes which boundaries the model sees, not CP slicing",
    ),
    DataRule(
        "D5",
        ("error",),
        "§2.6, §2.9",
        "`pad_cu_seqlens` reads `packed_metadata_path`: set, a list of entries with `max_samples_per_bin`, "
        "`dataset_max_seqlen`, `min_packed_seqlen`, and `pack_size` equal to the packs' P",
    ),
    DataRule(
        "D6",
        ("error",),
        "§2.6, §2.10",
        "`pad_cu_seqlens`: the metadata covers every split read (train and validation): its max "
        "`max_samples_per_bin` and `dataset_max_seqlen` are at least, its min `min_packed_seqlen` at most, "
        "each split's own",
    ),
    DataRule(
        "D7",
        ("error", "warning"),
        "§2.3",
        "the manifest's tokenizer is the configuration's (`tokenizer.tokenizer_model`, "
        "`offline_packing_specs.tokenizer_model_name`): E when a local tokenizer's fingerprint differs, "
        "W when only the names can be compared and differ",
    ),
    DataRule(
        "D8",
        ("error",),
        "§6, §2.7",
        "every segment is divisible by k and every row fits P: from the manifest's multiple (D3) without "
        f"reading rows; without a manifest on a seeded sample of up to {SAMPLE_ROWS} rows; with `--deep` "
        "every row (`tightpack verify`)",
    ),
    DataRule(
        "D9",
        ("error",),
        "§2.7",
        "the files are the ones the manifest lists, with its sizes (sha256 with `--deep`): none missing, "
        "changed or added after packing",
    ),
    DataRule(
        "D10",
        ("error",),
        "§2.3, §2.7",
        "packs without a manifest: every token id lies in the configured tokenizer's vocabulary "
        "(`tokenizer.tokenizer_model`, a local tokenizer; `GPT2BPETokenizer`: GPT-2's), on the sampled "
        "rows of D8 (every row with `--deep`); with a manifest D7 compares the tokenizers themselves",
    ),
    DataRule(
        "D11",
        ("error", "warning"),
        "§2.1",
        "`packed_train_data_blend` weights count packs: W when the shares of tokens (`--mix-by`: supervised "
        "tokens, samples) they give its folders (manifests) are over half a point off the shares meant "
        "(`--blend-targets`, else the weights), with the weights that give those; E when a "
        "`GPTDatasetConfig` `blend`, `blend_per_split` or `data_path` names a tightpack folder (it reads "
        "indexed `.bin`/`.idx` datasets)",
    ),
)
RULE_IDS = tuple(rule.id for rule in DATA_RULES)
