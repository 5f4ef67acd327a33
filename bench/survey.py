"""Survey: every causal-LM architecture of the installed transformers, built tiny, through hybrid.

    python bench/survey.py --jobs 2 --out bench/results/survey_cpu.json     # all of them (markdown next to it)
    python bench/survey.py --models llama,mixtral --out /tmp/s.json
    python bench/survey.py --sample                                          # the fixed CI sample
    python bench/survey.py --sample --device cuda --out /tmp/s.json          # the same on the GPU (Triton kernels)
    python bench/survey.py --sample --device cuda --dtype bfloat16 --out /tmp/s.json

Per architecture, in a subprocess of its own (a crash or a hang stops only that one):
1. build: ``AutoConfig.for_model`` shrunk generically (``shrink``), random weights, fp32 (or ``--dtype``), eval;
2. signature regions: ``graphs.modules.classify`` over ``model.modules()``;
3. HF eager references: logits of two prompts, greedy ``generate`` (dynamic and static cache), one prompt at a
   time for the engine; a failure here is HF's ("hf-fails"), not ours;
4. ``compiler.explain`` over prefill and decode graphs (an exception: a crash of ours);
5. ``torch.compile(model.forward, backend="hybrid")``: logits relative error and greedy tokens vs eager;
6. ``Engine`` on three prompts vs HF greedy per prompt (``hybrid-eager`` on the CPU, ``hybrid-cudagraphs`` on
   the GPU: Triton kernels and recorded decode steps).
On the GPU (``--device cuda``) TF32 is off, so fp32 tokens are compared exactly there too. ``--dtype bfloat16``
runs the models in bf16 (the kernels' production dtype): logits must agree within bf16 rounding, and greedy
tokens that differ from HF's are listed, not judged (a near tie flips where two implementations round differently).
Outcome per architecture: the worst of crash > wrong > refused > torch-fails > ok, or "unbuildable" / "hf-fails";
"torch-fails": the hybrid compile failed and so did stock ``torch.compile(backend="eager")`` on the same generate.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("hybrid_kernels", "graphs", "passes", "compiler", "runtime")
TIMEOUT_S = 480
#: compiled vs eager logits, relative error, per dtype (bf16: its rounding, kernels and HF round differently)
LOGITS_TOL = {"float32": 1e-4, "bfloat16": 3e-2}
NEW_TOKENS = 6
SEED = 0
#: the fixed CI sample: every region kind and every refusal path the full survey found
SAMPLE = ["llama", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3", "mamba", "mamba2", "jamba", "bamba",
          "gpt_oss", "qwen3_next", "kimi_linear", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2",
          "phimoe", "olmoe", "qwen2_moe", "glm4_moe", "dots1", "ernie4_5_moe", "gemma2", "gemma3_text", "bloom"]
OUTCOMES = ["crash", "wrong", "refused", "torch-fails", "ok", "hf-fails", "unbuildable"]

# -- tiny configs -------------------------------------------------------------------------------------------
#: size-like config fields -> tiny value (a field is changed only where the default config has it)
TINY = {
    64: ["hidden_size", "d_model", "n_embd", "embedding_dim", "emb_dim", "word_embed_proj_dim", "lru_width",
         "embedding_size", "input_embedding_size", "output_embedding_size", "hidden_size_per_layer_input"],
    128: ["intermediate_size", "ffn_dim", "ffn_hidden_size", "d_ff", "dff", "dim_ff", "decoder_ffn_dim",
          "encoder_ffn_dim", "n_inner", "intermediate_size_mlp", "dense_intermediate_size", "feed_forward_size",
          "d_inner"],
    32: ["moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
         "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size", "shared_intermediate_size",
         "kv_lora_rank", "router_hidden_size", "laurel_rank", "adapter_rank", "o_lora_rank", "loop_gate_rank",
         "hc_lowrank", "ple_embed_dim"],
    4: ["num_attention_heads", "n_head", "n_heads", "decoder_attention_heads", "encoder_attention_heads",
        "attention_heads", "swa_num_attention_heads", "linear_num_value_heads", "linear_num_heads", "index_n_heads",
        "num_decoder_attention_heads", "num_encoder_attention_heads", "conv_kernel", "mamba_d_conv",
        "linear_conv_kernel_dim", "conv_kernel_size", "conv1d_width", "short_conv_kernel_size", "ple_conv_kernel_size"],
    2: ["num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "linear_num_key_heads", "mamba_n_groups",
        "mamba_ngroups", "n_groups", "num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token",
        "expand", "mamba_expand"],
    16: ["head_dim", "kv_channels", "swa_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
         "index_head_dim", "d_head", "dim_head", "attention_head_size", "mamba_d_head", "mamba_head_dim",
         "mamba_headdim", "qk_nope_head_dim", "v_head_dim", "state_size", "mamba_d_state", "ssm_state_size",
         "qk_head_dim"],
    8: ["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_mamba_heads", "mamba_n_heads",
        "mamba_num_heads", "rotary_dim", "qk_rope_head_dim", "chunk_size", "mamba_chunk_size", "time_step_rank", "mamba_dt_rank", "sliding_window",
        "window_size", "attention_window_size", "sliding_window_size", "local_attention", "attention_chunk_size",
        "local_attention_window_len", "index_topk", "rel_extent", "keep_window_size", "zero_expert_num"],
    24: ["q_lora_rank"],
    256: ["vocab_size", "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
          "model_max_length", "context_length", "vocab_size_per_layer_input", "unpadded_vocab_size",
          "decoder_vocab_size", "max_source_positions"],
}
TINY_FIELD = {name: value for value, names in TINY.items() for name in names}
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
LAYER_COUNTS = ["num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers",
                "encoder_layers", "num_encoder_layers", "num_blocks"]
#: at most this many shared experts, expert groups, groups kept per token
CAPS = {"n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1, "n_group": 4,
        "num_expert_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "num_dense_layers": 1,
        "moe_layer_start_index": 1, "num_nextn_predict_layers": 0, "num_kv_shared_layers": 1}
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
               "sep_token_id": 3, "cls_token_id": 4, "unk_token_id": 5, "mask_token_id": 6}
#: families the generic rule cannot shrink alone: extra config fields, applied after it
FAMILY = {
    "mamba2": dict(num_heads=8),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "recurrent_gemma": dict(num_hidden_layers=3),
    "zamba": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2),
    "dory": dict(num_hidden_layers=6, layer_types=["sliding_attention", "mlp", "full_attention", "mlp",
                                                   "sliding_attention", "mlp"],
                 n_input_layers=2, n_recurrent_layers=2, n_output_layers=2),
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1),
    "deepseek_v2": dict(num_experts_per_tok=2),
    "hunyuan_v1_moe": dict(num_experts=8, moe_topk=2),
    "reformer": dict(is_decoder=True, axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32], attention_head_size=16,
                     local_attn_chunk_length=8, lsh_attn_chunk_length=8),
    "xlstm": dict(num_heads=4, qk_dim_factor=1.0),
    "dbrx": dict(attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0)),
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0)}),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_heads=4),
    "kolibri1_1": dict(num_hidden_layers=2, layer_types=["indexed_attention", "sliding_attention"], index_layers=[0],
                       index_num_heads=2, kv_source_layers=[0, 1]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  use_mamba_kernels=False),
}


def _new_layer_count(d: dict, lists: dict, n_old: int) -> tuple[int, list[int]]:
    """How many layers to keep and which original indices: at least one layer of each combination of
    per-layer kinds (every per-layer list read together), then the first layers: 2 (4 for configs with layer
    periods or offsets) or one per kind."""
    kinds = [tuple(lst[i] if not isinstance(lst[i], list) else str(lst[i]) for lst in lists.values())
             for i in range(n_old)]
    keep = sorted({kinds.index(k) for k in dict.fromkeys(kinds)})
    periodic = any(k.endswith(("_period", "_offset", "_interval")) for k in d)  # kinds the lists do not show
    want = min(max(len(keep), 4 if periodic else 2), n_old)
    keep = sorted(keep + [i for i in range(n_old) if i not in keep][: max(0, want - len(keep))])
    return len(keep), keep


def _is_index_list(name: str, value, n_old: int) -> bool:
    return (isinstance(value, list) and any(t in name for t in ("layers", "idxs", "indices", "ids"))
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_old for v in value)
            and value == sorted(set(value)))


def _shrink_layers(d: dict, out: dict) -> None:
    """Fewer layers, with per-layer lists, layer-index lists and {layer: fields} dicts kept consistent."""
    key = next((k for k in LAYER_COUNTS if isinstance(d.get(k), int) and d[k] > 0), None)
    if key is None:
        return
    n_old = d[key]
    per_layer = {k: v for k, v in d.items() if isinstance(v, list) and len(v) == n_old and k != "eos_token_id"
                 and not _is_index_list(k, v, n_old)}
    index_lists = {k: v for k, v in d.items() if _is_index_list(k, v, n_old) and k not in per_layer}
    masks = {k: [i in set(v) for i in range(n_old)] for k, v in index_lists.items()}
    per_index = {k: {int(i): e for i, e in v.items()} for k, v in d.items()
                 if isinstance(v, dict) and v and all(str(i).isdigit() and isinstance(e, dict) for i, e in v.items())}
    kinds = {k: [str(v.get(i)) for i in range(n_old)] for k, v in per_index.items()}
    n_new, keep = _new_layer_count(d, {**per_layer, **masks, **kinds}, n_old)
    for k in LAYER_COUNTS:
        if isinstance(d.get(k), int) and d[k] == n_old:
            out[k] = n_new
    for k, v in per_layer.items():
        vals = [v[i] for i in keep]
        if k in TINY_FIELD or "heads" in k:
            vals = [TINY_FIELD.get(k, 4) if isinstance(x, int) else x for x in vals]
        out[k] = vals
    for k, mask in masks.items():
        out[k] = [j for j, i in enumerate(keep) if mask[i]]
    for k, v in per_index.items():  # {layer index: fields of that layer}, e.g. per_layer_config
        out[k] = {j: {**v[i], **shrink(v[i])} for j, i in enumerate(keep) if i in v}
    for k, v in d.items():  # layer-index fields such as max_window_layers / moe_layer_end_index
        if "layer" in k and type(v) is int and v == n_old:
            out[k] = n_new
        elif k not in out and "layer" in k and type(v) is int and v >= n_new:
            if v == n_old - 1:
                out[k] = n_new - (n_old - v)
            elif k.endswith(("_period", "_interval", "_step")):
                out[k] = min(v, 2)
            elif k.endswith("_offset"):
                out[k] = min(v, 1)


def _shrink_rope(rope: dict, rot_dim: int) -> dict:
    """rope_parameters whose per-frequency lists or sections must follow the new head dim."""
    rope = dict(rope)
    for k in ("short_factor", "long_factor"):
        if isinstance(rope.get(k), list):
            rope[k] = rope[k][: rot_dim // 2]
    if isinstance(rope.get("mrope_section"), list):
        sec, half = rope["mrope_section"], rot_dim // 2
        new = [max(1, round(s * half / sum(sec))) for s in sec]
        new[0] += half - sum(new)
        rope["mrope_section"] = new
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = 64
    return rope


def _sizes(d: dict, out: dict) -> None:
    """Every size-like field to its tiny value (never up: an MQA config keeps its one kv head)."""
    for k, v in d.items():
        if type(v) is int and v > 0 and k in TINY_FIELD:
            out[k] = min(v, TINY_FIELD[k])
        elif type(v) is int and k in CAPS:
            out[k] = min(v, CAPS[k])
        elif isinstance(v, list) and k in TINY_FIELD and v and all(type(x) is int for x in v):
            out[k] = [min(x, TINY_FIELD[k]) for x in v]


def _consistent(d: dict, out: dict) -> None:
    """Sizes that depend on each other: head dims left for the model to derive, MLA dims, SSM widths."""
    heads = out.get("num_attention_heads")
    if "head_dim" in d and d["head_dim"] is None and heads and "hidden_size" in out:
        out["head_dim"] = out["hidden_size"] // heads
    if "num_key_value_heads" in d and d["num_key_value_heads"] in (None, d.get("num_attention_heads")) and heads:
        out["num_key_value_heads"] = heads  # multi-head attention (and MLA) stays so
    if "kv_lora_rank" in d and d.get("qk_rope_head_dim"):  # MLA: head_dim is the rope or the whole q/k dim
        nope, rope = out.get("qk_nope_head_dim", 0), out["qk_rope_head_dim"]
        if d.get("head_dim"):
            out["head_dim"] = rope if d["head_dim"] == d["qk_rope_head_dim"] else nope + rope
        if d.get("qk_head_dim"):
            out["qk_head_dim"] = nope + rope
    experts = next((out[k] for k in EXPERTS if out.get(k)), 0)
    if "num_experts_per_tok" in d and d["num_experts_per_tok"] is None and experts:
        out["num_experts_per_tok"] = 2
    if d.get("mamba_d_ssm"):
        out["mamba_d_ssm"] = out.get("mamba_n_heads", 8) * out.get("mamba_d_head", 16)
    if d.get("original_max_position_embeddings"):
        out["original_max_position_embeddings"] = 64


def shrink(d: dict) -> dict:
    """Config overrides that make the config dict ``d`` tiny (nested sub-configs shrunk the same way)."""
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict) and ("model_type" in v or k.endswith("_config") or k in ("decoder", "text_encoder")):
            sub = shrink(v)
            if sub:
                out[k] = {**v, **sub}
    _sizes(d, out)
    _consistent(d, out)
    _shrink_layers(d, out)
    if isinstance(d.get("rope_parameters"), dict):
        head_dim = out.get("head_dim") or 16
        rope = _shrink_rope(d["rope_parameters"], out.get("qk_rope_head_dim", head_dim))
        if rope != d["rope_parameters"]:
            out["rope_parameters"] = rope
    vocab = out.get("vocab_size", d.get("vocab_size"))
    if vocab:
        _special_ids(d, out, vocab)
    return out


def _special_ids(d: dict, out: dict, vocab: int) -> None:
    """Special token ids outside the new vocabulary moved inside: the usual ones low, any other at the top."""
    spare = iter(range(vocab - 1, vocab - 64, -1))
    for k, v in d.items():
        ids = v if isinstance(v, list) else [v]
        if not k.endswith(("_token_id", "_token_index")) or not all(type(i) is int for i in ids):
            continue
        if all(0 <= i < vocab for i in ids):
            continue
        new = [SPECIAL_IDS[k] if k in SPECIAL_IDS and j == 0 else next(spare) for j in range(len(ids))]
        out[k] = new if isinstance(v, list) else new[0]


def tiny_config(model_type: str):
    """The default config of ``model_type`` made tiny: the generic shrink, then the family's fixes."""
    from transformers import AutoConfig
    try:
        default = AutoConfig.for_model(model_type).to_dict()
    except Exception:  # a default HF cannot build alone: the family's fixes first
        default = AutoConfig.for_model(model_type, **FAMILY.get(model_type, {})).to_dict()
    overrides = {**shrink(default), **FAMILY.get(model_type, {})}
    return AutoConfig.for_model(model_type, **overrides)


