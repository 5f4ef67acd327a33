"""Model zoo: real Hugging Face model classes built from configs, with random weights.

Tiny entries build in well under a second on a CPU and are what the tests use. Entries ending in
``-shape`` have the widths of real checkpoints with only a few layers; they are for GPU benchmarks.
``hybrid zoo save NAME DIR`` writes any entry as an HF model directory (config.json + safetensors).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers


@dataclass(frozen=True)
class ZooEntry:
    name: str
    model_type: str
    config: dict = field(default_factory=dict)
    note: str = ""
    realistic: bool = False


_TINY_ATTN = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6)

ZOO: dict[str, ZooEntry] = {e.name: e for e in [
    ZooEntry("llama", "llama", dict(_TINY_ATTN, intermediate_size=96, num_hidden_layers=2),
             "plain attention + MLP: nothing for hybrid to rewrite (negative control)"),
    ZooEntry("mixtral", "mixtral", dict(_TINY_ATTN, intermediate_size=48, num_hidden_layers=2,
                                        num_local_experts=5, num_experts_per_tok=2),
             "MoE, softmax -> top-k -> renormalise"),
    ZooEntry("qwen3_moe", "qwen3_moe", dict(_TINY_ATTN, head_dim=16, intermediate_size=96, moe_intermediate_size=40,
                                            num_hidden_layers=2, num_experts=6, num_experts_per_tok=2,
                                            norm_topk_prob=True),
             "MoE, softmax -> top-k -> renormalise, q/k norm"),
    ZooEntry("deepseek_v2", "deepseek_v2", dict(
        vocab_size=256, hidden_size=48, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=3, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=0, routed_scaling_factor=1.5, topk_method="greedy", max_position_embeddings=256),
             "MLA without q_lora, complex RoPE; MoE softmax -> top-k x scale, shared expert"),
    ZooEntry("deepseek_v3", "deepseek_v3", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=256),
             "MLA with q_lora, interleaved RoPE, dense first layer; sigmoid + bias group-limited routing"),
    ZooEntry("mamba", "mamba", dict(vocab_size=256, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                    conv_kernel=4, time_step_rank=4),
             "Mamba1 selective scan"),
    ZooEntry("mamba2", "mamba2", dict(vocab_size=256, hidden_size=32, num_heads=8, head_dim=8, expand=2,
                                      n_groups=2, state_size=16, num_hidden_layers=2, chunk_size=8,
                                      conv_kernel=4, time_step_rank=4),
             "Mamba2 / SSD, 2 groups, chunk 8"),
    ZooEntry("jamba", "jamba", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        max_position_embeddings=256, use_mamba_kernels=False),
             "hybrid: Mamba1 + attention + MoE"),
    ZooEntry("bamba", "bamba", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=256),
             "hybrid: Mamba2 + attention"),
    # Realistic widths, few layers (GPU benchmarks).
    ZooEntry("deepseek-v2-lite-shape", "deepseek_v2", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
        n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.0, topk_method="greedy",
        max_position_embeddings=8192), "DeepSeek-V2-Lite widths, 4 layers", realistic=True),
    ZooEntry("mamba2-2.7b-shape", "mamba2", dict(
        vocab_size=50288, hidden_size=2560, num_heads=80, head_dim=64, expand=2, n_groups=1, state_size=128,
        num_hidden_layers=4, chunk_size=256, conv_kernel=4, time_step_rank=160),
             "Mamba2-2.7B widths, 4 layers", realistic=True),
    ZooEntry("mixtral-8x7b-shape", "mixtral", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=8192),
             "Mixtral-8x7B widths, 2 layers", realistic=True),
]}


def make_config(name: str, **overrides) -> transformers.PretrainedConfig:
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; choose one of: {', '.join(ZOO)}")
    entry = ZOO[name]
    cfg = transformers.AutoConfig.for_model(entry.model_type, **{**entry.config, **overrides})
    return cfg


def build(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
          **config_overrides) -> transformers.PreTrainedModel:
    """Instantiate a zoo model with random weights (deterministic for a seed), in eval mode."""
    cfg = make_config(name, **config_overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    _randomize_zero_init(model, seed)
    return model.eval()


def _randomize_zero_init(model: torch.nn.Module, seed: int) -> None:
    """HF initialises some tensors to zero (routers, correction biases): give them random values so
    routing is non-trivial and tests see real data, never zeros."""
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and t.numel() > 0 and not t.any() and "inv_freq" not in name:
                t.copy_((torch.randn(t.shape, generator=g) * 0.1).to(t.dtype))


def load(name_or_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> transformers.PreTrainedModel:
    """A zoo name or a path to an HF model directory (config.json + weights)."""
    if name_or_path in ZOO:
        return build(name_or_path, dtype=dtype, device=device)
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{name_or_path!r} is neither a zoo model ({', '.join(ZOO)}) nor a directory with a config.json "
            "(an HF model directory as save_pretrained writes it; try `hybrid zoo save mixtral DIR`)")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def save(name: str, directory: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    model = build(name, dtype=dtype)
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory
