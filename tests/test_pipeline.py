"""The offline path end to end on real files: pack, read the Parquet back, rebuild every sample."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tightpack.core.alignment import ceil_to_multiple
from tightpack.core.legacy_npy import read_legacy_npy
from tightpack.errors import TightpackError
from tightpack.offline.pipeline import MANIFEST_NAME, METADATA_NAME, PackConfig, pack_dataset
from tightpack.prepare.formats import FormatConfig

from .conftest import write_jsonl


def expected_sample(row: dict, spec, loss_on: str = "assistant") -> tuple[np.ndarray, np.ndarray]:
    """Stored tokens and unshifted mask of a row, computed independently of tightpack's formatter:
    whole-text encoding with per-token offsets, supervised where a token overlaps a loss span."""
    backend = spec.backend
    if "messages" in row:
        text, spans = "", []
        for number, message in enumerate(row["messages"]):
            header, body = f"<|{message['role']}|>\n", message["content"] + "\n"
            is_last_assistant = number == max(
                i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"
            )
            if message["role"] == "assistant" and (loss_on == "assistant" or is_last_assistant):
                spans.append((len(text) + len(header), len(text) + len(header) + len(body)))
            text += header + body
        eos_supervised = row["messages"][-1]["role"] == "assistant"
    else:
        text = row["input"] + " " + row["output"]
        spans, eos_supervised = [(len(row["input"]) + 1, len(text))], True
    encoding = backend.encode(text)
    mask = [int(any(s < end and e > start for start, end in spans)) for s, e in encoding.offsets]
    return np.array([*encoding.ids, spec.eos_id]), np.array([*mask, int(eos_supervised)])


def read_sequences(output: Path) -> dict[int, dict]:
    """Every packed sequence by source row: stored tokens, label-aligned mask, runtime length."""
    table = pq.read_table(sorted(output.glob("*.parquet")))
    sequences = {}
    for row in table.to_pylist():
        starts = row["seq_start_id"]
        assert starts[0] == 0 and starts == sorted(starts), "seq_start_id starts at 0 and never decreases"
        assert len(row["loss_mask"]) == len(row["input_ids"])
        assert starts[-1] < len(row["input_ids"])
        bounds = [*starts, len(row["input_ids"])]
        for j, sample in enumerate(row["sample_index"]):
            assert sample not in sequences, f"sample {sample} packed twice"
            sequences[sample] = {
                "tokens": np.array(row["input_ids"][bounds[j] : bounds[j + 1]]),
                "mask": np.array(row["loss_mask"][bounds[j] : bounds[j + 1]]),
                "seq_len": row["seq_len"][j],
            }
    return sequences


def prompt_trimmed(row: dict, tokens: np.ndarray, mask: np.ndarray, spec, cap: int):
    """The default truncation of a prompt-completion row, computed apart from tightpack: the input's
    tokens (those ending inside it, from the tokenizer's offsets) lose their end until the sample fits,
    then the sample loses its end."""
    offsets = spec.backend.encode(row["input"] + " " + row["output"]).offsets
    prompt = sum(1 for _, end in offsets if 0 < end <= len(row["input"]))
    over = len(tokens) - (cap + 1)
    cut = min(over, prompt)
    keep = np.r_[0 : prompt - cut, prompt : len(tokens)][: cap + 1]
    return tokens[keep], mask[keep]


def is_cut_of(got: np.ndarray, whole: np.ndarray) -> bool:
    """Whether ``got`` is ``whole`` with some runs of tokens removed (a subsequence, greedily matched)."""
    position = 0
    for token in got.tolist():
        while position < len(whole) and whole[position] != token:
            position += 1
        if position == len(whole):
            return False
        position += 1
    return True


def check_round_trip(output: Path, rows: list[dict], spec, *, cap: int, multiple: int, loss_on="assistant"):
    """Every packed sequence against the row formatted and tokenized apart from tightpack. Truncated
    prompt-completion rows are checked against `prompt_trimmed`; truncated chat rows (rounds dropped)
    against being a cut of the whole within the cap that keeps its end."""
    sequences = read_sequences(output)
    manifest = json.loads((output / MANIFEST_NAME).read_text())
    excluded = {i for key in ("dropped_long", "no_supervised") for i in manifest["excluded"][key]}
    assert set(sequences) | excluded == set(range(len(rows))), "every source row is packed or accounted for"
    end_policy = manifest["settings"]["format"]["chat_truncation"] == "end"
    for index, row in enumerate(rows):
        if index in excluded:
            continue
        tokens, mask = expected_sample(row, spec, loss_on)
        if len(tokens) - 1 > cap and "messages" in row and not end_policy:
            got = sequences[index]
            assert got["seq_len"] <= cap
            real = got["tokens"][: got["seq_len"] + 1]
            assert is_cut_of(real, tokens), f"row {index} is the whole with runs removed"
            assert real[-1] == spec.eos_id, f"row {index} keeps its last turn whole, EOS included"
            assert got["mask"].any()
            continue
        if (
            len(tokens) - 1 > cap
            and "input" in row
            and manifest["settings"]["format"]["truncate_fields"] != []
        ):
            tokens, mask = prompt_trimmed(row, tokens, mask, spec, cap)
        runtime = min(len(tokens) - 1, cap)
        target = min(cap, int(ceil_to_multiple(runtime, multiple)))
        real = min(len(tokens), target + 1)
        want_tokens = np.full(target + 1, spec.eos_id)
        want_tokens[:real] = tokens[:real]
        want_mask = np.zeros(target + 1, dtype=int)
        want_mask[: real - 1] = mask[1:real]
        got = sequences[index]
        np.testing.assert_array_equal(got["tokens"], want_tokens, err_msg=f"tokens of row {index}")
        np.testing.assert_array_equal(got["mask"], want_mask, err_msg=f"label-aligned mask of row {index}")
        assert got["seq_len"] == real - 1
    return manifest


@pytest.mark.parametrize("multiple", [1, 4, 8])
def test_prompt_completion_round_trip(tmp_path, gpt2, prompt_completion_rows, multiple):
    source = write_jsonl(tmp_path / "train.jsonl", prompt_completion_rows)
    config = PackConfig(packed_sequence_size=256, pad_seq_to_mult=multiple)
    result = pack_dataset([source], tmp_path / "out", config)
    manifest = check_round_trip(tmp_path / "out", prompt_completion_rows, gpt2, cap=256, multiple=multiple)
    assert result.counts["packed"] == len(prompt_completion_rows)
    assert manifest["counts"] == result.counts
    if multiple > 1:
        assert result.counts["alignment_padding"] > 0


@pytest.mark.parametrize("loss_on", ["assistant", "last-turn"])
def test_chat_round_trip_with_builtin_template(tmp_path, gpt2, chat_rows, loss_on):
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    config = PackConfig(packed_sequence_size=128, format=FormatConfig(format="chat", loss_on=loss_on))
    pack_dataset([source], tmp_path / "out", config)
    check_round_trip(tmp_path / "out", chat_rows, gpt2, cap=128, multiple=1, loss_on=loss_on)


def test_rows_fit_pack_size_and_metadata_matches(tmp_path, chat_rows):
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    result = pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=200, pad_seq_to_mult=4))
    table = pq.read_table(tmp_path / "out" / "packs-00000.idx.parquet")
    runtime = [
        len(ids) - len(starts)
        for ids, starts in zip(table["input_ids"].to_pylist(), table["seq_start_id"].to_pylist(), strict=True)
    ]
    assert max(runtime) <= 200
    metadata = json.loads((tmp_path / "out" / METADATA_NAME).read_text())
    assert metadata == [
        {
            "dataset_max_seqlen": result.stats.dataset_max_length,
            "max_samples_per_bin": max(len(s) for s in table["seq_start_id"].to_pylist()),
            "packing_factor": round(result.counts["packed"] / table.num_rows, 2),
            "packing_efficiency": round(sum(runtime) / table.num_rows / 200 * 100, 2),
            "pack_size": 200,
            "min_packed_seqlen": min(runtime),
        }
    ]
    assert table.schema.field("loss_mask").type == pa.list_(pa.int8())
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["files"][0]["rows"] == table.num_rows


def long_rows() -> list[dict]:
    return [
        {"input": "short question", "output": "short answer"},
        {
            "input": "word " * 300,
            "output": "the answer is here",
        },  # the answer is beyond the cap: no supervision left
        {"input": "q", "output": "answer " * 200},  # truncated inside the answer: keeps supervision
        {"input": "another", "output": "fine"},
    ]


def test_long_samples_truncate_at_the_end_keeps_the_beginning_and_accounts(tmp_path, gpt2):
    rows = long_rows()
    source = write_jsonl(tmp_path / "long.jsonl", rows)
    no_fields = FormatConfig(truncate_fields=())  # the sample is cut at its end
    result = pack_dataset(
        [source],
        tmp_path / "out",
        PackConfig(packed_sequence_size=64, long_samples="truncate", format=no_fields),
    )
    manifest = check_round_trip(tmp_path / "out", rows, gpt2, cap=64, multiple=1)
    counts = result.counts
    assert (counts["packed"], counts["truncated"], counts["no_supervised"], counts["dropped_long"]) == (
        3,
        1,
        1,
        0,
    )
    assert manifest["excluded"] == {
        "truncated": [2],
        "truncated_by_reason": {
            "prompt_trimmed": [],
            "turns_dropped": [],
            "answer_cut": [2],
            "end_cut": [],
            "turns_kept": [],
        },
        "dropped_long": [],
        "no_supervised": [1],
        "no_supervised_after_truncation": [1],
    }
    assert (counts["no_supervised_in_source"], counts["no_supervised_after_truncation"]) == (0, 1)
    lengths = [len(expected_sample(row, gpt2)[0]) - 1 for row in rows]
    assert counts["tokens_in"] == sum(lengths)
    assert counts["tokens_packed"] == lengths[0] + 64 + lengths[3]
    assert counts["tokens_lost"] == counts["tokens_in"] - counts["tokens_packed"]
    supervised = [int(expected_sample(row, gpt2)[1][1:].sum()) for row in rows]
    assert counts["supervised_in"] == sum(supervised)
    assert counts["supervised_lost"] == supervised[1] + supervised[2] - int(
        expected_sample(rows[2], gpt2)[1][1:65].sum()
    )


def test_long_samples_drop_and_error(tmp_path, gpt2):
    rows = long_rows()
    source = write_jsonl(tmp_path / "long.jsonl", rows)
    result = pack_dataset(
        [source], tmp_path / "drop", PackConfig(packed_sequence_size=64, long_samples="drop")
    )
    assert (result.counts["packed"], result.counts["dropped_long"], result.counts["truncated"]) == (2, 2, 0)
    check_round_trip(tmp_path / "drop", rows, gpt2, cap=64, multiple=1)
    with pytest.raises(
        TightpackError,
        match=r"2 samples are longer than the cap of 64 tokens \(first: \S*long\.jsonl row 2 "
        r"\(source row 1\)",
    ):
        pack_dataset([source], tmp_path / "error", PackConfig(packed_sequence_size=64, long_samples="error"))
    assert not (tmp_path / "error").exists()
    before = write_jsonl(tmp_path / "before.jsonl", rows[:1] * 3)  # the file and its own row are named
    with pytest.raises(TightpackError, match=r"\(first: \S*long\.jsonl row 2 \(source row 4\), \d+ tokens\)"):
        pack_dataset(
            [before, source], tmp_path / "error", PackConfig(packed_sequence_size=64, long_samples="error")
        )


def test_output_is_identical_for_any_worker_count_and_run(tmp_path, chat_rows):
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows * 20)  # several chunks
    digests = []
    for run, workers in enumerate((1, 2, 4, 1)):  # the last one repeats the first
        out = tmp_path / f"out{run}"
        config = PackConfig(packed_sequence_size=512, workers=workers, algorithm="first_fit_shuffle",
                            reuse_store=False)  # fmt: skip
        assert not pack_dataset([source], out, config).reused_store
        digests.append([(p.name, p.read_bytes()) for p in sorted(out.iterdir())])
    assert digests[0] == digests[1] == digests[2] == digests[3]


def test_a_repeated_pack_reuses_the_token_store_until_an_input_changes(tmp_path, chat_rows, monkeypatch):
    monkeypatch.setenv("TIGHTPACK_CACHE", str(tmp_path / "cache"))
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    first = pack_dataset([source], tmp_path / "a", PackConfig(packed_sequence_size=256))
    again = pack_dataset([source], tmp_path / "b", PackConfig(packed_sequence_size=256))
    assert not first.reused_store and again.reused_store
    assert [p.read_bytes() for p in sorted((tmp_path / "a").iterdir())] == [
        p.read_bytes() for p in sorted((tmp_path / "b").iterdir())
    ]
    repacked = pack_dataset([source], tmp_path / "c", PackConfig(packed_sequence_size=512))  # packing only
    assert repacked.reused_store
    other_format = PackConfig(packed_sequence_size=256, format=FormatConfig(format="chat", loss_on="all"))
    assert not pack_dataset([source], tmp_path / "d", other_format).reused_store
    write_jsonl(source, chat_rows[:-1])  # the input changed
    assert not pack_dataset([source], tmp_path / "e", PackConfig(packed_sequence_size=256)).reused_store
    stores = [p for p in (tmp_path / "cache" / "stores").iterdir() if not p.name.startswith(".")]
    assert len(stores) == 3 and not list((tmp_path / "cache" / "stores").glob(".partial-*"))


def test_chat_and_auto_share_a_token_store_when_every_row_is_chat(tmp_path, chat_rows, monkeypatch):
    """``auto`` reads a row with messages as chat: on chat rows only, both make the same samples, and
    the second run reuses the first one's store, whichever came first; on rows of both kinds they do
    not, and nothing is reused across them."""
    monkeypatch.setenv("TIGHTPACK_CACHE", str(tmp_path / "cache"))
    chat, auto = (
        PackConfig(packed_sequence_size=256, format=FormatConfig(format=f)) for f in ("chat", "auto")
    )
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    made = pack_dataset([source], tmp_path / "chat", chat)
    reused = pack_dataset([source], tmp_path / "auto", auto)
    assert not made.reused_store and reused.reused_store
    shards = [
        (folder / "packs-00000.idx.parquet").read_bytes() for folder in (tmp_path / "chat", tmp_path / "auto")
    ]
    assert shards[0] == shards[1]
    other = write_jsonl(tmp_path / "other.jsonl", chat_rows[:20])
    assert not pack_dataset([other], tmp_path / "auto-first", auto).reused_store
    assert pack_dataset([other], tmp_path / "chat-second", chat).reused_store

    mixed = write_jsonl(tmp_path / "mixed.jsonl", chat_rows[:10] + [{"input": "q", "output": "a"}] * 5)
    skip = {"packed_sequence_size": 256, "skip_bad_lines": True}
    by_row = pack_dataset([mixed], tmp_path / "mixed-auto", PackConfig(**skip))
    as_chat = pack_dataset(
        [mixed], tmp_path / "mixed-chat", PackConfig(**skip, format=FormatConfig(format="chat"))
    )
    assert not as_chat.reused_store
    assert (by_row.counts["bad_rows"], as_chat.counts["bad_rows"]) == (0, 5)
    assert pack_dataset([mixed], tmp_path / "mixed-auto-again", PackConfig(**skip)).counts == by_row.counts


def test_parquet_and_dataset_inputs_and_several_files(tmp_path, gpt2, prompt_completion_rows):
    import datasets

    half = len(prompt_completion_rows) // 2
    first = write_jsonl(tmp_path / "a.jsonl", prompt_completion_rows[:half])
    second = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(prompt_completion_rows[half:]), second)
    pack_dataset([first, second], tmp_path / "files", PackConfig(packed_sequence_size=256))
    check_round_trip(tmp_path / "files", prompt_completion_rows, gpt2, cap=256, multiple=1)

    dataset = datasets.Dataset.from_list(prompt_completion_rows)
    pack_dataset(dataset, tmp_path / "dataset", PackConfig(packed_sequence_size=256))
    check_round_trip(tmp_path / "dataset", prompt_completion_rows, gpt2, cap=256, multiple=1)


def test_legacy_npy_output_matches_parquet(tmp_path, prompt_completion_rows):
    source = write_jsonl(tmp_path / "train.jsonl", prompt_completion_rows)
    pack_dataset([source], tmp_path / "pq", PackConfig(packed_sequence_size=256, pad_seq_to_mult=4))
    pack_dataset(
        [source],
        tmp_path / "npy",
        PackConfig(packed_sequence_size=256, pad_seq_to_mult=4, output_format="npy"),
    )
    parquet_rows = pq.read_table(tmp_path / "pq" / "packs-00000.idx.parquet").to_pylist()
    npy_rows = read_legacy_npy(tmp_path / "npy" / "packs.npy")
    assert len(parquet_rows) == len(npy_rows)
    for expected, got in zip(parquet_rows, npy_rows, strict=True):
        for key in ("input_ids", "loss_mask", "seq_start_id", "sample_index"):
            assert np.asarray(got[key]).tolist() == expected[key]


def test_existing_output_is_refused_then_replaced(tmp_path, prompt_completion_rows):
    source = write_jsonl(tmp_path / "train.jsonl", prompt_completion_rows)
    out = tmp_path / "out"
    pack_dataset([source], out, PackConfig(packed_sequence_size=256))
    with pytest.raises(TightpackError, match="already exists; pass overwrite=True"):
        pack_dataset([source], out, PackConfig(packed_sequence_size=256))
    pack_dataset([source], out, PackConfig(packed_sequence_size=512), overwrite=True)
    assert json.loads((out / MANIFEST_NAME).read_text())["settings"]["packed_sequence_size"] == 512
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no staging folder left"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(TightpackError, match="not a tightpack output folder"):
        pack_dataset([source], foreign, PackConfig(packed_sequence_size=256), overwrite=True)
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_bad_rows_stop_the_run_or_are_counted(tmp_path, prompt_completion_rows):
    source = tmp_path / "bad.jsonl"
    lines = [json.dumps(row) for row in prompt_completion_rows[:5]]
    lines.insert(2, '{"input": "x", "output": ')  # line 3: malformed
    lines.insert(4, json.dumps({"input": "no output key"}))  # line 5
    source.write_text("\n".join(lines) + "\n")
    with pytest.raises(TightpackError, match=r"bad\.jsonl:3: malformed JSON"):
        pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=256))
    assert not (tmp_path / "out").exists()
    config = PackConfig(packed_sequence_size=256, skip_bad_lines=True)
    result = pack_dataset([source], tmp_path / "out", config)
    assert (result.counts["samples_in"], result.counts["bad_rows"], result.counts["packed"]) == (7, 2, 5)
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert [(r["sample_index"], r["location"].split("/")[-1]) for r in manifest["bad_rows"]] == [
        (2, "bad.jsonl:3"),
        (4, "bad.jsonl:5"),
    ]
    assert "missing key 'output'" in manifest["bad_rows"][1]["reason"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"packed_sequence_size": 1}, "^packed_sequence_size must be an integer of at least 2"),
        (
            {"packed_sequence_size": 2**31},
            r"^packed_sequence_size 2147483648 exceeds 2147483647 \(2\*\*31 - 1\)",
        ),
        (
            {"packed_sequence_size": 65, "cp": 2, "pad_to_max_length": True},
            "not a multiple of the alignment multiple 4",
        ),
        (
            {"packed_sequence_size": 64, "max_seq_length": 65},
            r"^max_seq_length \(65\) must be between 1 and packed_sequence_size \(64\)$",
        ),
        (
            {"packed_sequence_size": 64, "max_seq_length": 7, "pad_seq_to_mult": 8},
            r"must be at least the effective padding multiple \(8\)",
        ),
        (
            {"packed_sequence_size": 8, "cp": 8},
            r"max_seq_length \(8\) must be at least the effective padding multiple \(16\)",
        ),
        (
            {"packed_sequence_size": 64, "pad_seq_to_mult": 4, "tp": 2},
            "either pad_seq_to_mult or tp/cp/sp",
        ),
        ({"packed_sequence_size": 64, "pad_cu_seqlens": True}, "^pad_cu_seqlens needs pad_to_max_length"),
        (
            {"packed_sequence_size": 64, "algorithm": "nope"},
            "^algorithm must be one of bfd, .*; got 'nope'",
        ),
    ],
)
def test_impossible_settings_fail_before_any_work(tmp_path, kwargs, message):
    with pytest.raises(TightpackError, match=message):
        pack_dataset([tmp_path / "missing.jsonl"], tmp_path / "out", PackConfig(**kwargs))


def test_derived_alignment_multiple_is_recorded(tmp_path, prompt_completion_rows):
    source = write_jsonl(tmp_path / "train.jsonl", prompt_completion_rows)
    pack_dataset(
        [source],
        tmp_path / "out",
        PackConfig(packed_sequence_size=256, tp=2, cp=2, sp=True, pad_to_max_length=True),
    )
    settings = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())["settings"]
    assert (settings["pad_seq_to_mult"], settings["pad_to_max_length"], settings["pad_cu_seqlens"]) == (
        4,
        True,
        False,
    )
    for sequence in read_sequences(tmp_path / "out").values():
        assert (len(sequence["tokens"]) - 1) % 4 == 0


def spec_from_backend(backend, name: str):
    from tightpack.prepare.tokenizer import _spec_from

    return _spec_from(backend, {"eos_token": "<|endoftext|>"}, name)


def test_non_byte_level_tokenizer_takes_the_offsets_path(tmp_path, chat_rows):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from tightpack.prepare.sources import default_corpus

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    chunks = itertools.islice(
        default_corpus().read(0, 512), 2
    )  # 1,024 conversations: plenty for 2,000 tokens
    corpus = (m["content"] for c in chunks for r in c.parsed_rows() for m in r["messages"])
    backend.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<|endoftext|>"])
    )
    spec = spec_from_backend(backend, "metaspace-bpe")
    assert spec.byte_level is None
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=256), tokenizer=spec)
    check_round_trip(tmp_path / "out", chat_rows, spec, cap=256, multiple=1)


def test_byte_level_chunk_whose_bytes_do_not_line_up_falls_back_to_offsets(tmp_path, gpt2):
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_str(gpt2.backend_json)
    backend.add_tokens([AddedToken("<|sep|>", lstrip=True)])  # swallows the spaces before it
    spec = spec_from_backend(backend, "gpt2+lstrip")
    assert spec.byte_level is not None
    rows = [{"input": f"question {i}   <|sep|>", "output": f"answer {i} über"} for i in range(20)]
    source = write_jsonl(tmp_path / "train.jsonl", rows)
    pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=64), tokenizer=spec)
    check_round_trip(tmp_path / "out", rows, spec, cap=64, multiple=1)