def build(model_type: str, device: str = "cpu", dtype: str = "float32"):
    """The tiny model: random weights (drawn in fp32, then cast to ``dtype``), eval, seed fixed. HF initialises routers, biases and some gates to
    zero: those get random values too (as runtime/zoo.py does), so nothing is tested on zeros."""
    import torch
    from transformers import AutoModelForCausalLM
    config = tiny_config(model_type)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and t.numel() and not t.any() and "inv_freq" not in name:
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()


# -- one architecture (in its child process) ----------------------------------------------------------------
def failure(exc: BaseException) -> dict:
    """An exception as the report keeps it: type, message, the innermost cause, where it was raised and the
    last frames in our library (``file:line function``)."""
    chain, e = [], exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    frames = [f for c in chain for f in traceback.extract_tb(c.__traceback__)]
    ours = [f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}" for f in frames
            if f.filename.startswith(str(ROOT)) and Path(f.filename).relative_to(ROOT).parts[0] in LIBRARY]
    root = chain[-1]
    raised = traceback.extract_tb(root.__traceback__)
    return dict(type=type(exc).__name__, message=str(exc).strip()[:2000], root_type=type(root).__name__,
                root_message=str(root).strip()[:2000], ours=ours[-3:],
                raised=f"{raised[-1].filename.split('site-packages/')[-1]}:{raised[-1].lineno}" if raised else None)


