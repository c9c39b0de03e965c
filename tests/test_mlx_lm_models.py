"""mlx-lm's model classes on mlx_attn's kernels (mlx_attn/lm/mlx_lm_models.py).

Tiny random-weight checkpoints are written by the tests with mlx-lm's own
model classes and save helpers (and a word-level tokenizer built here), then
loaded as a user would. Greedy tokens through mlx_attn's attention and caches
must equal mlx-lm's own ``generate_step`` on the same checkpoint, and the
seam must have run (its call counter, and the windowed path where a layer
has a sliding window). Without mlx-lm these tests skip, except on CI (CI
set), where they fail: CI installs the ``mlx-lm`` extra."""

import importlib
import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest


def _require_mlx_lm():
    try:
        import mlx_lm.generate  # noqa: F401
        import mlx_lm.models.cache  # noqa: F401
        import mlx_lm.utils  # noqa: F401
    except ImportError as error:
        if os.environ.get("CI"):
            pytest.fail(f"mlx-lm must be installed on CI (pip install '.[test,mlx-lm]'): {error}")
        pytest.skip(f"mlx-lm not installed (pip install '.[mlx-lm]'; on CI this fails): {error}",
                    allow_module_level=True)


_require_mlx_lm()

from mlx_lm.generate import generate_step as mlx_lm_generate_step  # noqa: E402
import mlx_lm.models.cache as mlx_lm_cache  # noqa: E402
import mlx_lm.utils  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from mlx_attn.lm import mlx_lm_models  # noqa: E402
from mlx_attn.lm.generate import GenerationConfig, generate_step  # noqa: E402

VOCAB = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]  # 64 tokens
NEW_TOKENS = 16
PROMPT = [1, 5, 9, 12, 40, 33, 7, 8, 21, 60, 19, 44, 3, 50]  # 14 tokens: longer than the windows (8)

