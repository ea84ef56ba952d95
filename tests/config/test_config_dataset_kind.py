"""The dataset kind: from ``dataset.type``, from a ``_target_`` class path, or inferred from the fields."""

from __future__ import annotations

import re

import pytest
import yaml

from tightpack.config import load_config, validate
from tightpack.errors import TightpackError

from .helpers import (
    DELETE,
    IN_BATCH,
    OFFLINE,
    PROVIDER,
    SFT,
    data,
    ddp,
    derived,
    merge,
    model,
    run_cli,
    specs,
    train,
    write_yaml,
)

# A configuration as Megatron-Bridge serializes it: every section names its class with _target_.
SERIALIZED = """\
_target_: megatron.bridge.training.config.ConfigContainer
comm_overlap: null
train:
  _target_: megatron.bridge.training.config.TrainingConfig
  micro_batch_size: 1
  global_batch_size: 32
model:
  _target_: megatron.bridge.models.llama.llama_provider.Llama31ModelProvider
  seq_length: 4096
  context_parallel_size: 2
  calculate_per_token_loss: true
ddp:
  _target_: megatron.bridge.training.config.DistributedDataParallelConfig
  average_in_collective: false
  use_distributed_optimizer: true
validation:
  _target_: megatron.training.config.ValidationConfig
  eval_iters: 32
dist:
  _target_: megatron.bridge.training.config.DistributedInitConfig
  world_size: 8
dataset:
  _target_: megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig
  seq_length: 4096
  dataset_root: /data/squad
  enable_offline_packing: true
  offline_packing_specs:
    _target_: megatron.bridge.data.packing.config.PackedSequenceSpecs
    packed_sequence_size: 4096
    pad_seq_to_mult: 4
  dataset_kwargs:
    pad_to_max_length: true
"""


@pytest.mark.parametrize(
    ("section", "kind", "source"),
    [
        # A field only one type has decides it.
        ({"seq_length": 4096, "hf_dataset": "squad"}, "GPTSFTDatasetConfig", "hf_dataset"),
        ({"seq_length": 4096, "split": "99,1,0"}, "GPTDatasetConfig", "split"),
        ({"seq_length": 4096, "path": "/data/wds", "micro_batch_size": 1, "task_encoder": "T"},
         "EnergonDatasetConfig", "path, micro_batch_size, task_encoder"),
        ({"seq_length": 4096, "dataset_kwargs": {}, "pad_to_multiple_of": 8, "path": "/wds",
          "micro_batch_size": 1},
         "EnergonDatasetConfig", "path, micro_batch_size"),
        # Megatron-Bridge's fields decide too; a key no kind has (cache_tag) does not.
        ({"seq_length": 4096, "data_path": ["/data/a"], "blend": None, "cache_tag": "v2"},
         "GPTDatasetConfig", "data_path, blend"),
        ({"seq_length": 4096, "hf_output_root": "/data/out"}, "GPTSFTDatasetConfig", "hf_output_root"),
        # No field is unique, but only the custom provider has both: the named fields are the combination.
        ({"seq_length": 4096, "enable_in_batch_packing": True, "offline_packing_specs": None},
         "DatasetProvider", "enable_in_batch_packing, offline_packing_specs"),
    ],
)  # fmt: skip
def test_dataset_type_inferred_from_its_fields(section, kind, source):
    config = load_config({**SFT, "dataset": section})
    assert config.dataset.type == kind
    assert validate(config).derived.dataset_type_source == f"inferred from its fields: {source}"


def test_dataset_type_source_when_given():
    assert derived(SFT).dataset_type_source == "dataset.type"
    target = {"_target_": "megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig"}
    both = merge(SFT, {"dataset": target})
    assert derived(both).dataset_type_source == "dataset.type"
    only_target = merge(both, data(type=DELETE))
    assert derived(only_target).dataset_type_source == "dataset._target_"
    assert load_config(only_target) == load_config(SFT)