def prompts(config, lengths, seed: int = SEED) -> list[list[int]]:
    """Random prompts that contain no special token id of the config (pad, bos, eos, image, ...)."""
    import torch
    special = set()
    for k, v in config.to_dict().items():
        if k.endswith(("_token_id", "_token_index")):
            special.update(v if isinstance(v, list) else [v])
    allowed = [i for i in range(8, config.get_text_config().vocab_size) if i not in special]
    g = torch.Generator().manual_seed(seed)
    return [[allowed[i] for i in torch.randint(len(allowed), (n,), generator=g).tolist()] for n in lengths]


def _generate(model, ids, **kw):
    import torch
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                          **kw)[:, ids.shape[1]:]


def hf_reference(model, ids, engine_prompts, ref: dict) -> dict:
    """HF eager into ``ref``: logits, greedy tokens (dynamic and, where supported, static cache), one prompt
    at a time for the engine. Returns whether the static cache is supported."""
    import torch
    ref.update(logits=model(ids, attention_mask=torch.ones_like(ids)).logits, dyn=_generate(model, ids))
    try:
        ref["static"] = _generate(model, ids, cache_implementation="static")
    except Exception as e:
        ref["static"] = f"n/a: {type(e).__name__}: {str(e).strip()[:200]}"
    ref["engine"] = [_generate(model, torch.tensor([p], device=ids.device))[0].tolist() for p in engine_prompts]
    return dict(static=ref["static"] if isinstance(ref["static"], str) else "ok", engine_ref=ref["engine"])


