"""`load_config`: YAML and dicts, the kinds' loader defaults, errors naming the path, the schema's ranges."""

from __future__ import annotations

import dataclasses

import pytest

from tightpack.config import DATASET_TYPES, PackedSequenceSpecs, TrainSection, load_config
from tightpack.errors import TightpackError

from .helpers import DELETE, ENERGON, GPT, OFFLINE, SFT, data, dist, merge, model, train


def test_load_from_yaml_and_dict_agree(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        """
train: {micro_batch_size: 1, global_batch_size: 32}
model:
  seq_length: 4096
  cuda_graph_impl: null
  cuda_graph_scope: [attn, mlp]
dist: {world_size: 8, eval_context_parallel_size: 2}
dataset:
  type: GPTSFTDatasetConfig
  seq_length: 4096
  hf_dataset: {path_or_dataset: squad}
  enable_offline_packing: true
  offline_packing_specs:
    packed_sequence_size: 4096
    pad_seq_to_mult: null
  dataset_kwargs: {pad_to_max_length: true}
""",
        encoding="utf-8",
    )
    from_yaml = load_config(path)
    assert from_yaml == load_config(str(path))
    expected = merge(
        OFFLINE,
        {
            "model": {"cuda_graph_impl": None, "cuda_graph_scope": ["attn", "mlp"]},
            "dist": {"eval_context_parallel_size": 2},
            "dataset": {"dataset_root": DELETE, "hf_dataset": {"path_or_dataset": "squad"},
                        "offline_packing_specs": {"pad_seq_to_mult": None}},
        },
    )  # fmt: skip
    assert from_yaml == load_config(expected)
    assert isinstance(from_yaml.dataset.offline_packing_specs, PackedSequenceSpecs)
    assert from_yaml.dataset.dataloader_type == "batch"  # the kind's default
    assert from_yaml.validation.eval_micro_batch_size is None and from_yaml.comm_overlap is None


