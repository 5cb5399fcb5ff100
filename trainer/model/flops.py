"""Analytic parameter counts and training FLOPs of the shared decoder, every family's here (no allocation)."""

from __future__ import annotations

from trainer.config.schema import ModelConfig


def _attention_matmul_params(cfg: ModelConfig) -> int:
    d, hd = cfg.base_emb_dim, cfg.head_dim
    return 2 * d * cfg.base_num_query_heads * hd + 2 * d * cfg.base_num_kv_heads * hd  # q, o + k, v


def _mlp_matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) matmul params of one block's MLP; MoE includes the router."""
    d = cfg.base_emb_dim
    if cfg.num_experts > 1:
        expert = 3 * d * cfg.base_moe_mlp_dim
        router = d * cfg.num_experts
        return router + cfg.num_experts * expert, router + cfg.num_experts_per_tok * expert
    dense = 3 * d * cfg.base_mlp_dim
    return dense, dense


def _norm_params(cfg: ModelConfig) -> int:
    """RMSNorm weights of one block."""
    return 2 * cfg.base_emb_dim + (2 * cfg.head_dim if cfg.use_qk_norm else 0)


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total params, params active per token), exactly the elements of `abstract_params(cfg)`.

    Active counts every embedding / head / attention / norm weight and, in MoE blocks, the router plus
    num_experts_per_tok experts (the convention behind "30B-A3B")."""
    embed = cfg.vocab_size * cfg.base_emb_dim
    head = 0 if cfg.logits_via_embedding else embed
    mlp_total, mlp_active = _mlp_matmul_params(cfg)
    per_block = _attention_matmul_params(cfg) + _norm_params(cfg)
    layers = cfg.base_num_decoder_layers
    fixed = embed + head + cfg.base_emb_dim  # + final norm
    return fixed + layers * (per_block + mlp_total), fixed + layers * (per_block + mlp_active)


def _block_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of every block: its matmuls, 2 per active weight, and causal attention,
    QK^T and PV at 2*2*T*N*hd per token with half the pairs masked."""
    _, mlp_active = _mlp_matmul_params(cfg)
    layers = cfg.base_num_decoder_layers
    matmul = layers * (_attention_matmul_params(cfg) + mlp_active)
    return 2.0 * matmul + 2.0 * layers * cfg.base_num_query_heads * cfg.head_dim * seq_len


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token, the usual 6N + attention estimate:

        6 * (active matmul params: attention q/k/v/o, MLP or router + k experts, and the output
             projection D*V whether tied or not; the embedding lookup is not a matmul)
      + 6 * L * N_heads * head_dim * seq_len   (causal attention: QK^T and PV, 2*2*T*N*hd per token
                                                forward with half the pairs masked, times 3 for fwd+bwd)

    Norms, RoPE, softmax and MoE dispatch are ignored; packed documents are counted as full-length
    causal sequences (an upper bound on the attention work actually needed)."""
    return 3.0 * _block_forward_flops_per_token(cfg, seq_len) + 6.0 * cfg.vocab_size * cfg.base_emb_dim


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs per token a step spends computing the blocks' forward again for the backward pass: the whole
    forward of every block with `remat_policy=full`, none with `none`, and with `minimal` (matmul outputs
    saved) only the elementwise work, counted as none here. Model FLOPs (and so MFU) leave this out; the
    chip computes it all the same."""
    return _block_forward_flops_per_token(cfg, seq_len) if cfg.remat_policy == "full" else 0.0
