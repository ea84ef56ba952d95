"""Keys tightpack does not read: Megatron-Bridge's other sections and fields are accepted, typos are not."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tightpack.config import load_config, validate
from tightpack.errors import TightpackError

from .helpers import (
    DELETE,
    GPT,
    OFFLINE,
    PROVIDER,
    README_EXAMPLE,
    SFT,
    data,
    ddp,
    dist,
    evals,
    merge,
    model,
    rule_ids,
    run_cli,
    specs,
    write_yaml,
)

# A training configuration as Megatron-Bridge 067f987 serializes it (ConfigContainer.to_yaml: sorted keys, a
# _target_ on every dataclass, enums, dtypes and functions as _target_ mappings), trimmed to a few fields per
# section but with the model's full variety. Offline packed SFT with TP=2, CP=2, SP:
# k = lcm(2*CP, CP*TP) = 4, DP = 16 / (TP*CP) = 4, 32 / (1*4) = 8 micro-batches per step;
# pad_seq_to_mult 1 breaks T2 (an error with CP).
MB_SERIALIZED = """\
_target_: megatron.bridge.training.config.ConfigContainer
checkpoint:
  _target_: megatron.bridge.training.config.CheckpointConfig
  async_save: false
  ckpt_format: torch_dist
  load: null
  pretrained_checkpoint: /ckpt/gemma3-1b
  save: /results/checkpoints
  save_interval: 200
comm_overlap: null
dataset:
  _target_: megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig
  data_sharding: true
  dataloader_type: batch
  dataset_kwargs:
    pad_to_max_length: true
  dataset_root: /data/squad
  do_test: true
  do_validation: true
  enable_offline_packing: true
  hf_output_root: null
  memmap_workers: 1
  num_workers: 8
  offline_packing_specs:
    _target_: megatron.bridge.data.packing.config.PackedSequenceSpecs
    packed_sequence_size: 4096
    pad_cu_seqlens: false
    pad_seq_to_mult: 1
    tokenizer_model_name: google/gemma-3-1b-pt
  seed: 1234
  seq_length: 4096
ddp:
  _target_: megatron.bridge.training.config.DistributedDataParallelConfig
  average_in_collective: false
  bucket_size: null
  check_for_nan_in_grad: true
  data_parallel_sharding_strategy: no_shard
  grad_reduce_in_fp32: true
  overlap_grad_reduce: true
  overlap_param_gather: true
  use_distributed_optimizer: true
  use_megatron_fsdp: false
dist:
  _target_: megatron.bridge.training.config.DistributedInitConfig
  distributed_backend: nccl
  distributed_timeout_minutes: 10
  eval_context_parallel_size: null
  external_gpu_device_mapping: false
  use_megatron_fsdp: false
  use_torch_fsdp2: false
  world_size: 16  # tightpack's: Megatron-Bridge takes the world size from the launcher
env_vars: {}
ft: null
inprocess_restart: null
logger:
  _target_: megatron.bridge.training.config.LoggerConfig
  log_interval: 10
  tensorboard_dir: /results/tb
  wandb_project: null
mixed_precision:
  _target_: megatron.bridge.training.mixed_precision.MixedPrecisionConfig
  bf16: true
  params_dtype:
    _call_: false
    _target_: torch.bfloat16
model:
  _target_: megatron.bridge.models.gemma.gemma3_provider.Gemma3ModelProvider
  activation_func:
    _call_: false
    _target_: megatron.bridge.models.gemma.gemma_provider.fast_gelu
  add_bias_linear: false
  attention_backend:
    _args_:
    - 5
    _call_: true
    _name_: auto
    _target_: megatron.core.transformer.enums.AttnBackend
  attention_dropout: 0.0
  bf16: true
  calculate_per_token_loss: true
  context_parallel_size: 2
  cuda_graph_impl: none
  cuda_graph_modules: []
  cuda_graph_scope: null
  cuda_graph_warmup_steps: 3
  delay_wgrad_compute: false
  expert_model_parallel_size: 1
  expert_tensor_parallel_size: null
  ffn_hidden_size: 6912
  gated_linear_unit: true
  hidden_dropout: 0.0
  hidden_size: 1152
  interleaved_attn_pattern:
  - 5
  - 1
  is_vision_language: false
  kv_channels: 256
  make_vocab_size_divisible_by: 128
  mtp_num_layers: null
  normalization: RMSNorm
  num_attention_heads: 4
  num_layers: 26
  num_moe_experts: null
  num_query_groups: 1
  overlap_moe_expert_parallel_comm: false
  params_dtype:
    _call_: false
    _target_: torch.bfloat16
  pipeline_model_parallel_layout: null
  pipeline_model_parallel_size: 1
  position_embedding_type: rope
  rotary_base: 1000000
  seq_length: 4096
  sequence_parallel: true
  share_embeddings_and_output_weights: true
  tensor_model_parallel_size: 2
  virtual_pipeline_model_parallel_size: null
  vocab_size: 262144
  window_size:
  - 512
  - 0