QWEN3_5_ROPE = {"type": "default", "mrope_section": [1, 1, 0], "rope_theta": 100000, "partial_rotary_factor": 0.25}
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16384,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.1}
BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, vocab_size=len(VOCAB), max_position_embeddings=4096)
ARCHITECTURES = {
    "llama3": dict(BASE, model_type="llama", rope_theta=500000.0, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}),
    "qwen3": dict(BASE, model_type="qwen3", head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True),
    "mistral_sliding": dict(BASE, model_type="mistral", rope_theta=10000.0, tie_word_embeddings=False,
                            sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "gemma3_text": dict(BASE, model_type="gemma3_text", num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16,
                        sliding_window=8, sliding_window_pattern=3, rope_theta=1000000.0,
                        rope_local_base_freq=10000.0),
    "gpt_oss": dict(BASE, model_type="gpt_oss", num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8, rope_theta=150000.0,
                    layer_types=["sliding_attention", "full_attention"]),
    "qwen2": dict(BASE, model_type="qwen2", rope_theta=1000000.0, tie_word_embeddings=False),
    "phi3": dict(BASE, model_type="phi3", partial_rotary_factor=0.5, rope_theta=10000.0),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32, rope_theta=1000000.0,
                      tie_word_embeddings=False, norm_topk_prob=True),
    "olmo2": dict(BASE, model_type="olmo2", rope_theta=500000.0, tie_word_embeddings=False),
    # no_rope_layers: the second layer skips RoPE
    "smollm3": dict(BASE, model_type="smollm3", rope_theta=5000000.0, tie_word_embeddings=False,
                    no_rope_layer_interval=2),
    # hybrid: short-convolution layers around one attention layer
    "lfm2": dict(model_type="lfm2", vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                 block_dim=64, block_ff_dim=96, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention", "conv"]),
    # hybrid: gated-delta linear attention, full attention every 2nd layer, MoE
    "qwen3_next": dict(BASE, model_type="qwen3_next", num_hidden_layers=4, head_dim=16, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                       shared_expert_intermediate_size=32, mlp_only_layers=[], moe_intermediate_size=32,
                       rope_theta=1000000.0, partial_rotary_factor=0.25, full_attention_interval=2),
    # hybrid: gated-delta linear attention beside full attention (Qwen3.5); and its MoE under a text_config
    "qwen3_5": dict(BASE, model_type="qwen3_5", num_hidden_layers=4, head_dim=16, linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4, full_attention_interval=2, tie_word_embeddings=False,
                    rope_parameters=QWEN3_5_ROPE),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", text_config=dict(
        BASE, model_type="qwen3_5_moe_text", num_hidden_layers=4, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        full_attention_interval=2, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32,
        moe_intermediate_size=32, tie_word_embeddings=False, rope_parameters=QWEN3_5_ROPE)),
    # hybrids with Mamba-2 blocks: Granite 4.0 (MoE), Nemotron-H (an MLP-only layer too), Jamba; Falcon-H1
    # runs attention and Mamba side by side in each layer (a CacheList per layer)
    "granitemoehybrid": dict(BASE, model_type="granitemoehybrid", num_hidden_layers=3, attention_bias=False,
                             embedding_multiplier=6.0, attention_multiplier=0.2, logits_scaling=2.0,
                             residual_multiplier=0.5, layer_types=["mamba", "attention", "mamba"],
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
                             mamba_n_heads=4, mamba_d_head=32, mamba_proj_bias=False, mamba_d_state=16,
                             mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True, rope_theta=10000.0,
                             tie_word_embeddings=False),
    "nemotron_h": dict(model_type="nemotron_h", vocab_size=len(VOCAB), hidden_size=64, intermediate_size=96,
                       max_position_embeddings=4096, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                       ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "*", "-", "M"]),
    "jamba": dict(BASE, model_type="jamba", num_hidden_layers=4, attn_layer_offset=1, attn_layer_period=2,
                  expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4, mamba_d_state=8, mamba_expand=2,
                  num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "falcon_h1": dict(model_type="falcon_h1", vocab_size=len(VOCAB), hidden_size=64, intermediate_size=96,
                      head_dim=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16, mamba_n_groups=1,
                      mamba_n_heads=4, mamba_chunk_size=16, max_position_embeddings=4096, rope_theta=10000.0,
                      tie_word_embeddings=False),
    "lfm2_moe": dict(model_type="lfm2_moe", vocab_size=len(VOCAB), hidden_size=64, intermediate_size=96,
                     moe_intermediate_size=32, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                     norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                     use_expert_bias=True, num_dense_layers=1, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                     layer_types=["conv", "full_attention", "conv"]),
    "granite": dict(BASE, model_type="granite", logits_scaling=2.0, attention_multiplier=0.2,
                    embedding_multiplier=6.0, residual_multiplier=0.5, attention_bias=False, mlp_bias=False,
                    rope_theta=10000.0, tie_word_embeddings=False),
    "granitemoe": dict(BASE, model_type="granitemoe", logits_scaling=2.0, attention_multiplier=0.2,
                       embedding_multiplier=6.0, residual_multiplier=0.5, attention_bias=False, rope_theta=10000.0,
                       num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    # Ministral 3: YaRN with Llama 4's attention scaling, a sliding layer; Mistral 3: its text_config wrapper
    "ministral3": dict(BASE, model_type="ministral3", head_dim=16, tie_word_embeddings=False, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"], rope_parameters=MINISTRAL3_ROPE),
    "mistral3": dict(model_type="mistral3", text_config=dict(BASE, model_type="ministral3", head_dim=16,
                                                             tie_word_embeddings=False,
                                                             rope_parameters=MINISTRAL3_ROPE)),
    # the multimodal wrapper mlx-community's Gemma 3 checkpoints have (language_model under text_config)
    "gemma3": dict(model_type="gemma3", vocab_size=len(VOCAB), text_config=dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, query_pre_attn_scalar=16, sliding_window=8,
        sliding_window_pattern=3, rope_theta=1000000.0, rope_local_base_freq=10000.0)),
    # mlx-lm's gemma2 computes its (softcapped) attention itself: generate runs it on our caches only
    "gemma2": dict(BASE, model_type="gemma2", head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, rope_theta=10000.0),
    "llama4_text": dict(BASE, model_type="llama4_text", head_dim=16, intermediate_size_mlp=96, rope_theta=500000.0,
                        tie_word_embeddings=False, no_rope_layers=[1, 0], use_qk_norm=True),
    # chunked attention layers (mlx-lm's ChunkedKVCache) every 3 of 4, MoE
    "llama4": dict(model_type="llama4", text_config=dict(
        BASE, model_type="llama4_text", num_hidden_layers=4, head_dim=16, intermediate_size_mlp=96,
        attention_bias=False, attention_chunk_size=8, interleave_moe_layer_step=1, num_local_experts=4,
        num_experts_per_tok=1, rope_scaling=None, rope_theta=500000.0, use_qk_norm=True)),
    "glm4": dict(BASE, model_type="glm4", head_dim=16, attention_bias=True, partial_rotary_factor=0.5,
                 rope_theta=10000.0),
    "glm4_moe": dict(BASE, model_type="glm4_moe", head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
                     moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                     first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                     routed_scaling_factor=1.0, use_qk_norm=True, rope_scaling=None, rope_theta=10000.0,
                     tie_word_embeddings=False),
    "exaone4": dict(BASE, model_type="exaone4", num_hidden_layers=4, head_dim=16, rope_theta=1000000.0,
                    tie_word_embeddings=False, rope_scaling=None, sliding_window=8, sliding_window_pattern="LLLG",
                    layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "cohere2": dict(BASE, model_type="cohere2", head_dim=16, num_hidden_layers=4, layer_norm_eps=1e-5,
                    logit_scale=0.25, sliding_window=8, sliding_window_pattern=4, rope_theta=50000.0),
    "olmo3": dict(BASE, model_type="olmo3", head_dim=16, sliding_window=8, rope_theta=500000.0,
                  layer_types=["sliding_attention", "full_attention"]),
    # multi-head latent attention: the layer attends to keys computed from the cached latent
    "deepseek_v3": dict(BASE, model_type="deepseek_v3", moe_intermediate_size=32, n_shared_experts=1,
                        n_routed_experts=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                        qk_nope_head_dim=16, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                        topk_group=1, rope_theta=10000.0),
    "gpt_neox": dict(model_type="gpt_neox", max_position_embeddings=4096, hidden_size=64, num_attention_heads=4,
                     num_hidden_layers=2, layer_norm_eps=1e-5, vocab_size=len(VOCAB), rotary_emb_base=10000,
                     rotary_pct=0.25),
    "starcoder2": dict(BASE, model_type="starcoder2", norm_epsilon=1e-5, rope_theta=100000.0,
                       tie_word_embeddings=False),
    "mixtral": dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6),
    "phimoe": dict(BASE, model_type="phimoe", num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0,
                   original_max_position_embeddings=4096, rope_scaling=None),
    # Gemma 4's shapes: two KV-shared layers attend to earlier layers' caches (no cache of their own);
    # full-attention layers twice as wide, with one KV head and keys as values
    "gemma4_text": dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
                        num_attention_heads=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                        attention_k_eq_v=True, rms_norm_eps=1e-6,
                        vocab_size=len(VOCAB), vocab_size_per_layer_input=len(VOCAB), num_key_value_heads=2,
                        num_kv_shared_layers=2, hidden_size_per_layer_input=8, sliding_window=8,
                        sliding_window_pattern=2, max_position_embeddings=4096, use_double_wide_mlp=False),
    # Gemma 3n: KV-shared layers read their source layer's cache (keys_and_values), AltUp, LAuReL
    "gemma3n": dict(model_type="gemma3n", text_config=dict(
        model_type="gemma3n_text", hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4,
        head_dim=16, rms_norm_eps=1e-6, vocab_size=len(VOCAB), num_key_value_heads=2, num_kv_shared_layers=2,
        vocab_size_per_layer_input=len(VOCAB), sliding_window=8, max_position_embeddings=4096,
        rope_local_base_freq=10000.0, rope_theta=1000000.0, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
        hidden_size_per_layer_input=8, altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
        altup_active_idx=0, laurel_rank=8)),
    # Qwen3-VL's language model under its text_config (the vision tower is not loaded)
    "qwen3_vl": dict(model_type="qwen3_vl", text_config=dict(BASE, model_type="qwen3", head_dim=16,
                                                              rope_theta=1000000.0, tie_word_embeddings=False)),
    # dynamic-NTK RoPE needs one integer position per call: generate runs it, the engine refuses
    "llama_dynamic_rope": dict(BASE, model_type="llama", rope_theta=10000.0, tie_word_embeddings=False,
                               rope_scaling={"type": "dynamic", "factor": 2.0}),
    "qwen3_next_dynamic_rope": dict(BASE, model_type="qwen3_next", num_hidden_layers=4, head_dim=16,
                                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                                    num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=32,
                                    mlp_only_layers=[], moe_intermediate_size=32, rope_theta=1000000.0,
                                    partial_rotary_factor=0.25, full_attention_interval=2,
                                    rope_scaling={"type": "dynamic", "factor": 2.0}),
    # Kimi-Linear: multi-head latent attention beside KDA linear attention (a gathered hybrid in the engine)
    "kimi_linear": dict(model_type="kimi_linear", vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, intermediate_size=96, head_dim=16,
                        rope_theta=10000.0, rms_norm_eps=1e-5, model_max_length=4096,
                        linear_attn_config={"kda_layers": [1, 3], "num_heads": 4, "head_dim": 16,
                                            "short_conv_kernel_size": 4},
                        num_experts=4, moe_intermediate_size=32, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, num_experts_per_token=2, num_shared_experts=1,
                        first_k_dense_replace=1, tie_word_embeddings=False),
    # ---- more of what MLX users run
    "minimax": dict(BASE, model_type="minimax", head_dim=16, num_experts_per_tok=2, num_local_experts=4,
                    shared_intermediate_size=0, rope_theta=5000000.0, rotary_dim=8, tie_word_embeddings=False),
    "olmo_hybrid": dict(BASE, model_type="olmo_hybrid", num_hidden_layers=4, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, tie_word_embeddings=False,
                        attention_bias=False, head_dim=16),
    "hunyuan_v1_dense": dict(BASE, model_type="hunyuan_v1_dense", head_dim=16, rope_theta=10000.0,
                             use_qk_norm=True, tie_word_embeddings=False),
    "bailing_moe": dict(BASE, model_type="bailing_moe", moe_intermediate_size=32, num_experts=4,
                        num_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=2, first_k_dense_replace=1,
                        rope_theta=10000.0, topk_group=1, use_qk_norm=True),
    "ernie4_5": dict(BASE, model_type="ernie4_5", head_dim=16, rope_theta=500000.0, use_bias=False,
                     tie_word_embeddings=False),
    "seed_oss": dict(BASE, model_type="seed_oss", head_dim=16, attention_bias=True, attention_out_bias=False,
                     mlp_bias=False, rope_theta=10000.0, tie_word_embeddings=False),
    "apertus": dict(BASE, model_type="apertus", rope_theta=10000.0, qk_norm=True, tie_word_embeddings=False,
                    post_norm=False, mlp_bias=False, attention_bias=False),
    "cohere": dict(BASE, model_type="cohere", layer_norm_eps=1e-5, logit_scale=0.25, rope_theta=10000.0,
                   use_qk_norm=False),
    "phi": dict(model_type="phi", vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                num_attention_heads=4, num_key_value_heads=4, partial_rotary_factor=0.5, layer_norm_eps=1e-5,
                rope_theta=10000.0, max_position_embeddings=4096),
    "olmoe": dict(BASE, model_type="olmoe", num_experts=4, num_experts_per_tok=2, rope_theta=10000.0,
                  norm_topk_prob=False, tie_word_embeddings=False),
    "qwen2_moe": dict(BASE, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[], moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      rope_theta=1000000.0, tie_word_embeddings=False),
    # no attention layer at all (Mamba-2 blocks only): generate runs it, the engine has nothing to page
    "mamba2": dict(model_type="mamba2", num_heads=8, head_dim=16, vocab_size=len(VOCAB), hidden_size=64,
                   intermediate_size=128, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
                   conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
                   time_step_limit=[0.0, 1e9], time_step_rank=8),
}
WINDOWED = {"mistral_sliding", "gemma3_text", "gpt_oss", "ministral3", "gemma3", "exaone4", "cohere2", "olmo3",
            "gemma4_text", "gemma3n"}
