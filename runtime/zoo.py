"""Model zoo: real Hugging Face model classes built from configs, with random weights.

Tiny entries build in well under a second on a CPU and are what the tests use. Entries ending in
``-shape`` have the widths of real checkpoints with only a few layers; they are for GPU benchmarks.
``hybrid zoo save NAME DIR`` writes any entry as an HF model directory (config.json + safetensors + the character
tokenizer of runtime/tokenizer.py, which ``load_tokenizer`` also gives for a zoo name).

``load`` of a model directory refuses one that is not what its files say: weights that do not match its
config.json, unreadable JSON or safetensors files, a directory that needs its own Python code (never run unless
``trust_remote_code=True``); each as one ``LoadError`` line naming the file.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: JSON files a tokenizer reads (each checked before transformers parses it)
TOKENIZER_JSON = TOKENIZER_FILES + ("special_tokens_map.json", "added_tokens.json", "vocab.json")


class LoadError(ValueError):
    """A model directory whose files cannot be loaded as they are: the message names the file and what to do."""


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
    ZooEntry("gpt_oss", "gpt_oss", dict(
        _TINY_ATTN, max_position_embeddings=131072, head_dim=16, intermediate_size=32, num_hidden_layers=2,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
             "MoE with expert biases and clamped SwiGLU, top-k -> softmax; attention sinks, sliding window"),
    ZooEntry("granitemoehybrid", "granitemoehybrid", dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=256,
        position_embedding_type="rope"),
             "hybrid: Mamba2 + attention, MoE with a shared MLP in every layer"),
    ZooEntry("qwen3_next", "qwen3_next", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        layer_types=["linear_attention"] * 3 + ["full_attention"]),
             "hybrid 3:1: Gated DeltaNet (decay per head, 2 key heads for 4 value heads) + gated attention + MoE"),
    ZooEntry("kimi_linear", "kimi_linear", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_experts=4, num_experts_per_tok=2, linear_num_heads=4,
        linear_head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention"] * 3 + ["full_attention"]),
             "hybrid 3:1: Kimi Delta Attention (decay per key channel) + MLA + MoE"),
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
    ZooEntry("qwen3-30b-a3b-shape", "qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=8192),
             "Qwen3-30B-A3B widths (128 small experts, top-8), 2 layers", realistic=True),
    ZooEntry("granite-4.0-h-tiny-shape", "granitemoehybrid", dict(
        vocab_size=100352, hidden_size=1536, intermediate_size=512, shared_intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=12, num_key_value_heads=4, num_local_experts=64, num_experts_per_tok=6,
        layer_types=["mamba"] * 3 + ["attention"], mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, position_embedding_type="nope",
        max_position_embeddings=8192),
             "Granite-4.0-H-Tiny widths (Mamba2 48 heads x 64 + NoPE attention + 64 experts top-6 and a shared MLP in "
             "every layer), 4 layers 3:1", realistic=True),
    ZooEntry("qwen3-next-80b-a3b-shape", "qwen3_next", dict(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=65536),
             "Qwen3-Next-80B-A3B widths (Gated DeltaNet 16 key / 32 value heads x 128, 512 experts top-10), "
             "4 layers 3:1", realistic=True),
    ZooEntry("kimi-linear-48b-a3b-shape", "kimi_linear", dict(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=65536),
             "Kimi-Linear-48B-A3B widths (KDA 32 heads x 128, MLA, 256 experts top-8), 4 layers 3:1",
             realistic=True),
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


def check_device(device) -> torch.device:
    """``device`` as a torch.device the engine can run on (cpu, or cuda[:N] present here); ValueError otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device {device!r} is not a device name torch knows: use cpu or cuda[:N]") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch has no usable CUDA (torch.cuda.is_available() is False): "
                             "use cpu, or a CUDA build of torch on a machine with a GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 .. "
                             f"cuda:{torch.cuda.device_count() - 1})")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: hybrid runs on cpu or cuda[:N]")
    return dev