nvrx_straggler: null
optimizer:
  _target_: megatron.bridge.training.config.OptimizerConfig
  adam_beta1: 0.9
  adam_beta2: 0.98
  bf16: true
  clip_grad: 1.0
  lr: 5.0e-06
  optimizer: adam
  use_distributed_optimizer: true
  weight_decay: 0.01
optimizer_config_override_provider:
  _target_: megatron.bridge.training.config.OptimizerConfigOverrideProvider
peft: null
profiling:
  _target_: megatron.bridge.training.config.ProfilingConfig
  profile_ranks:
  - 0
  use_nsys_profiler: false
rerun_state_machine:
  _target_: megatron.bridge.training.config.RerunStateMachineConfig
  rerun_mode: disabled
rng:
  _target_: megatron.training.config.common_config.RNGConfig
  seed: 1234
  te_rng_tracker: false
scheduler:
  _target_: megatron.bridge.training.config.SchedulerConfig
  lr_decay_style: cosine
  lr_warmup_iters: 50
  min_lr: 5.0e-07
straggler: null
tensor_inspect: null
tokenizer:
  _target_: megatron.bridge.training.tokenizers.config.TokenizerConfig
  tokenizer_model: google/gemma-3-1b-pt
  tokenizer_type: HuggingFaceTokenizer
train:
  _target_: megatron.bridge.training.config.TrainingConfig
  eval_interval: null
  eval_iters: null
  exit_signal:
    _args_:
    - 15
    _call_: true
    _name_: SIGTERM
    _target_: signal.Signals
  global_batch_size: 32
  manual_gc: true
  manual_gc_interval: 100
  micro_batch_size: 1
  num_epochs: null
  rampup_batch_size: null
  train_iters: 1000
  train_samples: null
validation:
  _target_: megatron.training.config.training_config.ValidationConfig
  eval_global_batch_size: null
  eval_interval: 100
  eval_iters: 32
  eval_micro_batch_size: null
  full_validation: false
  skip_train: false