# the attention layers that go through the seam, where not every layer does: hybrid models (the
# others keep a recurrent state, and mamba2 has no other); gemma2 (its layers compute attention themselves)
ATTENTION_LAYERS = {"lfm2": 1, "qwen3_next": 2, "qwen3_5": 2, "qwen3_5_moe": 2, "granitemoehybrid": 1,
                    "nemotron_h": 1, "jamba": 2, "falcon_h1": 2, "lfm2_moe": 1, "gemma2": 0, "mamba2": 0,
                    "olmo_hybrid": 1, "qwen3_next_dynamic_rope": 2, "kimi_linear": 2}


@pytest.fixture(autouse=True)
def _mlx_lm_attention_between_tests():
    """Each test starts and ends with mlx-lm's own attention in its modules."""
    mlx_lm_models.restore_attention()
    yield
    mlx_lm_models.restore_attention()


def write_tokenizer(directory):
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": 4096}))


# seeds whose random weights give greedy tokens that vary (seed 0 repeats one token)
CHECKPOINT_SEEDS = {"qwen2": 3, "falcon_h1": 2, "gemma2": 5, "glm4": 2, "exaone4": 1, "gpt_neox": 1, "starcoder2": 3,
                    "phimoe": 1, "granitemoe": 1, "gemma3n": 1, "seed_oss": 1, "cohere": 5, "phi": 1}


