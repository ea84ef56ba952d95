"""`check_mcore_packing` on a real Megatron-Core ``GPTModel`` (CPU, one gloo rank).

Megatron-Core's own CPU attention (``DotProductAttention``) refuses ``PackedSeqParams``; the THD kernel
is Transformer Engine's, which needs CUDA. The model here takes Megatron-Core's local layer spec with a
small varlen core attention in its place (what a THD kernel computes: causal attention within each
``cu_seqlens_q`` segment), and the same attention blind to the boundaries for the failing case.
Rotary embeddings in Megatron-Core need CUDA, so positions are learned absolute ones, which restart
with ``position_ids``.
"""

from __future__ import annotations

import pytest
import torch

from tightpack.runtime.equivalence import PackingLeakError
from tightpack.runtime.equivalence.megatron import check_mcore_packing


def _core_attention(respects_boundaries: bool):
    from megatron.core.transformer.module import MegatronModule

    class VarlenCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs) -> None:
            super().__init__(config=config)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):  # fmt: skip
            thd = packed_seq_params is not None  # query [T, heads, d]; else [S, B, heads, d]
            if thd:
                query, key, value = (tensor.unsqueeze(1) for tensor in (query, key, value))
            length = query.shape[0]
            segment = torch.zeros(length, dtype=torch.long)
            if thd and respects_boundaries:
                segment[packed_seq_params.cu_seqlens_q[1:-1].long()] = 1
                segment = segment.cumsum(0)
            mask = torch.ones(length, length, dtype=torch.bool).tril() & (segment[:, None] == segment[None])
            groups = query.shape[2] // key.shape[2]
            key, value = key.repeat_interleave(groups, 2), value.repeat_interleave(groups, 2)
            out = torch.nn.functional.scaled_dot_product_attention(
                *(tensor.permute(1, 2, 0, 3) for tensor in (query, key, value)), attn_mask=mask
            ).permute(2, 0, 1, 3)  # [S, B, heads, d]
            return out.reshape(length, -1) if thd else out.reshape(length, out.shape[1], -1)

    return VarlenCoreAttention


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state

    store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _gpt_model(respects_boundaries: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=True,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = _core_attention(respects_boundaries)
    torch.manual_seed(0)
    return GPTModel(config, spec, vocab_size=1024, max_sequence_length=1024,
                    position_embedding_type="learned_absolute")  # fmt: skip


@pytest.fixture(scope="module")
def batch():
    """One packed row as a tightpack batch gives it to the training step."""
    lengths = [300, 60, 50, 40]
    tokens = torch.randint(3, 1024, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(length) for length in lengths])[None]
    return {"tokens": tokens, "position_ids": positions, "cu_seqlens_q": bounds, "max_seqlen_q": 300}


def test_a_model_whose_attention_reads_packed_seq_params_passes(model_parallel, batch):
    model = _gpt_model(respects_boundaries=True)
    report = check_mcore_packing(
        lambda tokens, positions, params: model(tokens, positions, None, packed_seq_params=params),
        batch,
        model=model,
    )
    assert report.passed and report.cross_sequence == 0.0 and report.leak > 1e-3, report.summary()
    assert report.unpacked_gap <= 1e-5


@pytest.mark.parametrize("fault", ["attention ignores cu_seqlens", "step drops packed_seq_params"])
def test_a_forward_that_ignores_the_boundaries_is_refused(model_parallel, batch, fault):
    model = _gpt_model(respects_boundaries=fault != "attention ignores cu_seqlens")

    def forward(tokens, positions, params):
        params = None if fault == "step drops packed_seq_params" else params
        return model(tokens, positions, None, packed_seq_params=params)

    with pytest.raises(PackingLeakError, match=r"GPTModel .*see each other.*PackedSeqParams") as failure:
        check_mcore_packing(forward, batch, model=model)
    assert failure.value.report.cross_sequence > 0.1 * failure.value.report.leak
