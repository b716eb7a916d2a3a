"""Real models' shapes without their weights: config.json + safetensors headers only (no tensor data), or a GGUF
file's header alone (a name ending in .gguf), made in tests, so plans for 7B–72B checkpoints can be made and checked
here (offspec reads headers only to plan).

The configs carry the public config.json values of each model (the fields offspec reads)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

LLAMA2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, max_position_embeddings=4096,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, max_position_embeddings=131072,
              rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
              rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192))
QWEN25 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=32768, rms_norm_eps=1e-6,
              rope_theta=1000000.0, hidden_act="silu")

MODELS = {
    "Llama-2-7b-chat-hf": dict(LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32),
    "Llama-2-13b-chat-hf": dict(LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                num_attention_heads=40, num_key_value_heads=40),
    "Llama-2-70b-chat-hf": dict(LLAMA2, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                num_attention_heads=64, num_key_value_heads=8),
    "TinyLlama-1.1B-Chat-v1.0": dict(LLAMA2, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                     num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
    "Llama-3.1-70B-Instruct": dict(LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "Llama-3.1-8B-Instruct": dict(LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "Llama-3.2-1B-Instruct": dict(LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                                  rope_scaling=dict(LLAMA3["rope_scaling"], factor=32.0)),
    "Qwen2.5-72B-Instruct": dict(QWEN25, vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                                 num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                 tie_word_embeddings=False),
    "Qwen2.5-7B-Instruct": dict(QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                tie_word_embeddings=False),
    "Qwen2.5-0.5B-Instruct": dict(QWEN25, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                  tie_word_embeddings=True),
}
# A published AWQ checkpoint of the 70B (as hugging-quants' Meta-Llama-3.1-70B-Instruct-AWQ-INT4 is: float16, its
# decoder linears as AutoAWQ's GEMM pieces, groups of 128).
MODELS["Meta-Llama-3.1-70B-Instruct-AWQ-INT4"] = dict(
    MODELS["Llama-3.1-70B-Instruct"], torch_dtype="float16",
    quantization_config=dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm",
                             modules_to_not_convert=None))
# GGUF files as llama.cpp's quantize writes them (bartowski's Meta-Llama-3.1-70B-Instruct-Q4_K_M.gguf: 42.5 GB).
MODELS["Meta-Llama-3.1-70B-Instruct-Q4_K_M.gguf"] = dict(MODELS["Llama-3.1-70B-Instruct"], gguf="Q4_K_M")
MODELS["Llama-3.2-1B-Instruct-Q8_0.gguf"] = dict(MODELS["Llama-3.2-1B-Instruct"], gguf="Q8_0")


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an HF Llama-family checkpoint and its shape (an AWQ checkpoint's linears: their
    pieces, qweight (K, N/8) and qzeros (K/G, N/8) int32, scales (K/G, N))."""
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or D // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
                       p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
        if cfg["model_type"] == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    awq = cfg.get("quantization_config")
    if awq:
        G = awq["group_size"]
        for name in [n for n in shapes if n.endswith("_proj.weight")]:
            (N, K), base = shapes.pop(name), name.removesuffix(".weight")
            shapes.update({f"{base}.qweight": (K, N // 8), f"{base}.qzeros": (K // G, N // 8),
                           f"{base}.scales": (K // G, N)})
    return shapes


def headers_only_checkpoint(folder: Path, name: str) -> Path:
    """MODELS[name] as a folder of config.json and one model.safetensors that holds its header and no data (a GGUF
    name: a file of its header alone)."""
    cfg = MODELS[name]
    if name.endswith(".gguf"):
        return headers_only_gguf(Path(folder) / name, cfg)
    folder = Path(folder) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    header, offset = {}, 0
    for tensor, shape in tensor_shapes(cfg).items():
        packed = tensor.endswith((".qweight", ".qzeros"))
        dtype = "I32" if packed else "F16" if cfg.get("quantization_config") else "BF16"
        nbytes = 4 if packed else 2
        for d in shape:
            nbytes *= d
        header[tensor] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
GGML = {"F32": (0, 1, 4), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210)}  # id, block, bytes


def gguf_types(cfg: dict, name: str, layer: int) -> str:
    """llama.cpp's type for a tensor: Q8_0 throughout, or Q4_K_M's recipe: Q4_K, with attn_v and ffn_down in Q6_K
    in the layers its use_more_bits picks (the first and last eighth, every third between) and output in Q6_K."""
    if cfg["gguf"] == "Q8_0" or name.endswith(("norm.weight", ".bias", "rope_freqs.weight")):
        return "Q8_0" if cfg["gguf"] == "Q8_0" and not name.endswith(("norm.weight", ".bias", "freqs.weight")) else "F32"
    n = cfg["num_hidden_layers"]
    more = layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2
    return "Q6_K" if name == "output.weight" or (name in ("attn_v.weight", "ffn_down.weight") and more) else "Q4_K"


def headers_only_gguf(path: Path, cfg: dict) -> Path:
    """A GGUF of cfg's shape whose file ends after its header: metadata, tensor infos, no data."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    arch = cfg["model_type"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    meta = [("general.architecture", 8, arch), (f"{arch}.block_count", 4, cfg["num_hidden_layers"]),
            (f"{arch}.context_length", 4, cfg["max_position_embeddings"]),
            (f"{arch}.embedding_length", 4, cfg["hidden_size"]), (f"{arch}.feed_forward_length", 4,
                                                                  cfg["intermediate_size"]),
            (f"{arch}.attention.head_count", 4, cfg["num_attention_heads"]),
            (f"{arch}.attention.head_count_kv", 4, cfg["num_key_value_heads"]),
            (f"{arch}.rope.dimension_count", 4, hd), (f"{arch}.rope.freq_base", 6, cfg["rope_theta"]),
            (f"{arch}.attention.layer_norm_rms_epsilon", 6, cfg["rms_norm_eps"])]
    kv = b"".join(string(k) + struct.pack("<I", t) + (string(v) if t == 8 else struct.pack("<I" if t == 4 else "<f", v))
                  for k, t, v in meta)
    tensors = {}
    for hf_name, shape in tensor_shapes(cfg).items():
        if hf_name.startswith("model.layers."):
            i, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            name, layer = f"blk.{i}.{GGUF_NAMES[rest]}", int(i)
        else:
            name, layer = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                           "lm_head.weight": "output.weight"}[hf_name], 0
        tensors[name] = (shape, gguf_types(cfg, name.split(".", 2)[-1] if name.startswith("blk.") else name, layer))
    if cfg.get("rope_scaling"):
        tensors["rope_freqs.weight"] = ((hd // 2,), "F32")
    infos, offset = b"", 0
    for name, (shape, kind) in tensors.items():
        type_id, block, size = GGML[kind]
        infos += string(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape[::-1])
        infos += struct.pack("<IQ", type_id, offset)
        n = 1
        for d in shape:
            n *= d
        offset += -(-(n // block * size) // 32) * 32
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + kv + infos)
    return path