SMALL_EMBEDDINGS = {"lfm2", "lfm2_moe", "cohere2", "cohere"}


def write_checkpoint(directory, config: dict, *, quantize_bits: int | None = None, seed: int | None = None):
    """A random-weight checkpoint of mlx-lm's class for ``config``, saved with
    mlx-lm's helpers (4-bit with ``quantize_bits=4``)."""
    mx.random.seed(CHECKPOINT_SEEDS.get(config["model_type"], 0) if seed is None else seed)
    model_type = config["model_type"]
    module = importlib.import_module(f"mlx_lm.models.{mlx_lm.utils.MODEL_REMAPPING.get(model_type, model_type)}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if config["model_type"] == "gpt_oss":  # sinks that matter: mlx-lm initialises them to 0
        for layer in model.layers:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    if config["model_type"] in SMALL_EMBEDDINGS:  # tied embeddings: small, so the layers (not the last token) decide
        model.model.embed_tokens.weight = model.model.embed_tokens.weight * 0.05
    mx.eval(model.parameters())
    config = dict(config)
    if quantize_bits is not None:
        model, config = mlx_lm.utils.quantize_model(model, config, group_size=32, bits=quantize_bits)
    directory.mkdir(parents=True, exist_ok=True)
    mlx_lm.utils.save_model(directory, model)
    mlx_lm.utils.save_config(config, directory / "config.json")
    write_tokenizer(directory)
    return directory


def mlx_lm_greedy_tokens(directory, prompt=PROMPT, max_tokens=NEW_TOKENS):
    """mlx-lm's own generate_step (its attention, its caches)."""
    mlx_lm_models.restore_attention()
    model, _ = mlx_lm.utils.load(str(directory))
    steps = mlx_lm_generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]


