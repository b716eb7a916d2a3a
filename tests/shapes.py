"""Real models' shapes without their weights: config.json + safetensors headers only (no tensor data), made
in tests, so plans for 7B–72B checkpoints can be made and checked here (offspec reads headers only to plan).

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
    """MODELS[name] as a folder of config.json and one model.safetensors that holds its header and no data."""
    cfg = MODELS[name]
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