@pytest.mark.parametrize(("kind", "loader"), [(name, cls) for name, cls in DATASET_TYPES.items()])
def test_dataset_kinds_and_their_loader_defaults(kind, loader):
    config = merge(SFT, {"dataset": {"type": kind, "dataset_root": DELETE}})
    if kind == "EnergonDatasetConfig":
        config = merge(ENERGON, {})
    elif kind == "GPTSFTDatasetConfig":
        config = SFT
    dataset = load_config(config).dataset
    assert type(dataset) is loader
    defaults = {
        "GPTSFTDatasetConfig": "batch",
        "DirectHFSFTDatasetConfig": "cyclic",
        "MockVLMSFTDatasetConfig": "single",
        "EnergonDatasetConfig": "external",
    }
    assert dataset.dataloader_type == defaults.get(kind, "single")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"train": {"micro_batch_sise": 1}},
         r"^unknown key 'micro_batch_sise' in train \(train.micro_batch_sise\); "
         r"did you mean train.micro_batch_size\?$"),
        (merge(SFT, {"train": {"seq_length": 4096}}),
         r"unknown key 'seq_length' in train .*did you mean model.seq_length or dataset.seq_length\?"),
        (merge(SFT, {"model": {"eval_context_parallel_size": 2}}),
         r"did you mean dist.eval_context_parallel_size\?"),
        (merge(OFFLINE, {"dataset": {"offline_packing_specs": {"pad_seq_to_multiple": 4}}}),
         r"in dataset.offline_packing_specs .*did you mean dataset.offline_packing_specs.pad_seq_to_mult\?"),
        (merge(SFT, {"dataset": {"pad_to_max_length": True}}),
         r"unknown key 'pad_to_max_length' in dataset \(GPTSFTDatasetConfig\).*it is a field of "
         r"DirectHFSFTDatasetConfig, EnergonDatasetConfig, MockVLMSFTDatasetConfig, "
         r"not of GPTSFTDatasetConfig.*"
         r"takes it as dataset.dataset_kwargs.pad_to_max_length"),
        (merge(SFT, data(packing_buffer_size=8)), r"it is a field of EnergonDatasetConfig, not of GPTSFT"),
        (merge(SFT, {"bogus_section": {}}),
         r"unknown key 'bogus_section' in the top level \(bogus_section\); valid keys: train, model, "),
        (merge(SFT, {"dataset": {"type": "GPTSFTDataset"}}),
         r"unknown dataset.type 'GPTSFTDataset'; did you mean 'GPTSFTDatasetConfig'\?"),
        (merge(GPT, data(type=DELETE, split=DELETE)),
         r"^dataset has no type and its fields \(seq_length\) fit 6 dataset types"),
        (merge(SFT, {"model": {"seq_length": DELETE}}), r"^missing required key model.seq_length$"),
        (merge(ENERGON, {"dataset": {"path": DELETE}}), r"^missing required key dataset.path$"),
        (merge(SFT, train(micro_batch_size=True)),
         r"^train.micro_batch_size must be an integer, got bool True$"),
        (merge(SFT, train(micro_batch_size="4")), r"train.micro_batch_size must be an integer, got str '4'"),
        (merge(SFT, model(sequence_parallel="yes")), r"model.sequence_parallel must be true or false"),
        (merge(SFT, {"model": {"cuda_graph_impl": "transformer-engine"}}),
         r"model.cuda_graph_impl must be one of none, local, transformer_engine, full_iteration, got "
         r"'transformer-engine'; did you mean 'transformer_engine'\?"),
        (merge(SFT, model(cuda_graph_scope=["attn", "mpl"])), r"model.cuda_graph_scope\[1\] must be one of"),
        (merge(SFT, model(cuda_graph_scope="attn")), r"model.cuda_graph_scope must be a list of .* or null"),
        (merge(SFT, {"dataset": {"offline_packing_specs": [4096]}}),
         r"dataset.offline_packing_specs must be a mapping or null, got list"),
        (merge(SFT, model(context_parallel_size=0)),
         r"^model.context_parallel_size must be at least 1, got 0$"),
        (merge(SFT, dist(eval_context_parallel_size=-2)),
         r"dist.eval_context_parallel_size must be at least 1, got -2"),
        (merge(SFT, {"dataset": {"dataloader_type": "batched"}}), r"did you mean 'batch'\?"),
        (merge(SFT, {"train": [1, 2]}), r"^train must be a mapping, got list"),
        ({**SFT, 3: {}}, r"non-string key 3"),
    ],
)  # fmt: skip
def test_load_errors_name_the_path(config, message):
    with pytest.raises(TightpackError, match=message):
        load_config(config)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train: [\n", r"cannot parse config .*bad.yaml as YAML: .*\(line 2, column 1\)"),
        ("", r"must be a mapping of sections .*got null"),
        ("- train\n", r"must be a mapping of sections .*got list"),
        ("train: {micro_batch_size: 1, global_batch_size: 8}\n", r"^missing required key model$"),
    ],
)
def test_yaml_file_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TightpackError, match=message):
        load_config(path)


def test_unreadable_files(tmp_path):
    with pytest.raises(TightpackError, match=r"cannot read config .*missing.yaml: No such file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(TightpackError, match=r"cannot read config"):
        load_config(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"train: caf\xe9\n")
    with pytest.raises(TightpackError, match=r"cannot read config .*latin1.yaml"):
        load_config(tmp_path / "latin1.yaml")


def test_direct_construction_checks_ranges():
    with pytest.raises(TightpackError, match=r"^TrainSection.micro_batch_size must be at least 1, got 0$"):
        TrainSection(micro_batch_size=0, global_batch_size=8)
    assert (
        dataclasses.replace(TrainSection(micro_batch_size=1, global_batch_size=8), num_epochs=2).num_epochs
        == 2
    )