def our_greedy_tokens(directory, prompt=PROMPT, **options):
    model, _ = mlx_lm_models.load(directory)
    config = GenerationConfig(max_tokens=NEW_TOKENS, **options)
    return [token for token, _ in generate_step(model, prompt, config)]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_tokens_equal_mlx_lm(tmp_path, name):
    directory = write_checkpoint(tmp_path / name, ARCHITECTURES[name])
    expected = mlx_lm_greedy_tokens(directory)
    mlx_lm_models.attention_calls.clear()
    mlx_lm_models.attention_paths.clear()
    got = our_greedy_tokens(directory)
    assert got == expected
    config = ARCHITECTURES[name]
    layers = ATTENTION_LAYERS[name] if name in ATTENTION_LAYERS else config.get("text_config", config)["num_hidden_layers"]
    steps = NEW_TOKENS + 1  # the prefill, then one step per token (the last is queued ahead)
    assert mlx_lm_models.attention_calls["float"] >= layers * steps
    if layers == 0:  # nothing went through the seam: the tokens are mlx-lm's own attention on our caches
        assert mlx_lm_models.attention_calls["float"] == 0
    assert set(mlx_lm_models.attention_paths) <= {"fused-cpu"}
    assert mlx_lm_models.attention_paths["fused-cpu"] == mlx_lm_models.attention_calls["float"]
    if name in WINDOWED:  # the sliding layers took window_size, not a mask array
        assert mlx_lm_models.attention_calls["windowed"] > 0
    else:
        assert mlx_lm_models.attention_calls["windowed"] == 0


# the MoE: quantized expert weights (gather_qmm); qwen3_5: a hybrid whose first attention layer is layer 1;
# gemma3: the multimodal wrapper (mlx-community's 4-bit Gemma 3 checkpoints)
QUANTIZED_ATTENTION_LAYER = {"qwen3": 0, "qwen3_moe": 0, "qwen3_5": 1, "gemma3": 0}


@pytest.mark.parametrize("name", sorted(QUANTIZED_ATTENTION_LAYER))
def test_a_4_bit_quantized_checkpoint_gives_mlx_lm_tokens(tmp_path, name):
    directory = write_checkpoint(tmp_path / f"{name}-4bit", ARCHITECTURES[name], quantize_bits=4)
    assert json.loads((directory / "config.json").read_text())["quantization"]["bits"] == 4
    expected = mlx_lm_greedy_tokens(directory)
    mlx_lm_models.attention_calls.clear()
    model, _ = mlx_lm_models.load(directory)
    assert isinstance(model.model.layers[QUANTIZED_ATTENTION_LAYER[name]].self_attn.q_proj, nn.QuantizedLinear)
    assert [t for t, _ in generate_step(model, PROMPT, GenerationConfig(max_tokens=NEW_TOKENS))] == expected
    assert mlx_lm_models.attention_calls["float"] > 0


def test_the_seam_is_installed_in_the_model_modules_and_restored(tmp_path):
    import mlx_lm.models.base as base
    import mlx_lm.models.qwen3 as qwen3

    original = base.scaled_dot_product_attention
    write_checkpoint(tmp_path / "q", ARCHITECTURES["qwen3"])
    mlx_lm_models.load(tmp_path / "q")
    assert qwen3.scaled_dot_product_attention is mlx_lm_models.attention
    assert base.scaled_dot_product_attention is mlx_lm_models.attention
    assert "mlx_lm.models.qwen3" in mlx_lm_models.restore_attention()
    assert qwen3.scaled_dot_product_attention is original is base.scaled_dot_product_attention