def test_serialized_config_with_targets_on_every_section(tmp_path):
    path = tmp_path / "run_config.yaml"
    path.write_text(SERIALIZED, encoding="utf-8")
    config = load_config(path)
    plain = yaml.safe_load(SERIALIZED.replace("_target_:", "_dropped_:"))

    def strip(value):
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items() if key != "_dropped_"}
        return value

    plain = strip(plain)
    plain["dataset"]["type"] = "GPTSFTDatasetConfig"
    assert config == load_config(plain)
    report = validate(config)
    assert report.ok and report.findings == (), report.format()
    assert report.derived.dataset_type_source == "dataset._target_"
    result = run_cli("validate", path, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^  dataset type +GPTSFTDatasetConfig \(from dataset._target_\)$", result.stdout, re.M)


@pytest.mark.parametrize(
    "target",
    [
        "megatron.bridge.training.config.FinetuningDatasetConfig",  # the deprecated name of GPT SFT
        "megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig",
        "GPTSFTDatasetConfig",  # a bare class name
    ],
)
def test_target_names_for_gpt_sft(target):
    config = merge(SFT, data(type=DELETE, _target_=target))
    assert load_config(config).dataset.type == "GPTSFTDatasetConfig"


@pytest.mark.parametrize(
    ("target", "kind"),
    [
        ("megatron.bridge.training.config.MockGPTDatasetConfig", "GPTDatasetConfig"),
        ("megatron.bridge.training.config.GPTDatasetConfig", "GPTDatasetConfig"),
        ("megatron.bridge.data.builders.mock_vlm_sft.MockVLMSFTDatasetConfig", "MockVLMSFTDatasetConfig"),
        ("megatron.bridge.data.builders.direct_hf_sft.DirectHFSFTDatasetConfig", "DirectHFSFTDatasetConfig"),
    ],
)
def test_target_resolves_types_fields_cannot(target, kind):
    """DirectHF and MockVLM have the same fields; a class path tells them apart."""
    config = merge(SFT, data(type=DELETE, dataset_root=DELETE, _target_=target))
    assert load_config(config).dataset.type == kind


def test_custom_provider_target_with_type_dataset_provider():
    config = merge(PROVIDER, data(_target_="my_project.data.ShardedProvider"))
    assert load_config(config).dataset.type == "DatasetProvider"


@pytest.mark.parametrize(
    ("model_target"),
    [
        "megatron.bridge.models.GPTModelProvider",
        "megatron.bridge.models.qwen.qwen_provider.Qwen3MoEModelProvider",
        "megatron.bridge.models.gpt.gpt_builder.GPTModelConfig",
        "megatron.bridge.models.megatron_mimo.megatron_mimo_provider.MegatronMIMOProvider",
    ],
)
def test_model_target_accepts_any_model_provider(model_target):
    assert load_config(merge(SFT, model(_target_=model_target))) == load_config(SFT)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # Ambiguous: a Megatron-Bridge recipe override sets only the length.
        ({**SFT, "dataset": {"seq_length": 2048}},
         r"^dataset has no type and its fields \(seq_length\) fit 6 dataset types: GPTDatasetConfig, "
         r"GPTSFTDatasetConfig, DirectHFSFTDatasetConfig, EnergonDatasetConfig, MockVLMSFTDatasetConfig, "
         r"DatasetProvider; set dataset.type to the one you mean \(e.g. type: GPTDatasetConfig\) or "
         r"dataset._target_ to its class path "
         r"\(e.g. _target_: megatron.bridge.training.config.GPTDatasetConfig\)$"),
        ({**SFT, "dataset": {"seq_length": 4096, "enable_offline_packing": True,
                             "offline_packing_specs": {"packed_sequence_size": 4096}}},
         r"fields \(seq_length, enable_offline_packing, offline_packing_specs\) fit 2 dataset types: "
         r"GPTSFTDatasetConfig, DatasetProvider; set dataset.type .*\(e.g. _target_: "
         r"megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig\)$"),
        (merge(IN_BATCH, data(type=DELETE)),
         r"fit 4 dataset types: DirectHFSFTDatasetConfig, EnergonDatasetConfig, MockVLMSFTDatasetConfig, "
         r"DatasetProvider;"),
        # Fits none: every field is known, but to different types.
        (merge(SFT, data(type=DELETE, packing_buffer_size=8)),
         r"^dataset has no type and its fields fit no dataset type: dataset_root is a field of "
         r"GPTSFTDatasetConfig only, packing_buffer_size of EnergonDatasetConfig only; set dataset.type "
         r"and remove the fields it does not have$"),
        # Unknown fields are named as with a type.
        (merge(SFT, data(type=DELETE, dataset_root=DELETE, dataset_rot="/data")),
         r"^unknown key 'dataset_rot' in dataset \(dataset.dataset_rot\); no dataset type has it; did you "
         r"mean dataset.dataset_root\?$"),
        # Only the keys that look like a checked field are errors ('colour' is accepted, not checked).
        (merge(SFT, data(type=DELETE, global_batch_size=8, colour="red")),
         r"^unknown key 'global_batch_size' in dataset \(dataset.global_batch_size\); no dataset type has "
         r"it; did you mean train.global_batch_size\?$"),
        (merge(SFT, data(type=DELETE, global_batch_size=8, seq_lenght=4096)),
         r"^unknown keys 'global_batch_size', 'seq_lenght' in dataset "
         r"\(dataset.global_batch_size, dataset.seq_lenght\); no dataset type has them; did you mean "
         r"train.global_batch_size \(for global_batch_size\), dataset.seq_length \(for seq_lenght\)\?$"),
        # Inferred, then incomplete: the message says which type was inferred.
        (merge(SFT, data(type=DELETE, dataset_root=DELETE, packing_buffer_size=8)),
         r"^missing required key dataset.path \(dataset type inferred as EnergonDatasetConfig from its "
         r"fields: packing_buffer_size; set dataset.type if you meant another\)$"),
        # _target_ on the dataset.
        (merge(SFT, data(_target_="megatron.bridge.data.builders.energon.EnergonDatasetConfig")),
         r"^dataset.type 'GPTSFTDatasetConfig' and dataset._target_ "
         r"'megatron.bridge.data.builders.energon.EnergonDatasetConfig' name different dataset types "
         r"\(GPTSFTDatasetConfig, EnergonDatasetConfig\); keep the one you mean and remove the other$"),
        (merge(SFT, data(type=DELETE, _target_="megatron.bridge.data.builders.hf_dataset.HFDatasetConfig")),
         r"^unknown dataset._target_ 'megatron.bridge.data.builders.hf_dataset.HFDatasetConfig': its class "
         r"HFDatasetConfig is none of GPTDatasetConfig, GPTSFTDatasetConfig, DirectHFSFTDatasetConfig, "
         r"EnergonDatasetConfig, MockVLMSFTDatasetConfig, DatasetProvider \(or FinetuningDatasetConfig, "
         r"MockGPTDatasetConfig, GPTFIMDatasetConfig\); "
         r"for a custom provider set dataset.type: DatasetProvider$"),
        (merge(SFT, data(_target_="megatron.bridge.data.builders.gpt_sft.GPTSFTDataset")),
         r"its class GPTSFTDataset is none of .*; did you mean GPTSFTDatasetConfig\?"),
        (merge(SFT, data(type=DELETE, _target_=None)),
         r"^dataset._target_ must be a dotted class path \(e.g. megatron.bridge.data.builders.gpt_sft."
         r"GPTSFTDatasetConfig\), got null$"),
        (merge(SFT, data(type=DELETE, _target_="megatron.bridge.")),
         r"dataset._target_ must be a dotted class"),
        # _target_ on the other sections: the expected class or an error.
        (merge(SFT, train(_target_="megatron.bridge.training.config.SchedulerConfig")),
         r"^train._target_ 'megatron.bridge.training.config.SchedulerConfig' names SchedulerConfig, "
         r"but train holds Megatron-Bridge's TrainingConfig; "
         r"move the keys to their section or remove train._target_$"),
        (merge(SFT, model(_target_="megatron.bridge.data.base.DatasetProvider")),
         r"model._target_ .* names DatasetProvider, but model holds a model provider \(a class named "
         r"\*Provider or \*ModelConfig, e.g. GPTModelProvider\)"),
        (merge(OFFLINE, specs(_target_="megatron.bridge.training.config.TrainingConfig")),
         r"^dataset.offline_packing_specs._target_ .* but dataset.offline_packing_specs holds "
         r"Megatron-Bridge's PackedSequenceSpecs"),
        ({**SFT, "_target_": "megatron.bridge.training.config.TrainingConfig"},
         r"^_target_ 'megatron.bridge.training.config.TrainingConfig' names TrainingConfig, "
         r"but the top level holds Megatron-Bridge's ConfigContainer; .* or remove _target_$"),
        (merge(SFT, ddp(_target_=3)), r"^ddp._target_ must be a dotted class path .*got int 3$"),
    ],
)  # fmt: skip
def test_dataset_type_and_target_errors(config, message):
    with pytest.raises(TightpackError, match=message):
        load_config(config)


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ({"seq_length": 2048},
         "error: dataset has no type and its fields (seq_length) fit 6 dataset types: "),
        ({"type": "GPTSFTDatasetConfig", "_target_": "x.EnergonDatasetConfig", "seq_length": 4096},
         "error: dataset.type 'GPTSFTDatasetConfig' and dataset._target_ 'x.EnergonDatasetConfig' name "),
        ({"_target_": "x.HFDatasetConfig", "seq_length": 4096},
         "error: unknown dataset._target_ 'x.HFDatasetConfig'"),
    ],
)  # fmt: skip
def test_cli_dataset_type_errors_exit_2(tmp_path, dataset, message):
    path = write_yaml(tmp_path / "override.yaml", {**SFT, "dataset": dataset})
    result = run_cli("validate", path, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr
