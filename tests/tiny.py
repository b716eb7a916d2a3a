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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
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

    from offspec.formats.published import ct_params, gptq_params, quantize
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


GGUF_TENSOR_NAMES = {      # transformers' parameter suffix -> llama.cpp's, as its converter names them
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def byte_level_tokens() -> list[str]:
    """GPT-2's byte-level alphabet (every byte as one printable character), two merges, then the chat specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return [bytes_to_unicode()[b] for b in range(256)] + ["he", "ll"] + ["<|im_start|>", "<|im_end|>"]


BYTE_LEVEL_MERGES = ["h e", "l l"]


def _gguf_blocks(w: torch.Tensor, type_name: str, g: torch.Generator):
    """w (N, K) float32 -> its GGML blocks (N, row bytes) uint8 numpy. Types gguf-py quantizes are quantized from
    w; the K-quants (no quantizer in gguf-py) are random blocks whose scales give weights of about w's size."""
    import gguf
    import numpy as np
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in ("Q4_K", "Q5_K", "Q6_K"):
        return gguf.quants.quantize(w.numpy(), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (w.numel() // block, size), generator=g, dtype=torch.uint8).numpy()
    s = float(w.abs().mean())
    d = np.full(len(blocks), s / (64 * 16) if type_name == "Q6_K" else s / (32 * 8), np.float16).view(np.uint8)
    if type_name == "Q6_K":
        blocks[:, 208:210] = d.reshape(-1, 2)
    else:
        blocks[:, 0:2] = d.reshape(-1, 2)
        blocks[:, 2:4] = np.full(len(blocks), s / 32, np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(w.shape[0], -1)


def save_gguf(model, path: Path, types=None, tokenizer: bool = True, rope_freqs=None, split_max_tensors: int = 0,
              meta: dict | None = None) -> Path:
    """`model` written as llama.cpp writes a GGUF: its metadata, llama.cpp's tensor names, llama's q and k rows
    permuted as its converter does, norms and biases in F32, the embedding and lm_head in Q8_0 and each decoder
    matrix in types[field] (a type name, or one a layer; default Q8_0); a byte-level tokenizer with the chat
    template (tokenizer=True); rope_freqs: llama 3's per-frequency divisors, stored as llama.cpp does;
    split_max_tensors: split into files of that many tensors as gguf-split does (-> the first file); meta: metadata
    values that replace the model's ({"qwen2.attention.head_count": "four"}: any value, its type as given)."""
    import gguf
    import numpy as np

    cfg, types, path, meta = model.config, dict(types or {}), Path(path), dict(meta or {})
    arch = cfg.model_type
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for key, value in (("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
                       ("feed_forward_length", cfg.intermediate_size), ("block_count", cfg.num_hidden_layers),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                       ("rope.dimension_count", head_dim), ("vocab_size", cfg.vocab_size)):
        meta.setdefault(f"{arch}.{key}", value)
    meta.setdefault(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    meta.setdefault(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    for key, value in meta.items():
        kind = (gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.FLOAT32
                if isinstance(value, float) else gguf.GGUFValueType.UINT32)
        writer.add_key_value(key, value, kind)
    if tokenizer:
        tokens = byte_level_tokens()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
        writer.add_token_merges(BYTE_LEVEL_MERGES)
        writer.add_bos_token_id(len(tokens) - 2)
        writer.add_eos_token_id(len(tokens) - 1)
        writer.add_chat_template(CHAT_TEMPLATE)
    g = torch.Generator().manual_seed(5)
    for name, p in model.state_dict().items():
        w = p.detach().float()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name, field = f"blk.{i}.{GGUF_TENSOR_NAMES[rest]}", rest.split(".")[-2]
            if arch == "llama" and field in ("q_proj", "k_proj"):     # llama.cpp's LlamaModel.permute
                heads = cfg.num_attention_heads if field == "q_proj" else cfg.num_key_value_heads
                w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            kind = types.get(field, "Q8_0") if w.dim() == 2 else "F32"
            kind = kind if isinstance(kind, str) else kind[int(i)]
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
            kind = "Q8_0" if w.dim() == 2 else "F32"
        if kind == "F32":
            writer.add_tensor(gguf_name, np.ascontiguousarray(w.numpy()))
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(_gguf_blocks(w, kind, g)),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return min(path.parent.glob(f"{path.stem}-00001-of-*.gguf")) if split_max_tensors else path