def test_the_caches_are_mlx_lm_s_structure_with_ours_for_attention(tmp_path):
    directory = write_checkpoint(tmp_path / "g", ARCHITECTURES["gemma3_text"])
    model, _ = mlx_lm_models.load(directory)
    theirs = mlx_lm_cache.make_prompt_cache(model.model)
    ours = model.make_cache()
    assert [type(c).__name__ for c in ours] == [type(c).__name__ for c in theirs]
    for mine, their in zip(ours, theirs):
        assert type(mine).__module__ == "mlx_attn.lm.mlx_lm_models"
        if isinstance(their, mlx_lm_cache.RotatingKVCache):
            assert (mine.max_size, mine.keep) == (their.max_size, their.keep)


def test_non_attention_caches_are_kept_as_mlx_lm_makes_them():
    arrays = mlx_lm_cache.ArraysCache(2)
    ours = mlx_lm_models._our_cache(mlx_lm_cache.CacheList(arrays, mlx_lm_cache.KVCache()), mlx_lm_cache)
    assert ours.caches[0] is arrays and isinstance(ours.caches[1], mlx_lm_models.KVCache)


@pytest.mark.parametrize("make", [mlx_lm_models.KVCache, lambda: mlx_lm_models.RotatingKVCache(max_size=4),
                                  lambda: mlx_lm_models.QuantizedKVCache(group_size=32, bits=8)])
def test_keys_and_values_are_what_the_last_update_returned(make):
    """mlx-lm's ``keys_and_values()`` (Gemma 3n's KV-shared layers read it):
    the very arrays the last update returned, whose attention a paged or
    dense call recognises."""
    cache = make()
    with pytest.raises(ValueError, match="no update"):
        cache.keys_and_values()
    for n in (6, 1):
        returned = cache.update_and_fetch(mx.ones((1, 2, n, 32)), mx.zeros((1, 2, n, 32)))
        assert cache.keys_and_values() is returned


# ---------------------------------------------------------------- masks
UPDATES = [5, 1, 1, 1, 7, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 9, 1]


@pytest.mark.parametrize("max_size,window", [(8, None), (8, 8), (8, 4), (None, 4), (None, None)])
def test_attention_through_our_caches_equals_mlx_lm_s_masks(max_size, window):
    """Update by update (chunks and single tokens, a ring that wraps), the
    mask made before the update and the attention after it: ours through the
    seam, mlx-lm's caches and masks through mx.fast."""
    rng = np.random.default_rng(0)
    if max_size is None:
        theirs, ours = mlx_lm_cache.KVCache(), mlx_lm_models.KVCache()
    else:
        theirs, ours = mlx_lm_cache.RotatingKVCache(max_size), mlx_lm_models.RotatingKVCache(max_size)
    windowed_before = mlx_lm_models.attention_calls["windowed"]
    for n in UPDATES:
        q, k, v = (mx.array(rng.standard_normal((1, 4, n, 16)).astype(np.float32)) for _ in range(3))
        k = k[:, :2]
        v = v[:, :2]
        their_mask = theirs.make_mask(n, window_size=window, return_array=False)
        our_mask = ours.make_mask(n, window_size=window)
        expected = mx.fast.scaled_dot_product_attention(q, *theirs.update_and_fetch(k, v), scale=0.25,
                                                        mask=their_mask)
        got = mlx_lm_models.attention(q, *ours.update_and_fetch(k, v), ours, 0.25, our_mask)
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-5)
    if window is not None:
        assert mlx_lm_models.attention_calls["windowed"] > windowed_before


def test_a_window_mask_read_by_a_model_itself_is_the_right_array():
    """A model that builds its own attention from the mask gets the array
    mlx-lm would give (computed only then)."""
    cache = mlx_lm_models.KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, 6, 8)), mx.zeros((1, 1, 6, 8)))
    mask = cache.make_mask(3, window_size=4)
    expected = mlx_lm_cache.KVCache()
    expected.update_and_fetch(mx.zeros((1, 1, 6, 8)), mx.zeros((1, 1, 6, 8)))
    assert np.array_equal(np.array(mask), np.array(expected.make_mask(3, window_size=4, return_array=False)))


# ---------------------------------------------------------------- quantized KV
def test_quantized_kv_with_sinks_runs_fused_and_is_close_to_float_kv(tmp_path):
    """gpt-oss (sinks) with an 8-bit KV cache: mlx-lm's own quantized
    attention refuses sinks; through the seam it is mlx_attn's fused
    quantized attention, and its logits are close to float KV's."""
    directory = write_checkpoint(tmp_path / "oss", ARCHITECTURES["gpt_oss"])
    model, _ = mlx_lm_models.load(directory)
    prompt = mx.array(PROMPT)[None]
    float_logits = model(prompt, cache=model.make_cache())[0, -1]
    caches = model.make_cache()
    caches = [c.to_quantized(group_size=64, bits=8) if isinstance(c, mlx_lm_models.KVCache) else c for c in caches]
    assert any(isinstance(c, mlx_lm_models.QuantizedKVCache) for c in caches)
    mlx_lm_models.attention_calls.clear()
    quantized_logits = model(prompt, cache=caches)[0, -1]
    assert mlx_lm_models.attention_calls["quantized"] == 1  # the one full-attention layer
    # 8-bit K/V moves the logits by ~0.1% of their range here; leaving the
    # sinks out of the quantized layer would move them by ~2.5%
    error = float(mx.abs(quantized_logits - float_logits).max())
    assert 0 < error < 0.01 * float(mx.abs(float_logits).max())
    # and whole generations with --kv-bits run (quantized from the first token)
    tokens = [t for t, _ in generate_step(model, PROMPT, GenerationConfig(max_tokens=NEW_TOKENS, kv_bits=8))]
    assert len(tokens) == NEW_TOKENS and mlx_lm_models.attention_calls["quantized"] > NEW_TOKENS


def test_kv_shared_layers_read_an_earlier_layer_s_quantized_kv(tmp_path):
    """Gemma 4's KV-shared layers get an earlier layer's quantized triples
    without a cache (mlx-lm's own attention fails there): the seam reads
    the quantization from the triples, and the logits stay close to float
    KV's."""
    config = dict(ARCHITECTURES["gemma4_text"], num_attention_heads=2, head_dim=32, global_head_dim=64)
    directory = write_checkpoint(tmp_path / "g4", config)
    model, _ = mlx_lm_models.load(directory)
    prompt = mx.array(PROMPT)[None]
    float_logits = model(prompt, cache=model.make_cache())[0, -1]
    caches = [c.to_quantized(group_size=32, bits=8) if isinstance(c, mlx_lm_models.KVCache) else c
              for c in model.make_cache()]
    mlx_lm_models.attention_calls.clear()
    quantized_logits = model(prompt, cache=caches)[0, -1]
    assert mlx_lm_models.attention_calls["quantized"] == 2  # the full-attention layer, and the layer sharing its KV
    error = float(mx.abs(quantized_logits - float_logits).max())
    assert 0 < error < 0.01 * float(mx.abs(float_logits).max())
    tokens = [t for t, _ in generate_step(model, PROMPT, GenerationConfig(max_tokens=NEW_TOKENS, kv_bits=8,
                                                                          kv_group_size=32))]
    assert len(tokens) == NEW_TOKENS


def test_kv_bits_quantize_the_attention_caches_inside_a_layer_s_cache_list(tmp_path):
    """Falcon-H1 keeps each layer's attention cache in a CacheList beside
    its Mamba state: ``kv_bits`` quantizes those (the state stays as it is),
    every attention call runs over quantized K/V, and 8-bit K/V keeps
    mlx-lm's greedy tokens here."""
    config = dict(ARCHITECTURES["falcon_h1"], num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    directory = write_checkpoint(tmp_path / "falcon", config)
    expected = mlx_lm_greedy_tokens(directory)
    model, _ = mlx_lm_models.load(directory)
    cache = model.make_cache()
    mlx_lm_models.attention_calls.clear()
    config = GenerationConfig(max_tokens=NEW_TOKENS, kv_bits=8, kv_group_size=32)
    tokens = [t for t, _ in generate_step(model, PROMPT, config, cache=cache)]
    assert [type(c).__name__ for layer in cache for c in layer.caches] == ["ArraysCache", "QuantizedKVCache"] * 2
    assert mlx_lm_models.attention_calls["float"] == 0
    assert mlx_lm_models.attention_calls["quantized"] >= 2 * NEW_TOKENS
    assert tokens == expected


# ---------------------------------------------------------------- loading and the command
def test_a_hub_repo_id_is_looked_up_in_the_local_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match=r"looks like a Hugging Face Hub name .*looked in .*hub"):
        mlx_lm_models.resolve_model_path("someone/absent-model")