"""
# The Megatron-Bridge sections tightpack does not model, in file order; and the model keys it reads.
MB_OTHER_SECTIONS = [
    "checkpoint", "env_vars", "ft", "inprocess_restart", "logger", "mixed_precision", "nvrx_straggler",
    "optimizer", "optimizer_config_override_provider", "peft", "profiling", "rerun_state_machine", "rng",
    "scheduler", "straggler", "tensor_inspect", "tokenizer",
]  # fmt: skip
MODEL_KEYS_READ = {
    "_target_", "calculate_per_token_loss", "context_parallel_size", "cuda_graph_impl", "cuda_graph_scope",
    "delay_wgrad_compute", "expert_model_parallel_size", "mtp_num_layers", "num_moe_experts",
    "overlap_moe_expert_parallel_comm", "pipeline_model_parallel_size", "seq_length", "sequence_parallel",
    "tensor_model_parallel_size",
}  # fmt: skip


def test_megatron_bridge_serialized_config_gets_the_packing_report(tmp_path):
    path = tmp_path / "run_config.yaml"
    path.write_text(MB_SERIALIZED, encoding="utf-8")
    report = validate(load_config(path))
    assert rule_ids(report) == ["T2"], report.format()
    assert report.errors[0].reason.startswith(
        "offline_packing_specs.pad_seq_to_mult (1) is not a multiple of 4"
    )
    assert (report.derived.alignment_multiple, report.derived.micro_batches_per_step) == (4, 8)
    assert report.derived.dataset_type_source == "dataset._target_"

    skipped = report.not_checked
    assert [key for key in skipped if "." not in key] == MB_OTHER_SECTIONS
    model_keys = [key.removeprefix("model.") for key in skipped if key.startswith("model.")]
    # Every model key but the 14 read (42 in all), the fields of Gemma3ModelProvider alone
    # (interleaved_attn_pattern, is_vision_language) included: the _target_ names a provider.
    assert model_keys == [key for key in yaml.safe_load(MB_SERIALIZED)["model"] if key not in MODEL_KEYS_READ]
    assert len(model_keys) == 28
    assert "interleaved_attn_pattern" in model_keys and "cuda_graph_modules" in model_keys
    others = [key for key in skipped if key not in MB_OTHER_SECTIONS and not key.startswith("model.")]
    assert others == [  # in file order
        "dataset.hf_output_root",
        "ddp.bucket_size", "ddp.data_parallel_sharding_strategy", "ddp.use_megatron_fsdp",
        "dist.distributed_backend", "dist.distributed_timeout_minutes", "dist.external_gpu_device_mapping",
        "dist.use_megatron_fsdp", "dist.use_torch_fsdp2",
        "train.eval_interval", "train.eval_iters", "train.exit_signal", "train.manual_gc",
        "train.manual_gc_interval", "train.rampup_batch_size", "train.train_samples",
        "validation.full_validation", "validation.skip_train",
    ]  # fmt: skip
    assert len(skipped) == 17 + 28 + 18

    result = run_cli("validate", path, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(
        r"^  T2 +offline_packing_specs.pad_seq_to_mult \(1\) is not a multiple of 4", result.stdout, re.M
    )
    notes = [line for line in result.stdout.splitlines() if "not checked" in line]
    assert notes == [
        "not checked by tightpack: " + ", ".join(MB_OTHER_SECTIONS) + ", dataset.hf_output_root, "
        "ddp.bucket_size, ddp.data_parallel_sharding_strategy, ddp.use_megatron_fsdp, 5 keys of dist, "
        "28 keys of model, 7 keys of train, validation.full_validation, validation.skip_train (63 keys)"
    ]
    assert result.stdout.splitlines()[-1] == "result: invalid (1 error, 0 warnings)"
    assert result.stderr == ""

    as_json = run_cli("validate", path, "--json", cwd=tmp_path)
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["not_checked"] == list(skipped)

    clean = write_yaml(
        tmp_path / "clean.yaml",
        yaml.safe_load(MB_SERIALIZED.replace("pad_seq_to_mult: 1", "pad_seq_to_mult: 4")),
    )
    result = run_cli("validate", clean, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sum("not checked by tightpack: checkpoint, " in line for line in result.stdout.splitlines()) == 1
    assert result.stdout.splitlines()[-1] == "result: ok (0 errors, 0 warnings)"


def test_recipe_override_with_megatron_bridge_keys_validates(tmp_path):
    """A recipe override has no _target_: Megatron-Bridge's fields are accepted, even near a checked one."""
    override = merge(
        yaml.safe_load(README_EXAMPLE),
        {
            "model": {"hidden_size": 4096, "num_layers": 32, "expert_tensor_parallel_size": 1,
                      "virtual_pipeline_model_parallel_size": None, "vision_cuda_graph_scope": [],
                      "tp_size": 2},  # not Megatron-Bridge's, and not near a checked field: not checked
            "train": {"eval_iters": 10, "exit_interval": 900},
            "dist": {"use_megatron_fsdp": False},
            "optimizer": {"lr": 1.0e-5, "weight_decay": 0.01},
            "scheduler": {"lr_warmup_iters": 50},
            "logger": {"log_interval": 10},
            "checkpoint": {"save": "/results/ckpt", "save_interval": 200},
        },
    )  # fmt: skip
    path = write_yaml(tmp_path / "override.yaml", override)
    report = validate(load_config(path))
    assert report.ok and report.findings == (), report.format()
    assert report.not_checked == (  # in file order: README_EXAMPLE's sections, then the new ones
        "model.hidden_size", "model.num_layers", "model.expert_tensor_parallel_size",
        "model.virtual_pipeline_model_parallel_size", "model.vision_cuda_graph_scope", "model.tp_size",
        "train.eval_iters", "train.exit_interval", "dist.use_megatron_fsdp",
        "optimizer", "scheduler", "logger", "checkpoint",
    )  # fmt: skip
    result = run_cli("validate", path, "--config-only", cwd=tmp_path)  # its packs are not on this machine
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-3:] == [
        "not checked by tightpack: optimizer, scheduler, logger, checkpoint, 6 keys of model, "
        "train.eval_iters, train.exit_interval, dist.use_megatron_fsdp (13 keys)",
        "packed data: not checked (--config-only)",
        "result: ok (0 errors, 0 warnings)",
    ]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # A typo of a checked field, in every modelled section: an error naming the closest field.
        (merge(SFT, {"model": {"seq_length": DELETE, "seq_lenght": 4096, "hidden_size": 4096}}),
         r"^unknown key 'seq_lenght' in model \(model.seq_lenght\); did you mean model.seq_length\?$"),
        (merge(SFT, model(tensor_parallel_size=2)),  # not Megatron-Bridge's spelling either
         r"^unknown key 'tensor_parallel_size' in model .*did you mean model.tensor_model_parallel_size\?$"),
        (merge(SFT, model(context_paralel_size=2)), r"did you mean model.context_parallel_size\?$"),
        (merge(SFT, ddp(average_in_colective=False)), r"did you mean ddp.average_in_collective\?$"),
        (merge(SFT, dist(eval_context_paralel_size=2)), r"did you mean dist.eval_context_parallel_size\?$"),
        (merge(SFT, evals(eval_micro_batch_sise=1)), r"did you mean validation.eval_micro_batch_size\?$"),
        (merge(SFT, data(seq_lenght=4096)),
         r"^unknown key 'seq_lenght' in dataset \(GPTSFTDatasetConfig\) \(dataset.seq_lenght\); "
         r"did you mean dataset.seq_length\?$"),
        (merge(SFT, data(enable_offline_packng=True)), r"did you mean dataset.enable_offline_packing\?$"),
        (merge(OFFLINE, specs(packed_sequence_sise=4096)),
         r"did you mean dataset.offline_packing_specs.packed_sequence_size\?$"),
        (merge(SFT, {"comm_overlap": {"overlap_moe_expert_parallel_com": True}}),
         r"did you mean comm_overlap.overlap_moe_expert_parallel_comm\?$"),
        (merge(PROVIDER, data(enable_in_batch_packng=True)),
         r"in dataset \(DatasetProvider\) .*did you mean dataset.enable_in_batch_packing\?$"),
        # Top level: a closed list of sections, so a stray name is an error.
        (merge(SFT, {"optimiser": {"lr": 1e-5}}),
         r"^unknown key 'optimiser' in the top level \(optimiser\); did you mean optimizer\?$"),
        (merge(SFT, {"bogus_section": {}}),
         r"valid keys: train, .*, dist_train, and Megatron-Bridge's other sections, which tightpack does not "
         r"check: checkpoint, env_vars, "),
    ],
)  # fmt: skip
def test_typos_of_checked_fields_are_still_errors(config, message):
    with pytest.raises(TightpackError, match=message):
        load_config(config)