def explain_stage(model, ids) -> dict:
    """compiler.explain over the prefill and decode graphs: every region with its status and reason."""
    import torch
    import compiler
    report = compiler.explain(model, ids, attention_mask=torch.ones_like(ids), generate_tokens=2)
    regions = [dict(kind=r["kind"], module=r["module"], status=r["status"], reason=r["reason"])
               for r in report.regions()]
    return dict(regions=regions, counts=report.counts(), notes=[n for g in report.graphs for n in g.notes])


def compile_stage(model, ids, ref: dict) -> dict:
    """model.forward compiled with the hybrid backend vs eager: logits error, greedy tokens dyn / static."""
    import torch
    from hybrid_kernels.numerics import rel_err
    out = {}
    for cache in ("dyn", "static"):
        if cache == "static" and isinstance(ref["static"], str):
            out["static"] = "n/a"
            continue
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="hybrid")
        try:
            if cache == "dyn":
                out["logits_err"] = rel_err(model(ids, attention_mask=torch.ones_like(ids)).logits, ref["logits"])
            tokens = _generate(model, ids, **({"cache_implementation": "static"} if cache == "static" else {}))
            out[cache] = torch.equal(tokens, ref[cache])
            if not out[cache]:
                out[f"{cache}_tokens"] = dict(eager=ref[cache].tolist(), compiled=tokens.tolist())
        finally:
            del model.forward
            torch._dynamo.reset()
    return out