def test_a_hub_repo_id_in_the_local_cache_loads(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snapshot = hub / "models--someone--tiny" / "snapshots" / ("0" * 40)
    write_checkpoint(snapshot, ARCHITECTURES["qwen3"])
    (hub / "models--someone--tiny" / "refs").mkdir()
    (hub / "models--someone--tiny" / "refs" / "main").write_text("0" * 40)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    assert mlx_lm_models.resolve_model_path("someone/tiny") == snapshot


def test_mlx_attn_generate_runs_an_mlx_lm_directory(tmp_path):
    """The command picks mlx-lm's classes for a model_type mlx_attn has no
    model of (qwen3) and prints mlx-lm's greedy tokens as text."""
    directory = write_checkpoint(tmp_path / "q", ARCHITECTURES["qwen3"])
    expected = mlx_lm_greedy_tokens(directory, prompt=[5, 9, 12])
    _, wrapper = mlx_lm.utils.load(str(directory))
    eos = wrapper.eos_token_ids
    kept = expected[:next((i for i, t in enumerate(expected) if t in eos), len(expected))]
    text = "".join(wrapper.decode([t]) for t in kept)
    result = subprocess.run([sys.executable, "-m", "mlx_attn.lm", "generate", "--model", str(directory),
                             "--prompt", "w2 w6 w9", "--max-tokens", str(NEW_TOKENS), "--ignore-chat-template",
                             "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "w2 w6 w9" + text + "\n"


# ---------------------------------------------------------------- the project's own models, same weights
# Checkpoints both loaders read: mlx_attn's own Llama has no RoPE scaling
# (it refuses rope_scaling), so a plain llama; Gemma 3 with its own head
# (its config says so: mlx_attn's loader ties by default, as transformers does).
OWN_MODEL_CHECKPOINTS = {
    "llama": (dict(BASE, model_type="llama", rope_theta=500000.0, tie_word_embeddings=False), None),
    "llama-4bit": (dict(BASE, model_type="llama", rope_theta=500000.0, tie_word_embeddings=False), 4),
    "gemma3_text": (dict(ARCHITECTURES["gemma3_text"], tie_word_embeddings=False), None),
}


@pytest.mark.parametrize("name", sorted(OWN_MODEL_CHECKPOINTS))
def test_the_own_model_and_mlx_lm_s_class_give_the_same_tokens_on_the_same_weights(tmp_path, name):
    """``--engine own`` (mlx_attn's Llama / Gemma 3) and ``--engine mlx-lm``
    (mlx-lm's class on mlx_attn's kernels) load one checkpoint: greedy
    tokens equal each other and mlx-lm's own, and through the serving engine
    each request of a mixed batch equals too."""
    from mlx_attn.lm.engine_choice import load_for_engine
    from mlx_attn.lm.models.base import Decoder
    from mlx_attn.serve import Engine
    from test_mlx_lm_serve import mixed_prompts, serve

    config, bits = OWN_MODEL_CHECKPOINTS[name]
    directory = write_checkpoint(tmp_path / name, config, quantize_bits=bits)
    expected = mlx_lm_greedy_tokens(directory)
    tokens, served = {}, {}
    prompts = {rid: p for rid, p in list(mixed_prompts(seed=3).items())[:4]}
    for engine in ("own", "mlx-lm"):
        model, _ = load_for_engine(str(directory), engine)
        assert isinstance(model, Decoder) == (engine == "own")
        tokens[engine] = [t for t, _ in generate_step(model, PROMPT, GenerationConfig(max_tokens=NEW_TOKENS))]
        served[engine] = serve(Engine(model, kv_tokens=128, page_size=4, max_batch_tokens=16), prompts, 4)
    assert tokens["own"] == tokens["mlx-lm"] == expected
    assert served["own"] == served["mlx-lm"]


def test_engine_auto_takes_mlx_lm_for_a_config_the_own_model_refuses(tmp_path):
    """A llama directory with Llama 3 RoPE scaling: mlx_attn's own Llama
    refuses it (naming rope_scaling), so ``auto`` runs mlx-lm's class; a
    plain llama stays on the own model."""
    from mlx_attn.lm.engine_choice import choose_engine, load_for_engine

    scaled = write_checkpoint(tmp_path / "llama3", ARCHITECTURES["llama3"])
    with pytest.raises(ValueError, match="rope_scaling"):
        load_for_engine(str(scaled), "own")
    assert choose_engine("auto", str(scaled)) == "mlx-lm"
    model, _ = load_for_engine(str(scaled), "auto")
    assert [t for t, _ in generate_step(model, PROMPT, GenerationConfig(max_tokens=NEW_TOKENS))] == \
        mlx_lm_greedy_tokens(scaled)
    plain = write_checkpoint(tmp_path / "llama", OWN_MODEL_CHECKPOINTS["llama"][0])
    assert choose_engine("auto", str(plain)) == "own"
