"""Region kinds are recognised from parameters and children on the real HF classes, never by names."""
import pytest
import torch
import transformers

from runtime import zoo
from graphs.modules import DELTA, MLA, MOE, SSM, classify, clean_path, mamba2_dims

EXPECTED = {
    "llama": {},
    "mixtral": {"model.layers.0.mlp": MOE, "model.layers.1.mlp": MOE},
    "qwen3_moe": {"model.layers.0.mlp": MOE, "model.layers.1.mlp": MOE},
    "deepseek_v2": {"model.layers.0.self_attn": MLA, "model.layers.0.mlp": MOE,
                    "model.layers.1.self_attn": MLA, "model.layers.1.mlp": MOE},
    "deepseek_v3": {"model.layers.0.self_attn": MLA, "model.layers.1.self_attn": MLA, "model.layers.1.mlp": MOE,
                    "model.layers.2.self_attn": MLA, "model.layers.2.mlp": MOE},
    "mamba": {"backbone.layers.0.mixer": SSM, "backbone.layers.1.mixer": SSM},
    "mamba2": {"backbone.layers.0.mixer": SSM, "backbone.layers.1.mixer": SSM},
    "jamba": {"model.layers.0.mamba": SSM, "model.layers.1.feed_forward": MOE, "model.layers.2.mamba": SSM,
              "model.layers.3.feed_forward": MOE},
    "bamba": {"model.layers.0.mamba": SSM, "model.layers.2.mamba": SSM},
    "gpt_oss": {"model.layers.0.mlp": MOE, "model.layers.1.mlp": MOE},
    "granitemoehybrid": {"model.layers.0.mamba": SSM, "model.layers.0.block_sparse_moe": MOE,
                         "model.layers.1.block_sparse_moe": MOE, "model.layers.2.mamba": SSM,
                         "model.layers.2.block_sparse_moe": MOE},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_classification_on_zoo(name):
    model = zoo.build(name)
    found = {n: classify(m) for n, m in model.named_modules() if classify(m)}
    assert found == EXPECTED[name]


def test_gated_delta_net_is_not_mamba2():
    """Qwen3-Next's gated delta-net holds A_log, dt_bias and a conv1d like Mamba2: it must not match Mamba2, and it
    is a delta-rule mixer."""
    cfg = transformers.AutoConfig.for_model(
        "qwen3_next", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    gdn = model.model.layers[0].linear_attn
    assert hasattr(gdn, "A_log") and hasattr(gdn, "dt_bias") and hasattr(gdn, "conv1d")
    assert classify(gdn) == DELTA
    assert classify(model.model.layers[0].mlp) == MOE  # its MoE block is still an MoE block


def test_mamba2_dims_from_weights():
    model = zoo.build("mamba2")
    dims = mamba2_dims(model.backbone.layers[0].mixer)
    cfg = model.config
    assert dims == dict(heads=cfg.num_heads, head_dim=cfg.head_dim, d_inner=cfg.num_heads * cfg.head_dim,
                        groups=cfg.n_groups, state=cfg.state_size,
                        conv_dim=cfg.num_heads * cfg.head_dim + 2 * cfg.n_groups * cfg.state_size,
                        kernel=cfg.conv_kernel)


def test_renamed_children_still_classified():
    """Matching is structural: renaming the router child does not hide an MoE block."""
    model = zoo.build("mixtral")
    block = model.model.layers[0].mlp
    block.router_renamed = block.gate
    del block.gate
    assert classify(block) == MOE


def test_plain_modules_are_not_candidates():
    assert classify(torch.nn.Linear(4, 4)) is None
    assert classify(zoo.build("llama").model.layers[0].mlp) is None


@pytest.mark.parametrize("raw,clean", [
    ("L['self'].model.layers[0].mlp", "model.layers.0.mlp"),
    ("L['args'][0].backbone.layers[1].mixer", "backbone.layers.1.mixer"),
    ("L['self']._modules['model'].layers[3]", "model.layers.3"),
])
def test_clean_path(raw, clean):
    assert clean_path(raw) == clean