def control_stage(model, ids) -> dict:
    """After a failed hybrid compile: the same greedy generates through stock ``torch.compile(backend="eager")``
    (dynamo alone, none of our code). Failing too, the failure is torch's or HF's under dynamo, not ours."""
    import torch
    for cache in ("dyn", "static"):
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="eager")
        try:
            _generate(model, ids, **({"cache_implementation": "static"} if cache == "static" else {}))
        finally:
            del model.forward
            torch._dynamo.reset()
    return {}


def engine_stage(model, engine_prompts, ref: list[list[int]]) -> dict:
    """The engine (hybrid-eager on the CPU, hybrid-cudagraphs on the GPU) on prompts of three lengths vs HF greedy
    per prompt: prompts in chunks of 4 within steps of 8 tokens, the first one decoding when the others arrive, so
    steps mix decodes with chunks continuing prompts (packed steps where the model takes them: ``packed`` says
    whether it did, ``packed_note`` why not)."""
    from runtime.engine import Engine, SamplingParams
    mode = "hybrid-cudagraphs" if next(model.parameters()).is_cuda else "hybrid-eager"
    try:
        engine = Engine(model, compile=mode, max_num_seqs=4, block_size=4, cache_memory=64 << 20,
                        max_prefill_tokens=4, max_num_batched_tokens=8)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        if "\n" not in str(e).strip():
            return dict(outcome="refused", reason=f"{type(e).__name__}: {str(e).strip()}")
        raise
    packed = dict(packed=engine.scheduler.packed, packed_note=engine.packed_note)
    params = SamplingParams(max_tokens=NEW_TOKENS)
    try:
        ids = [engine.add_request(engine_prompts[0], params)]
        for _ in range(2):  # the first prompt's chunks; then it decodes while the others arrive
            engine.step()
        ids += engine.add_requests(engine_prompts[1:], params)
        while engine.has_unfinished():
            engine.step()
    except ValueError as e:  # requests the engine refuses in one line (e.g. beyond the lengths it runs exactly)
        if "\n" not in str(e).strip():
            return dict(outcome="refused", reason=f"{type(e).__name__}: {str(e).strip()}", **packed)
        raise
    outs = [engine.output(i) for i in ids]
    errors = [o.error for o in outs if getattr(o, "error", None)]
    if errors:
        return dict(outcome="crash", reason=f"request failed: {errors[0]}", **packed)
    got = [list(o.token_ids) for o in outs]
    if got != ref:
        return dict(outcome="wrong", reason=f"engine {got} vs HF {ref}", tokens=got, ref=ref, **packed)
    return dict(outcome="ok", **packed)


