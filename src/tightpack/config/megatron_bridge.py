"""Megatron-Bridge's names: what tightpack accepts without reading it, and the classes ``_target_`` names.

The sections and fields of Megatron-Bridge's classes that tightpack does not model (rules 2 and 3 of
`tightpack.config.loading`), the class each section's ``_target_`` names, and the other class names of the
dataset kinds. The lists lag Megatron-Core releases, so `loading` also accepts an unknown key that is far from
every field tightpack reads (rule 5).
"""

from __future__ import annotations

from tightpack.config.schema import (
    CommOverlapSection,
    DDPSection,
    DirectHFSFTDatasetConfig,
    DistSection,
    DistTrainSection,
    GPTDatasetConfig,
    GPTSFTDatasetConfig,
    MockVLMSFTDatasetConfig,
    ModelSection,
    PackedSequenceSpecs,
    RunConfig,
    TrainSection,
    ValidationSection,
)

# The Megatron-Bridge class of each section, as the ``_target_`` of a serialized configuration names it.
SECTION_TARGETS: dict[type, str] = {
    RunConfig: "ConfigContainer",
    TrainSection: "TrainingConfig",
    DDPSection: "DistributedDataParallelConfig",
    ValidationSection: "ValidationConfig",
    DistSection: "DistributedInitConfig",
    CommOverlapSection: "CommOverlapConfig",
    DistTrainSection: "DistTrainConfig",
    PackedSequenceSpecs: "PackedSequenceSpecs",
}
# ``model`` is one of many classes: GPTModelProvider and its per-family subclasses (Llama31ModelProvider,
# ...), MegatronMIMOProvider, the builder configs GPTModelConfig and HybridModelConfig.
MODEL_TARGET_SUFFIXES = ("Provider", "ModelConfig")
# Other class names a ``_target_`` gives the kinds: GPT SFT's deprecated name, and the pretraining subclasses,
# which the reference's checks (isinstance) treat as their parent.
DATASET_ALIASES = {
    "FinetuningDatasetConfig": GPTSFTDatasetConfig.type,
    "MockGPTDatasetConfig": GPTDatasetConfig.type,
    "GPTFIMDatasetConfig": GPTDatasetConfig.type,
}


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Megatron-Bridge's ConfigContainer sections that tightpack does not model (rule 2), and per modelled section
# the fields of its Megatron-Bridge class that tightpack does not model (rule 3): the dataclass fields,
# inherited ones included, of Megatron-Bridge 067f987 with the Megatron-LM it pins (2a75ac1). ``model``:
# GPTModelProvider with Megatron-Core's TransformerConfig, MLATransformerConfig and ModelParallelConfig, the
# other ConfigContainer model classes (HybridModelProvider, T5ModelProvider, MegatronMIMOProvider,
# GPTModelConfig, HybridModelConfig), and the Qwen-VL providers' vision CUDA-graph scope and DistTrain.
# GPTDatasetConfig includes its MockGPT and FIM subclasses; the other kinds have no field tightpack lacks.
MB_SECTIONS = _names(
    """
    checkpoint env_vars ft inprocess_restart logger mixed_precision nvrx_straggler optimizer
    optimizer_config_override_provider peft profiling rerun_state_machine rng scheduler straggler
    tensor_inspect tokenizer
    """
)
MB_FIELDS: dict[type, frozenset[str]] = {
    TrainSection: _names(
        """
        check_optimizer_step_success check_weight_hash_across_dp_replicas_interval
        decrease_batch_size_if_needed empty_unused_memory_level eval_interval eval_iters
        exit_duration_in_mins exit_interval exit_signal exit_signal_handler
        exit_signal_handler_for_dataloader exit_signal_handler_for_training gpu_sniff_test_interval
        iterations_to_skip manual_gc manual_gc_eval manual_gc_interval rampup_batch_size
        skip_sync_grad_norm_across_mp skip_train step_batch_size_schedule train_samples
        train_sync_interval
        """
    ),
    ModelSection: _names(
        """
        account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split activation_func
        activation_func_clamp_value activation_func_fp8_input_store activation_offload_fraction
        add_bias_linear add_qkv_bias apply_query_key_layer_scaling
        apply_residual_connection_post_layernorm apply_rope_fusion attention_backend attention_dropout
        attention_output_gate attention_softmax_in_fp32 autocast_dtype barrier_with_L1_time
        batch_invariant_mode batch_p2p_comm batch_p2p_sync beta_fast beta_slow bf16
        bias_activation_fusion bias_dropout_fusion cache_mla_latents clone_scatter_output_in_embedding
        config_logger_dir cp_comm_type cpu_offloading cpu_offloading_activations
        cpu_offloading_double_buffering cpu_offloading_num_layers
        cpu_offloading_retain_pinned_cpu_buffers cpu_offloading_weights cross_entropy_fusion_impl
        cross_entropy_loss_fusion cuda_graph_modules cuda_graph_retain_backward_graph
        cuda_graph_use_single_mempool cuda_graph_warmup_steps deallocate_pipeline_outputs
        defer_embedding_wgrad_compute delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks
        dense_grouped_gemm deterministic_mode disable_bf16_reduced_precision_matmul
        disable_parameter_transpose_cache dist_train distribute_saved_activations dsa_indexer_head_dim
        dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32 dsa_indexer_loss_coeff dsa_indexer_n_heads
        dsa_indexer_rope_interleaved dsa_indexer_rotate_activation dsa_indexer_scoring_relu
        dsa_indexer_skip_topk_offset dsa_indexer_topk dsa_indexer_topk_freq dsa_indexer_use_sparse_loss
        dsa_kernel_backend embedding_init_method embedding_init_method_std enable_autocast
        enable_cuda_graph encoder_num_layers encoder_pipeline_model_parallel_size
        ep_overlap_early_attn_memory_release experimental_attention_variant
        experimental_attention_variant_loss_scale_func expert_gtp_weight_remat_size
        expert_tensor_parallel_num_weight_shards expert_tensor_parallel_size external_cuda_graph
        extra_checkpoint_metadata ffn_hidden_size finalize_model_grads_func
        fine_grained_activation_offloading fine_grained_offloading_max_inflight_offloads
        first_last_layers_bf16 flash_attention_version flash_decode fp16 fp16_lm_cross_entropy
        fp32_residual_connection fp4 fp4_param fp4_quantizer_factory fp4_recipe fp8
        fp8_amax_compute_algo fp8_amax_history_len fp8_dot_product_attention fp8_interval fp8_margin
        fp8_multi_head_attention fp8_output_proj fp8_param fp8_quantizer_factory fp8_recipe fp8_wgrad
        freeze_language_model freeze_modality_encoders freeze_modality_projections
        fused_residual_rmsnorm fused_single_qkv_rope gated_linear_unit gdp_num_householder
        glu_linear_offset grad_scale_func grad_sync_func gradient_accumulation_fusion
        gtp_remat_opt_in_modules gtp_weight_remat_size hetereogenous_dist_checkpoint
        heterogeneous_block_specs hf_model_id hf_model_revision hidden_dropout hidden_size
        hierarchical_context_parallel_sizes high_priority_a2a_comm_stream hybrid_attention_ratio
        hybrid_context_parallel hybrid_layer_pattern hybrid_mlp_ratio hybrid_override_pattern
        hybrid_stack_spec inference_cuda_graph_scope inference_disable_triton_nvls_kernels
        inference_fuse_tp_communication inference_grouped_gemm_backend
        inference_moe_disable_fused_quant_kernels inference_moe_token_dispatcher_type
        inference_rng_tracker inference_sampling_seed init_method init_method_std
        init_model_with_meta_device is_hybrid_model keep_mtp_spec_in_bf16 kitchen_attention_backend
        kv_channels kv_lora_rank language_model_spec layernorm_epsilon layernorm_zero_centered_gamma
        linear_attention_freq linear_conv_kernel_dim linear_key_head_dim linear_num_key_heads
        linear_num_value_heads linear_value_head_dim log_max_attention_logit logit_dtype
        make_vocab_size_divisible_by mamba_chunk_size mamba_head_dim mamba_num_groups mamba_num_heads
        mamba_state_dim mamba_training_ssm_states_dtype masked_softmax_fusion max_position_embeddings
        max_seqlen_per_dp_cp_rank megatron_mimo_parallelism_config memory_efficient_layer_norm
        microbatch_group_size_per_vp_stage min_offloaded_tensor_size mla_down_proj_fusion
        mlp_chunks_for_prefill mlp_chunks_for_training modality_submodules_spec module_output_ndim
        moe_apply_probs_on_input moe_aux_loss_coeff moe_deepep_num_sms moe_enable_deepep
        moe_enable_routing_replay moe_expert_capacity_factor moe_expert_rank_capacity_factor
        moe_ffn_hidden_size moe_flex_dispatcher_backend moe_flex_dispatcher_num_sms moe_grad_scale_func
        moe_grouped_gemm moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute
        moe_hybridep_num_sms moe_hybridep_num_sms_preprocessing moe_hybridep_pad_uneven_dispatch_inputs
        moe_input_jitter_eps moe_latent_size moe_layer_freq moe_layer_recompute
        moe_mlp_glu_interleave_size moe_ncclep_zero_copy moe_pad_expert_input_to_capacity
        moe_pad_experts_for_cuda_graph_inference moe_paged_stash moe_paged_stash_buffer_size_factor_cpu
        moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_page_size moe_per_layer_logging
        moe_permute_fusion moe_permute_fusion_into_hybridep moe_router_bias_update_rate moe_router_dtype
        moe_router_enable_expert_bias moe_router_force_biased moe_router_force_load_balancing
        moe_router_fusion moe_router_group_topk moe_router_load_balancing_type moe_router_num_groups
        moe_router_padding_for_fp8 moe_router_padding_for_quantization moe_router_pre_softmax
        moe_router_quantile_balancing_ema moe_router_score_function moe_router_topk
        moe_router_topk_limited_devices moe_router_topk_scaling_factor moe_shared_expert_gate
        moe_shared_expert_glu_interleave_size moe_shared_expert_intermediate_size
        moe_shared_expert_overlap moe_single_grouped_bias moe_single_grouped_weight
        moe_token_dispatcher_type moe_token_drop_policy moe_token_dropping moe_z_loss_coeff
        mrope_section mscale mscale_all_dim mtp_detach_heads mtp_enabled mtp_grad_scale_func
        mtp_hybrid_override_pattern mtp_loss_scaling_factor mtp_standalone mtp_use_repeated_layer
        multi_latent_attention mup_attn_scale_power mup_base_head_dim mup_base_hidden_size
        mup_embedding_mult mup_output_mult mup_width_mult nccl_all_reduce_for_prefill no_rope_freq
        no_sync_func normalization num_attention_heads num_layers num_layers_at_end_in_bf16
        num_layers_at_start_in_bf16 num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage
        num_microbatches_with_partial_activation_checkpoints num_query_groups offload_modules
        original_max_position_embeddings output_layer_init_method
        overlap_dispatch_backward_with_experts_wgrad overlap_p2p_comm overlap_p2p_comm_warmup_flush
        parallel_output param_sync_func params_dtype perform_initialization persist_layer_norm
        pipeline_dtype pipeline_model_parallel_comm_backend pipeline_model_parallel_layout
        position_embedding_type post_wrap_hooks pre_wrap_hooks q_lora_rank qk_clip qk_clip_alpha
        qk_clip_threshold qk_head_dim qk_l2_norm qk_layernorm qk_pos_emb_head_dim quant_recipe
        recompute_granularity recompute_method recompute_modules recompute_num_layers
        relative_attention_max_distance relative_attention_num_buckets restore_modelopt_state
        rope_scaling rope_scaling_factor rope_type rotary_base rotary_interleaved rotary_percent
        rotary_scaling_factor scatter_embedding_sequence_parallel seq_len_interpolation_factor
        seq_length_dec share_embeddings_and_output_weights should_pad_vocab softmax_scale softmax_type
        special_token_ids standard_provider symmetric_ar_type tensor_parallel_num_weight_shards
        test_mode timers topology tp_comm_atomic_ag tp_comm_atomic_rs tp_comm_bootstrap_backend
        tp_comm_bulk_dgrad tp_comm_bulk_wgrad tp_comm_overlap tp_comm_overlap_ag tp_comm_overlap_cfg
        tp_comm_overlap_disable_fc1 tp_comm_overlap_disable_qkv tp_comm_overlap_rs
        tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs tp_only_amax_red transformer
        transformer_impl transformer_layer_spec use_arbitrary_attention_mask use_cpu_initialization
        use_fused_weighted_squared_relu use_grouped_gemm_for_dense_mlp
        use_grouped_gemm_for_shared_expert use_inference_optimized_layers use_kitchen
        use_kitchen_attention use_mamba_mem_eff_path use_mup use_ring_exchange_p2p
        use_te_activation_func use_te_rng_tracker use_transformer_engine_full_layer_spec
        use_transformer_engine_op_fuser v_head_dim variable_seq_lengths
        virtual_pipeline_model_parallel_size vision_cuda_graph_scope vocab_size wgrad_deferral_limit
        window_attn_skip_freq window_size yarn_beta_fast yarn_beta_slow
        yarn_correction_range_round_to_int yarn_mscale yarn_mscale_all_dim
        yarn_original_max_position_embeddings yarn_rotary_scaling_factor
        """
    ),
    DDPSection: _names(
        """
        align_param_gather bucket_size check_for_large_grads data_parallel_sharding_strategy
        delay_wgrad_compute disable_symmetric_registration fp4_param_gather fp8_param_gather
        fsdp_all_gather_in_start_param_sync fsdp_db_use_persist_buf_on_alloc_fail fsdp_double_buffer
        fsdp_manual_registration gradient_reduce_div_fusion keep_fp8_transpose_cache
        megatron_fsdp_cuda_graph_mode megatron_fsdp_enable_fine_grained_param_gather
        megatron_fsdp_grad_comm_dtype megatron_fsdp_main_grads_dtype megatron_fsdp_main_params_dtype
        megatron_fsdp_max_pool_double_buffer megatron_fsdp_use_decoupled_grad megatron_fsdp_version
        nccl_ub num_buckets num_distributed_optimizer_instances outer_dp_sharding_strategy
        pad_buckets_for_high_nccl_busbw param_name_patterns_for_fp32_local_accumulation
        reduce_scatter_with_fp32_accumulation reuse_grad_buf_for_mxfp8_param_ag
        suggested_communication_unit_size use_custom_fsdp use_megatron_fsdp
        """
    ),
    ValidationSection: _names(
        """
        full_validation multiple_validation_sets skip_train start_eval_at_iter test_mode
        validation_set_names
        """
    ),
    DistSection: _names(
        """
        align_grad_reduce disable_jit_fuser distributed_backend distributed_timeout_minutes
        distributed_timeout_seconds_after_init enable_megatron_core_experimental
        external_gpu_device_mapping flight_recorder_dump_on_timeout flight_recorder_dump_path
        flight_recorder_extra_dump_on_exec flight_recorder_include_only_active
        flight_recorder_include_stack_trace flight_recorder_trace_buffer_size
        high_priority_stream_groups lazy_mpu_init local_rank nccl_communicator_config_path
        sharp_enabled_group use_decentralized_pg use_gloo_process_groups use_megatron_fsdp use_sharp
        use_torch_fsdp2 use_tp_pp_dp_mapping
        """
    ),
    CommOverlapSection: _names(
        """
        align_param_gather batch_p2p_comm bucket_size data_parallel_size defer_embedding_wgrad_compute
        overlap_grad_reduce overlap_p2p_comm overlap_param_gather
        overlap_param_gather_with_optimizer_step tp_comm_bootstrap_backend tp_comm_overlap_cfg
        wgrad_deferral_limit
        """
    ),
    GPTDatasetConfig: _names(
        """
        add_extra_token_to_sequence allow_ambiguous_pad_tokens blend blend_per_split
        context_parallel_size create_attention_mask data_parallel_size data_path defer_npy_index_mmap
        drop_last_partial_validation_sequence fast_cache_load fim_extra_tokens fim_fragment_rate
        fim_no_prefix fim_rate fim_split_sample fim_spm_rate full_validation hybrid_context_parallel
        inter_document_masking mid_level_dataset_surplus mmap_bin_files multiple_validation_sets
        num_dataset_builder_threads object_storage_cache_path path_to_cache per_dataset_sequences_path
        sequence_length sequence_parallel_size sequences_per_dataset tokenizer
        """
    ),
    GPTSFTDatasetConfig: _names(
        """
        hf_output_root hf_test_dataset hf_validation_dataset hf_validation_proportion
        """
    ),
    DirectHFSFTDatasetConfig: _names(
        """
        blend_seed hf_processor_kwargs hf_processor_path preprocessing
        skip_getting_attention_mask_from_dataset source source_weights test_source validation_source
        """
    ),
    MockVLMSFTDatasetConfig: _names(
        """
        hf_processor_path image_size num_base_examples num_images prompt random_seed
        skip_getting_attention_mask_from_dataset
        """
    ),
}
