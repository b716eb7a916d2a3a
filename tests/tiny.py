"""Tiny random Hugging Face checkpoints (model + char-level tokenizer with a chat template), made in tests."""
from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]
CHARS = list(string.ascii_letters + string.digits + string.punctuation + " \n")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 128


def make_tokenizer(n_tokens: int | None = None, padding_tokens: int = 0):
    """The char-level tokenizer: 100 ids (the specials, then CHARS), or its first `n_tokens` ids; then
    `padding_tokens` '[PAD<id>]' entries, as GGUF conversions append up to a padded row count."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    tokens = (SPECIALS + CHARS)[:n_tokens]
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(padding_tokens)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<pad>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config(arch: str = "llama", n_layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
              tie: bool = False, rope_scaling: dict | None = None, vocab: int = VOCAB):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0)
        if rope_scaling:
            cfg.rope_parameters = {"rope_theta": 10000.0, **rope_scaling}
        return cfg
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0)
    if arch == "qwen3":   # per-head q/k norms, no biases, head_dim given apart from hidden / heads
        return Qwen3Config(**common, rope_theta=1000000.0, head_dim=2 * hidden // heads)
    if arch == "mistral":
        return MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
    raise ValueError(arch)


def make_model(cfg, seed: int = 0, scale: float = 1.0):
    """A random transformers model; `scale` multiplies every weight init so logits are peaked, not flat."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * scale * (1.0 / p.shape[-1] ** 0.5))
    return model.eval()


def save_checkpoint(model, path: Path, tokenizer=None, dtype: torch.dtype = torch.float32) -> Path:
    path = Path(path)
    model.to(dtype).save_pretrained(path)
    (tokenizer or make_tokenizer()).save_pretrained(path)
    model.to(torch.float32)
    return path


def perturbed_copy(model, noise: float, seed: int = 1):
    """The same model with relative Gaussian noise on every weight: a draft that often agrees."""
    import copy

    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.abs().mean() * torch.randn_like(p))
    return draft


def save_agreeing_pair(root: Path, n_layers: int, seed: int = 7, tie: bool = False, arch: str = "qwen2"):
    """A target (qwen2-shaped unless told) with peaked distributions (scale 3) and a draft that often agrees with
    it (a 2% noisy copy), saved under root -> (target dir, draft dir, target model)."""
    target = make_model(hf_config(arch, n_layers=n_layers, tie=tie), seed=seed, scale=3.0)
    draft = perturbed_copy(target, noise=0.02)
    return save_checkpoint(target, Path(root) / "target"), save_checkpoint(draft, Path(root) / "draft"), target


def with_rows(model, rows: int, seed: int = 2, head_scale: float = 1.0):
    """A copy of `model` with `rows` embedding and lm_head rows (a padded vocabulary): its first min(rows, V)
    rows are the model's own, any rows past V are random like the rest, their lm_head rows times `head_scale`
    (1: a new row wins as often as any other; below 1: less often)."""
    import copy

    torch.manual_seed(seed)
    resized = copy.deepcopy(model)
    old = model.config.vocab_size
    resized.resize_token_embeddings(rows, mean_resizing=False)
    embed, head = resized.get_input_embeddings().weight, resized.get_output_embeddings().weight
    with torch.no_grad():
        for p in {id(w): w for w in (embed, head)}.values():
            p[old:] = torch.randn_like(p[old:]) * p[:old].std()
        if head is not embed:
            head[old:] *= head_scale
    assert resized.config.vocab_size == rows
    return resized.eval()


def save_published_checkpoint(model, path: Path, quant: str = "awq-g32", act_order: bool = False,
                              tokenizer=None) -> Path:
    """`model` saved as a published quantized checkpoint is: every decoder linear as its pieces (published.quantize:
    min-max per group, whose packing tests/test_published.py checks against AutoAWQ's and GPTQModel's own
    dequantization), the rest in float16, and config.json's quantization_config as AutoAWQ (quant "awq-g…"),
    GPTQModel ("gptq-b…-g…[-v2]"; act_order: its rows' groups shuffled, as desc_act makes them) or llm-compressor
    ("ct-b…-g…[-asym]-<scale dtype>") write it."""
    import json

    from safetensors.torch import load_file, save_file

    from offspec.published import ct_params, gptq_params, quantize
    path = save_checkpoint(model, path, tokenizer, dtype=torch.float16)
    (weights_file,) = path.glob("*.safetensors")
    tensors = load_file(weights_file)
    g = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if ".layers." in n and n.endswith("_proj.weight")]:
        w = tensors.pop(name)
        order = torch.randperm(w.shape[1], generator=g) if act_order else None
        pieces = quantize(quant, w, order)
        if quant.startswith("ct-"):
            pieces["weight_shape"] = torch.tensor(list(w.shape))      # (llm-compressor saves it; offspec reads none)
        tensors.update({f"{name.removesuffix('.weight')}.{suffix}": piece.contiguous()
                        for suffix, piece in pieces.items()})
    save_file(tensors, weights_file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if quant.startswith("awq-"):
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": int(quant[5:]),
                                         "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    elif quant.startswith("ct-"):
        bits, group, asym, _ = ct_params(quant)
        strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                          "weights": {"num_bits": bits, "type": "int", "symmetric": not asym,
                                                      "dynamic": False, "actorder": None, **strategy},
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}
    else:
        bits, group, v2 = gptq_params(quant)
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group or -1,
                                         "desc_act": act_order, "sym": not v2,
                                         "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