@pytest.mark.parametrize(
    ("config", "paths"),
    [
        # Far from every checked field: a newer Megatron-Core field, or one Megatron-Bridge will reject.
        (merge(SFT, model(tp_size=2)), ("model.tp_size",)),
        (merge(SFT, ddp(megatron_fsdp_new_option=True)), ("ddp.megatron_fsdp_new_option",)),
        # Megatron-Bridge's own fields, though near a checked one or a field tightpack reads elsewhere.
        (merge(SFT, model(expert_tensor_parallel_size=2)), ("model.expert_tensor_parallel_size",)),
        (merge(GPT, data(context_parallel_size=1)), ("dataset.context_parallel_size",)),
        # A custom provider's own fields, named like fields of train or the Energon kind.
        (merge(PROVIDER, data(global_batch_size=32, path="/data/wds", packing_buffer_size=8)),
         ("dataset.global_batch_size", "dataset.path", "dataset.packing_buffer_size")),
        # A model with a provider _target_ (a serialized file) accepts any key, as its class defines them.
        (merge(SFT, model(_target_="megatron.bridge.models.gpt_provider.GPTModelProvider", seq_lenght=4096)),
         ("model.seq_lenght",)),
        # An untyped dataset: keys no kind has and far from the checked ones do not decide the kind.
        (merge(SFT, data(type=DELETE, cache_tag="v2")), ("dataset.cache_tag",)),
    ],
)  # fmt: skip
def test_keys_accepted_without_checking(config, paths):
    loaded = load_config(config)
    assert loaded.not_checked == paths
    assert validate(loaded).not_checked == paths


def test_config_built_in_python_has_nothing_unchecked():
    config = load_config(SFT)
    assert config.not_checked == ()
    assert "not checked" not in validate(config).format()
    assert validate(config).to_dict()["not_checked"] == []