def survey_one(model_type: str, result_path: Path, device: str = "cpu", dtype: str = "float32") -> None:
    """Every stage for one architecture; the result file is rewritten after each stage (a timeout keeps them)."""
    import torch
    from graphs.modules import classify
    r = dict(arch=model_type, dtype=dtype, times={})

    def stage(name, fn, *args):
        r["stage"] = name
        save()
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                r[name] = fn(*args)
        except Exception as e:
            r[name] = dict(error=failure(e))
        r["times"][name] = round(time.perf_counter() - t0, 2)
        save()
        return r[name]

    def save():
        tmp = result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(r, default=str))
        tmp.replace(result_path)

    def built(holder):
        model = holder["model"] = build(model_type, device, dtype)
        layers = next((getattr(model.config, k) for k in LAYER_COUNTS
                       if type(getattr(model.config, k, None)) is int), None)
        kinds = [classify(m) for m in model.modules()]
        return dict(cls=type(model).__name__, params=sum(p.numel() for p in model.parameters()), layers=layers,
                    signature={k: kinds.count(k) for k in ("mla", "ssm", "moe")})

    holder, ref = {}, {}
    if "error" in stage("build", built, holder):
        return
    model = holder["model"]
    ids = torch.tensor(prompts(model.config, [9, 9]), device=device)
    engine_prompts = prompts(model.config, [5, 9, 13], seed=SEED + 1)
    if "error" in stage("hf", hf_reference, model, ids, engine_prompts, ref):
        return
    stage("explain", explain_stage, build(model_type, device, dtype), ids)
    if "error" in stage("compile", compile_stage, build(model_type, device, dtype), ids, ref):
        stage("compile_control", control_stage, build(model_type, device, dtype), ids)
    stage("engine", engine_stage, build(model_type, device, dtype), engine_prompts, ref["engine"])
    r["stage"] = "done"
    save()


# -- the survey (parent process) ----------------------------------------------------------------------------
def _reason(err: dict) -> str:
    where = f" [{err['ours'][-1]}]" if err.get("ours") else ""
    root = "" if err["root_type"] == err["type"] else f" <- {err['root_type']}: {err['root_message']}"
    return f"{err['type']}: {err['message']}{root}"[:400] + where


def outcome(r: dict) -> tuple[str, str]:
    """(outcome, first reason) of one architecture's result: crash > wrong > refused > ok, or unbuildable /
    hf-fails (HF's own failure), each with the reason an engineer needs to act on it."""
    if r.get("died"):
        return ("unbuildable" if r.get("stage") == "build" else "hf-fails" if r.get("stage") == "hf"
                else "crash"), r["died"]
    if "error" in r.get("build", {}):
        return "unbuildable", _reason(r["build"]["error"])
    if "error" in r.get("hf", {}):
        return "hf-fails", _reason(r["hf"]["error"])
    found, exact, tol = [], _exact(r), LOGITS_TOL[r.get("dtype", "float32")]
    for stage in ("explain", "compile"):
        if "error" in r.get(stage, {}):
            theirs = stage == "compile" and "error" in r.get("compile_control", {})
            note = "stock torch.compile fails too: " if theirs else ""
            found.append(("torch-fails" if theirs else "crash", f"{stage}: {note}{_reason(r[stage]['error'])}"))
    c = r.get("compile", {})
    if c.get("logits_err") is not None and not c["logits_err"] <= tol:
        found.append(("wrong", f"compile: logits relative error {c['logits_err']:.2e}"))
    for cache in ("dyn", "static"):
        if c.get(cache) is False and exact:
            found.append(("wrong", f"compile: {cache} tokens {c[cache + '_tokens']}"))
    e = r.get("engine", {})
    if "error" in e:
        found.append(("crash", f"engine: {_reason(e['error'])}"))
    elif e.get("outcome") in ("crash", "refused") or e.get("outcome") == "wrong" and exact:
        found.append((e["outcome"], f"engine: {e['reason']}"))
    if not found:
        return "ok", ""
    return min(found, key=lambda f: OUTCOMES.index(f[0]))


def _exact(r: dict) -> bool:
    """Whether greedy tokens must equal HF's: in fp32 yes; in bf16 a near tie can flip where the kernels round
    differently from HF, so token differences are reported, not judged (the logits error is judged)."""
    return r.get("dtype", "float32") == "float32"