def load(name_or_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", *,
         allow_missing_weights: bool = False, trust_remote_code: bool = False) -> transformers.PreTrainedModel:
    """A zoo name or a path to an HF model directory (config.json + weights). Weights missing from the files, or
    in them for no parameter, or of other shapes are an error naming the first few (``allow_missing_weights``
    loads the model anyway, those weights random, with a warning)."""
    check_device(device)
    if name_or_path in ZOO:
        return build(name_or_path, dtype=dtype, device=device)
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{name_or_path!r} is neither a zoo model ({', '.join(ZOO)}) nor a directory with a config.json "
            "(an HF model directory as save_pretrained writes it; try `hybrid zoo save mixtral DIR`)")
    _check_config(path, trust_remote_code)
    _check_weight_files(path)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True,
            ignore_mismatched_sizes=True)  # reported below, by name
    except Exception as e:  # noqa: BLE001  (whatever transformers raises on these files: one line naming them)
        if "trust_remote_code" in str(e):
            raise LoadError(_remote_code(path / "config.json", "the model")) from e
        raise LoadError(f"{path}: transformers cannot build the model from its files ({_line(e)})") from e
    _check_loading_info(path, info, allow_missing_weights)
    return model.to(device).eval()


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """A zoo entry's character tokenizer (runtime/tokenizer.py), or the directory's tokenizer: None when it has no
    tokenizer files; its files' errors are one LoadError line."""
    if name_or_path in ZOO:
        from runtime.tokenizer import char_tokenizer
        return char_tokenizer(make_config(name_or_path))
    path = Path(name_or_path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    files = {f: _read_json(path / f) for f in TOKENIZER_JSON if (path / f).is_file()}
    config = files.get("tokenizer_config.json", {})
    cls = config.get("tokenizer_class")
    custom = "AutoTokenizer" in (config.get("auto_map") or {}) and not (
        isinstance(cls, str) and hasattr(transformers, cls.removesuffix("Fast")))
    if custom and not trust_remote_code:
        raise LoadError(_remote_code(path / "tokenizer_config.json", f"its tokenizer ({cls})"))
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        if "trust_remote_code" in str(e):
            raise LoadError(_remote_code(path / "tokenizer_config.json", "its tokenizer")) from e
        raise LoadError(f"{path}: transformers cannot load its tokenizer files ({_line(e)})") from e


def _line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _remote_code(file: Path, what: str) -> str:
    return (f"{file.parent} needs its own Python code to load {what} (auto_map in {file.name}); hybrid never runs a "
            "model directory's code unless asked: pass trust_remote_code=True (--trust-remote-code) if you trust it")


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise LoadError(f"{file} is not a text file (JSON expected): copy it again or re-create it") from None
    except json.JSONDecodeError as e:
        raise LoadError(f"{file} is not valid JSON ({e.msg.removesuffix(' at')} at line {e.lineno}, column {e.colno}): "
                        "fix it, copy it again or re-create it") from None
    if not isinstance(data, dict):
        raise LoadError(f"{file} holds a JSON {type(data).__name__} where an object {{...}} is expected")
    return data


def _check_config(path: Path, trust_remote_code: bool) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    config = _read_json(path / "config.json")
    if (path / "generation_config.json").is_file():
        _read_json(path / "generation_config.json")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise LoadError(f"{path / 'config.json'} has no model_type: it is not a transformers model config")
    if model_type in CONFIG_MAPPING:
        return
    if config.get("auto_map"):
        if not trust_remote_code:
            raise LoadError(_remote_code(path / "config.json", f"model type {model_type!r}"))
        return
    raise LoadError(f"{path / 'config.json'} names model type {model_type!r}, which transformers "
                    f"{transformers.__version__} does not know: a newer transformers may, or the config is not a "
                    "transformers model's")


def _check_weight_files(path: Path) -> None:
    """Weight files present, the index's shards there, every safetensors header readable and covering its file."""
    from safetensors import safe_open
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        if (path / "programs").is_dir() and (path / "weights.safetensors").is_file():
            if (path / "manifest.json").is_file():
                raise LoadError(f"{path} is an engine directory: `hybrid generate` and `hybrid serve` run it; export "
                                "and explain take the model it was exported from (a zoo name or an HF model directory)")
            raise LoadError(f"{path} looks like an engine directory (programs/, weights.safetensors) without its "
                            "manifest.json: export the engine again (an engine directory is not a model to export)")
        raise LoadError(f"{path} has no weights (none of {', '.join(WEIGHT_FILES)}): copy the checkpoint's weight "
                        "files there, or write a zoo model with `hybrid zoo save NAME DIR`")
    shards = []
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            weight_map = _read_json(path / index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise LoadError(f"{path / index} has no weight_map: it does not describe the checkpoint's shards")
            for shard in sorted(set(weight_map.values())):
                if not (path / str(shard)).is_file():
                    raise LoadError(f"{path / index} lists {shard}, which is not in {path}: copy the missing shard")
                shards.append(path / str(shard))
    if (path / "model.safetensors").is_file():
        shards.append(path / "model.safetensors")
    for file in shards:
        if file.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(file), "pt"):
                pass
        except Exception as e:  # noqa: BLE001  (SafetensorError, OSError: the file is what is wrong)
            raise LoadError(f"{file} is not a readable safetensors file ({' '.join(str(e).split())}): it is "
                            "truncated or corrupt; copy it again") from None


def _check_loading_info(path: Path, info: dict, allow_missing_weights: bool) -> None:
    few = lambda keys: ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")  # noqa: E731
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(f"{k} {tuple(a)} in the files, {tuple(b)} in the model"
                        for k, a, b in info.get("mismatched_keys") or ())
    parts = [f"{len(missing)} of the model's weights are not in them ({few(missing)})"] if missing else []
    if unexpected:
        parts.append(f"{len(unexpected)} weights in them belong to no parameter of the model ({few(unexpected)})")
    if mismatched:
        parts.append(f"{len(mismatched)} have other shapes ({few(mismatched)})")
    if not parts:
        return
    what = f"{path}'s weight files do not match its config.json: {'; '.join(parts)}"
    if allow_missing_weights:
        warnings.warn(f"{what}; loaded anyway (allow_missing_weights): those weights are random", stacklevel=3)
        return
    raise LoadError(f"{what}. They are another model's weights, or incomplete: pass allow_missing_weights=True "
                    "(--allow-missing-weights) to load the model with those weights random")


def writable_dir(directory: Path, what: str) -> None:
    """Create ``directory`` (and its parents) and check that a file can be written in it, before any long work; an
    ``OSError`` naming the path and the reason otherwise."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".hybrid-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OSError(f"cannot write {what} {directory}: {e.strerror or e}; give a writable path") from None


def save(name: str, directory: str | Path, dtype: torch.dtype = torch.float32, *, force: bool = False) -> Path:
    """Write zoo model ``name`` as an HF model directory. A file at ``directory``, or a directory with anything in
    it, is refused unless ``force`` (which replaces the file, or the directory's config and weight files)."""
    make_config(name)  # an unknown name fails before anything is written
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        if not force:
            raise FileExistsError(f"{directory} is a file: zoo save writes a directory (config.json + "
                                  "model.safetensors); give a new path, or --force (force=True) to replace the file")
        directory.unlink()
    elif directory.is_dir() and any(directory.iterdir()):
        if not force:
            entries = sorted(p.name for p in directory.iterdir())
            raise FileExistsError(f"{directory} is not empty ({len(entries)} entries: {', '.join(entries[:3])}"
                                  f"{', ...' if len(entries) > 3 else ''}): give a new or empty directory, or --force "
                                  "(force=True) to replace its model files")
        for pattern in ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                        "pytorch_model*.bin", "pytorch_model.bin.index.json", *TOKENIZER_FILES, "special_tokens_map.json",
                        "chat_template.jinja"):
            for old in directory.glob(pattern):
                old.unlink()
    writable_dir(directory, "the model directory")
    build(name, dtype=dtype).save_pretrained(directory)
    load_tokenizer(name).save_pretrained(directory)
    for written in ("config.json", "model.safetensors"):
        if not (directory / written).is_file():
            raise OSError(f"writing {directory} left no {written}: check that the path is writable")
    # transformers writes the weights through a private temporary file (mode 0600): give them config.json's mode,
    # which is what the user's umask makes of a new file
    mode = (directory / "config.json").stat().st_mode & 0o777
    for weights in directory.glob("model*.safetensors"):
        weights.chmod(mode)
    return directory
