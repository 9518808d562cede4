"""The shapes and architectures `make-model` writes checkpoints of: plain data, no torch, so that the
command line lists them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_NAMES = ("float32", "bfloat16", "float16")
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss", "phi3", "gemma3", "deepseek_v2",
         "deepseek_v3")
MOE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3")
MLA_ARCHS = ("deepseek_v2", "deepseek_v3")
# DeepSeek's YaRN as its published configs have it (V2-Lite's mscale 0.707, V3's 1.0)
_DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
_GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
# Phi-3's LongRoPE for head_dim 16 (8 rotary pairs); original_max_position_embeddings equal to the shape's
# max_position: the engine and transformers both use the short factors at every length
_TINY_LONGROPE = {"rope_type": "longrope", "factor": 1.0, "original_max_position_embeddings": 2048,
                  "short_factor": [1.0, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0],
                  "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0]}


@dataclass(frozen=True)
class MlaShape:
    """DeepSeek's Multi-head Latent Attention and routing (--arch deepseek_v2 | deepseek_v3), as its config names
    them."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q_proj without the low-rank pair
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    is_tied: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    head_dim: int | None = None  # None: hidden_size // num_heads (qwen3 tiny uses a wider one)
    init_std: float = 0.02
    num_experts: int = 0  # 0: a dense shape; else for the MoE archs (intermediate_size: mixtral's and gpt_oss's
    num_experts_per_tok: int = 0  # experts', qwen3_moe's dense layers')
    moe_intermediate_size: int = 0  # qwen3_moe's experts
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = None  # gpt_oss, gemma3: the window of their sliding layers
    mla: MlaShape | None = None  # deepseek_v2, deepseek_v3 (their experts' size: moe_intermediate_size)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


SHAPES: dict[str, Shape] = {
    "tiny": Shape(64, 2, 4, 2, 128, 512, 2048, init_std=0.1),
    "tiny-llama3": Shape(64, 2, 4, 2, 128, 512, 2048, is_tied=True, rope_theta=500000.0, init_std=0.1,
                         rope_scaling={**_LLAMA3_SCALING, "factor": 4.0, "original_max_position_embeddings": 256}),
    "demo": Shape(256, 4, 4, 2, 512, 2048, 4096, init_std=0.05),
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, 8192, is_tied=True, rope_theta=100000.0, init_std=0.04),
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 14336, 128256, 131072, rope_theta=500000.0,
                          rope_scaling=_LLAMA3_SCALING),
    # Mixture-of-Experts shapes (--arch qwen3_moe | mixtral); the large ones as their published config.json
    "tiny-moe": Shape(64, 4, 4, 2, 128, 512, 2048, init_std=0.1, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32),
    # smollm2-135m's layers with 8 experts, top-2, each half the dense MLP's width: the same ~135M active
    # parameters a token (the CPU MoE-vs-dense and MoE-vs-llama.cpp benchmarks: scripts/moe/side_by_side.sh)
    "smollm2-135m-moe": Shape(576, 30, 9, 3, 1536, 49152, 8192, is_tied=True, rope_theta=100000.0, init_std=0.04,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768),
    "qwen3-30b-a3b": Shape(2048, 48, 32, 4, 6144, 151936, 40960, rope_theta=1000000.0, head_dim=128,
                           num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, rms_norm_eps=1e-6),
    "mixtral-8x7b": Shape(4096, 32, 32, 8, 14336, 32000, 32768, rope_theta=1000000.0, num_experts=8,
                          num_experts_per_tok=2),
    # gpt-oss (--arch gpt_oss): sliding and full layers alternating, YaRN rope, attention sinks, expert biases
    "tiny-gpt-oss": Shape(64, 2, 4, 2, 32, 512, 2048, init_std=0.1, head_dim=16, rope_theta=150000.0,
                          rope_scaling={**_GPT_OSS_YARN, "factor": 4.0, "original_max_position_embeddings": 512},
                          num_experts=8, num_experts_per_tok=2, sliding_window=8),
    # Phi-3 (--arch phi3): fused qkv/gate-up checkpoint tensors, LongRoPE
    "tiny-phi3": Shape(64, 2, 4, 2, 128, 512, 2048, init_std=0.1, rope_scaling=_TINY_LONGROPE),
    "gpt-oss-20b": Shape(2880, 24, 64, 8, 2880, 201088, 131072, rope_theta=150000.0, rope_scaling=_GPT_OSS_YARN,
                         head_dim=64, num_experts=32, num_experts_per_tok=4, sliding_window=128),
    # Gemma 3 text (--arch gemma3): five sliding layers per full one, local rope base 10,000, global 1e6 (linear x8)
    "tiny-gemma3": Shape(64, 6, 4, 2, 128, 512, 2048, is_tied=True, rope_theta=1000000.0, init_std=0.1, head_dim=16,
                         rope_scaling={"rope_type": "linear", "factor": 8.0}, rms_norm_eps=1e-6, sliding_window=8),
    "gemma-3-12b": Shape(3840, 48, 16, 8, 15360, 262208, 131072, is_tied=True, rope_theta=1000000.0, head_dim=256,
                         rope_scaling={"rope_type": "linear", "factor": 8.0}, rms_norm_eps=1e-6, sliding_window=1024),
    # DeepSeek (--arch deepseek_v3 | deepseek_v2): latent attention, shared experts, grouped routing; the large ones
    # as their published config.json
    "tiny-deepseek-v3": Shape(64, 3, 4, 4, 128, 512, 2048, init_std=0.1, rms_norm_eps=1e-6, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=32,
                              rope_scaling={**_DEEPSEEK_YARN, "factor": 4.0, "original_max_position_embeddings": 512},
                              mla=MlaShape(32, 48, 16, 8, 16, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                           topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "deepseek-v3": Shape(7168, 61, 128, 128, 18432, 129280, 163840, rms_norm_eps=1e-6, num_experts=256,
                         num_experts_per_tok=8, moe_intermediate_size=2048, rope_scaling=_DEEPSEEK_YARN,
                         mla=MlaShape(512, 1536, 128, 64, 128, n_shared_experts=1, first_k_dense_replace=3, n_group=8,
                                      topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "deepseek-v2-lite": Shape(2048, 27, 16, 16, 10944, 102400, 163840, rms_norm_eps=1e-6, num_experts=64,
                              num_experts_per_tok=6, moe_intermediate_size=1408,
                              rope_scaling={**_DEEPSEEK_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
                              mla=MlaShape(512, None, 128, 64, 128, n_shared_experts=2, first_k_dense_replace=1)),
}