def run_one(model_type: str, timeout: float = TIMEOUT_S, threads: int = 1, device: str = "cpu",
            dtype: str = "float32") -> dict:
    """One architecture in a child process; a timeout or a dead process is recorded in its stage."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path, log = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": str(threads),
               "PYTHONWARNINGS": "ignore"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", model_type, "--result", str(path),
               "--threads", str(threads), "--device", device, "--dtype", dtype]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        r = (json.loads(path.read_text()) if path.exists() else
             dict(arch=model_type, dtype=dtype, stage="start", times={}))
        if r.get("stage") != "done" and not ("error" in r.get("build", {}) or "error" in r.get("hf", {})):
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-300:]
            r["died"] = (f"timeout after {timeout:.0f} s in stage {r.get('stage')}" if proc.returncode == -9 else
                         f"process exited with {proc.returncode} in stage {r.get('stage')}: {tail}")
    r["times"]["total"] = round(time.perf_counter() - t0, 1)
    r["outcome"], r["reason"] = outcome(r)
    return r


def summary(results: list[dict]) -> dict:
    """Counts of outcomes and of regions: by signature, and what explain reported for them."""
    out = {k: sum(r["outcome"] == k for r in results) for k in OUTCOMES}
    sig = sum(sum(r.get("build", {}).get("signature", {}).values()) for r in results)
    status = {"rewritten": 0, "detected": 0, "skipped": 0}
    for r in results:
        for reg in r.get("explain", {}).get("regions", []):
            status[reg["status"]] += 1
    seen = sum(status.values())
    engines = [r["engine"] for r in results if "packed" in r.get("engine", {})]
    return dict(outcomes=out, archs=len(results), signature_regions=sig, explain_regions=seen, **status,
                rewritten_pct=round(100 * status["rewritten"] / sig, 1) if sig else 0.0,
                engines_built=len(engines), engines_packed=sum(e["packed"] for e in engines))


def _cell(r: dict) -> list[str]:
    b, c, e = r.get("build", {}), r.get("compile", {}), r.get("engine", {})
    sig = b.get("signature", {})
    counts = r.get("explain", {}).get("counts")
    err = c.get("logits_err")
    tok = lambda v: {True: "yes", False: "NO", "n/a": "n/a", None: "-"}.get(v, str(v))  # noqa: E731
    return [r["arch"], "yes" if "cls" in b else "no",
            "/".join(str(sig.get(k, 0)) for k in ("mla", "ssm", "moe")) if sig else "-",
            "/".join(str(counts[k]) for k in ("rewritten", "skipped", "detected")) if counts else "-",
            "-" if err is None else f"{err:.1e}", f"{tok(c.get('dyn'))}/{tok(c.get('static'))}",
            "differs" if e.get("outcome") == "wrong" and not _exact(r)
            else e.get("outcome", "crash" if "error" in e else "-"), f"{r['times'].get('total', 0):.0f}",
            r["outcome"], r["reason"][:200].replace("|", "\\|").replace("\n", " ")]


def _errors(r: dict):
    """(stage, failure) for every exception an architecture's stages recorded."""
    for stage in ("build", "hf", "explain", "compile", "engine"):
        if "error" in r.get(stage, {}):
            yield stage, r[stage]["error"]


def groups(results: list[dict]) -> list[str]:
    """The work queue: crashes by root cause (exception, and our frame it went through), wrong results,
    refusals, regions with a signature that were not rewritten by reason, unbuildable and hf-fails by reason."""
    by: dict[str, dict[str, list[str]]] = {}

    def add(section, key, arch):
        by.setdefault(section, {}).setdefault(key, []).append(arch)

    for r in results:
        a, o = r["arch"], r["outcome"]
        for stage, err in _errors(r):
            where = err["ours"][-1] if err.get("ours") else err.get("raised")
            if stage in ("explain", "compile", "engine"):
                add("Crashes by root cause", f"{stage}: {err['root_type']} at {where}: "
                    f"{err['root_message'].splitlines()[0][:200] if err['root_message'] else ''}", a)
        if r.get("died") and o == "crash":
            add("Crashes by root cause", r["died"][:200], a)
        if o in ("unbuildable", "hf-fails"):
            add(o.capitalize() if o == "unbuildable" else "HF fails", r["reason"][:200], a)
        e, exact, tol = r.get("engine", {}), _exact(r), LOGITS_TOL[r.get("dtype", "float32")]
        wrong = "Wrong results" if exact else "Token differences (bf16: reported, not judged)"
        if e.get("outcome") in ("refused", "crash", "wrong") and "error" not in e:
            add({"refused": "Engine refusals", "crash": "Crashes by root cause", "wrong": wrong}[
                e["outcome"]], f"engine: {e['reason'][:200]}" if e["outcome"] != "wrong" else "engine tokens differ", a)
        c = r.get("compile", {})
        if c.get("logits_err") is not None and not c["logits_err"] <= tol:
            add("Wrong results", f"compile: logits relative error > {tol:g}", f"{a} ({c['logits_err']:.1e})")
        for cache in ("dyn", "static"):
            if c.get(cache) is False:
                add(wrong, f"compile: greedy tokens differ ({cache} cache)", a)
        for reg in r.get("explain", {}).get("regions", []):
            if reg["status"] != "rewritten":
                add("Regions not rewritten", f"{reg['kind']} {reg['status']}: {reg['reason'][:200]}", a)
    lines = []
    sections = ["Crashes by root cause", "Wrong results", "Engine refusals", "Regions not rewritten",
                "Unbuildable", "HF fails"]
    if not all(_exact(r) for r in results):
        sections.insert(2, "Token differences (bf16: reported, not judged)")
    for section in sections:
        lines += ["", f"## {section}", ""]
        items = sorted(by.get(section, {}).items(), key=lambda kv: -len(kv[1]))
        lines += [f"- {k.replace(chr(10), ' ')} -- {len(v)}: {', '.join(dict.fromkeys(v))}" for k, v in items] or ["- none"]
    return lines


def markdown(results: list[dict], s: dict, env: dict, planned: int) -> str:
    """The report: summary line, the work queue by cause, then one row per architecture."""
    o = s["outcomes"]
    lines = [f"# Survey: causal LMs of transformers {env['transformers']}, tiny, through hybrid ({env['device']})",
             "", f"- environment: {', '.join(f'{k} {v}' for k, v in env.items())}",
             f"- model dtype: {', '.join(sorted({r.get('dtype', 'float32') for r in results}))}",
             f"- {s['archs']} of the {planned} architectures asked for: "
             + ", ".join(f"{o[k]} {k}" for k in OUTCOMES),
             f"- regions by signature: {s['signature_regions']} (MLA/SSM/MoE modules); explain reported "
             f"{s['explain_regions']}: {s['rewritten']} rewritten, {s['skipped']} skipped, {s['detected']} detected "
             f"({s['rewritten_pct']}% of the signature regions rewritten)",
             f"- engine steps packed (decodes with prefill chunks in one unpadded forward) on {s['engines_packed']} "
             f"of the {s['engines_built']} architectures the engine built"]
    lines += groups(results)
    lines += ["", "## Per architecture", "",
              "| arch | built | signature mla/ssm/moe | rewritten/skipped/detected | compile logits err | tokens "
              "dyn/static | engine | time s | outcome | first reason |", "|" + " --- |" * 10]
    lines += ["| " + " | ".join(_cell(r)) + " |" for r in results]
    return "\n".join(lines) + "\n"


def write(path: Path, results: list[dict], planned: int) -> None:
    """The JSON (every stage of every architecture) and the markdown report next to it; ``planned``: how many
    architectures the run was asked for (a partial run says so)."""
    sys.path.insert(0, str(ROOT))
    from bench.common import environment
    env = environment()
    s = summary(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(bench="survey", environment=env, summary={**s, "planned": planned},
                                    results=results), indent=1))
    path.with_suffix(".md").write_text(markdown(results, s, env, planned))


def main(argv=None) -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--models", help="comma-separated model types (default: every causal LM)")
    ap.add_argument("--sample", action="store_true", help="the fixed CI sample")
    ap.add_argument("--out", help="JSON path (markdown next to it)")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the models run (cuda: TF32 off, Triton kernels, CUDA graphs in the engine)")
    ap.add_argument("--dtype", choices=tuple(LOGITS_TOL), default="float32",
                    help="the models' dtype (bfloat16: greedy tokens are reported, not judged; logits within 3e-2)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, Path(args.result), args.threads, args.device, args.dtype)
    archs = SAMPLE if args.sample else args.models.split(",") if args.models else list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    results, t0 = {}, time.perf_counter()

    if args.out and "HYBRID_COMMIT" not in os.environ:
        os.environ["HYBRID_COMMIT"] = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                                     capture_output=True, text=True).stdout.strip() or "unknown"

    def one(arch, timeout=args.timeout):
        r = run_one(arch, timeout, threads, args.device, args.dtype)
        results[arch] = r
        if args.out:  # partial results as they come
            write(Path(args.out), [results[a] for a in archs if a in results], len(archs))
        print(f"[{len(results)}/{len(archs)} {time.perf_counter() - t0:6.0f}s] {arch:26s} {r['outcome']:11s} "
              f"{r['times']['total']:5.0f}s  {r['reason'][:150]}", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, archs))
        # a timeout on a loaded machine is often only slowness: once more, with twice the time
        late = [a for a in archs if results[a].get("died", "").startswith("timeout")]
        list(pool.map(lambda a: one(a, 2 * args.timeout), late))
    ordered = [results[a] for a in archs]
    print(json.dumps(summary(ordered)["outcomes"]), file=sys.stderr)
    if args.out:
        write(Path(args.out), ordered, len(archs))
    return 0


def child(model_type: str, result: Path, threads: int, device: str = "cpu", dtype: str = "float32") -> int:
    """The child process: quiet, single-threaded as asked, Triton's interpreter on a CPU-only machine."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if device == "cuda":  # exact fp32 on the GPU too: no TF32 in matmuls or convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT))
    import transformers
    transformers.logging.set_verbosity_error()
    survey_one(model_type, result, device, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
