"""Pre-quantized checkpoints as published: their matrices' pieces, read as they are and dequantized exactly.

A published quantization is named by one string, the target quantization a run carries (RuntimeConfig.
target_quant, quant.QuantizedLayout): the stored pieces of every matrix go into the layer's one aligned block as
they are, and quant.py dequantizes them right before the layer runs, as it does its own int8 and nf4 blocks.

    awq-g{G}   AutoAWQ's GEMM layout, 4 bits, zero point, groups of G input rows. A linear W (N out, K in) is
               stored transposed and packed:
                 qweight (K, N/8) int32   eight 4-bit values q[k, n] per int32, nibble i (bits 4i..4i+3) of
                                          qweight[k, c] holding column n = 8c + AWQ_ORDER[i]
                 qzeros  (K/G, N/8) int32 the zero points z[g, n], packed the same way
                 scales  (K/G, N) float16 s[g, n]
               W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n], computed in float16 (as AutoAWQ's
               dequantize_gemm does; the difference is a small integer, so float16 rounds the product once).

    gptq-b{B}-g{G}[-v2]   GPTQ (AutoGPTQ / GPTQModel), B = 4 or 8 bits, groups of G input rows (g0: one group),
               any act-order (g_idx). P = 32 / B values a word:
                 qweight (K/P, N) int32   q[k, n] in bits B·(k % P).. of qweight[k // P, n] (input rows packed)
                 qzeros  (groups, N/P)    z[g, n] in bits B·(n % P).. of qzeros[g, n // P]
                 scales  (groups, N) float16
                 g_idx   (K,) int32       the group of each input row
               W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n] in float16 (GPTQModel's dequantize_weight).
               The "gptq" checkpoint format (v1, AutoGPTQ's) stores every zero minus one; it is read as GPTQModel
               converts it to its v2 form: one added to each field of each qzeros word, as a 32-bit word sum.

    ct-b{B}-g{G}[-asym]-{bf16|f16|f32}   compressed-tensors pack-quantized (llm-compressor), weight-only int B = 4 or
               8, groups of G input rows (g0: one scale per output row), scales in the named dtype. P = 32 / B:
                 weight_packed     (N, K/P) int32   v[n, k] + 2^(B-1) in bits B·(k % P).. of word k // P
                 weight_scale      (N, K/G) the scale dtype
                 weight_zero_point (N/P, K/G) int32 (asymmetric only) z[n, g] + 2^(B-1), packed along the output rows
               W[n, k] = (v[n, k] - z[n, k // G]) * s[n, k // G] in the scale's dtype (its dequantize).

    gguf:...   a GGUF file's matrices, each its GGML blocks as one uint8 piece 'blocks' of the bytes its largest
               type over the layers takes (gguf_blocks.py: the string, the types, their dequantization).
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from offspec.errors import CheckpointError
from offspec.formats import gguf_blocks

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble i of a packed int32 holds column 8c + AWQ_ORDER[i]
DEQUANT_ELEMENTS = 1 << 22              # weights dequantized at a time (rows x N): bounds the temporaries, ~50 MB


def is_published(quant: str) -> bool:
    return quant.startswith(("awq-", "gptq-", "ct-", "gguf:"))


def awq_group(quant: str) -> int:
    return int(quant.removeprefix("awq-g"))


def gptq_params(quant: str) -> tuple[int, int, bool]:
    """'gptq-b4-g128-v2' -> (bits 4, group 128 (0: one group), v2 zeros True)."""
    parts = quant.split("-")
    return int(parts[1][1:]), int(parts[2][1:]), parts[-1] == "v2"


def describe(quant: str) -> str:
    """For reports: 'AWQ int4 (GEMM), groups of 128'."""
    if gguf_blocks.is_gguf(quant):
        return gguf_blocks.describe(quant)
    if quant.startswith("awq-"):
        return f"AWQ int4 (GEMM), groups of {awq_group(quant)}"
    if quant.startswith("gptq-"):
        bits, group, v2 = gptq_params(quant)
        groups = f"groups of {group}" if group else "one group a column"
        return f"GPTQ int{bits}, {groups}{', v2 zeros' if v2 else ''}"
    if quant.startswith("ct-"):
        bits, group, asym, scale_dtype = ct_params(quant)
        groups = f"groups of {group}" if group else "one scale a row"
        return (f"compressed-tensors int{bits}, {groups}, {'asymmetric' if asym else 'symmetric'}, "
                f"{str(scale_dtype).removeprefix('torch.')} scales")
    return quant


def per_layer_sizes(quant: str) -> bool:
    """A matrix's stored bytes differ between layers (a GGUF whose types do)."""
    return gguf_blocks.is_gguf(quant) and any(len(set(t)) > 1 for t in gguf_blocks.field_types(quant).values())


def used_nbytes(quant: str, field: str, shape: tuple[int, int], layer: Optional[int]) -> int:
    """Bytes of its piece an (N, K) GGUF matrix uses in this layer (its type's), of matrix_pieces' reserve."""
    N, K = shape
    return N * gguf_blocks.row_nbytes(gguf_blocks.type_of(quant, field, layer), K)


def short(quant: str) -> str:
    """For file names and tables: the quantization itself, a GGUF's in brief ('gguf-q4_k+q6_k')."""
    return gguf_blocks.short(quant) if gguf_blocks.is_gguf(quant) else quant


CT_SCALE_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def weight_dtype(quant: str) -> torch.dtype:
    """The dtype a format dequantizes in (its weights are exactly representable there): float16 for AWQ and
    GPTQ, the scales' dtype for compressed-tensors, float32 for GGUF."""
    if gguf_blocks.is_gguf(quant):
        return torch.float32
    return ct_params(quant)[3] if quant.startswith("ct-") else torch.float16


def ct_params(quant: str) -> tuple[int, int, bool, torch.dtype]:
    """'ct-b4-g128-asym-bf16' -> (bits 4, group 128 (0: per row), asymmetric True, scales bfloat16)."""
    parts = quant.split("-")
    return int(parts[1][1:]), int(parts[2][1:]), "asym" in parts, CT_SCALE_DTYPES[parts[-1]]


def with_scale_dtype(quant: str, header_dtype: str) -> str:
    """A compressed-tensors quantization completed by its scales' dtype, as the safetensors header gives it."""
    names = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
    if header_dtype not in names:
        raise CheckpointError(f"compressed-tensors scales of dtype {header_dtype} are not supported")
    return f"{quant}-{names[header_dtype]}"


def quant_of_config(raw: dict, where: str) -> str:
    """config.json's quantization_config -> the published quantization ("none" without one), or CheckpointError
    naming what is not supported."""
    qc = raw.get("quantization_config")
    if not qc:
        return "none"
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq_of_config(qc, where)
    if method == "compressed-tensors":
        return _ct_of_config(qc, raw, where)
    if method != "awq":
        raise CheckpointError(f"{where}: quantization_config quant_method {method or '(none)'!r} is not supported; "
                              f"offspec reads AWQ 4-bit GEMM, GPTQ 4/8-bit and compressed-tensors pack-quantized "
                              f"int4/int8 checkpoints as published")
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()     # (transformers 5 says "format")
    bits, group, zero = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size")), \
        qc.get("zero_point", True)
    if version != "gemm" or str(qc.get("backend", "autoawq")).lower() == "llm-awq":
        what = "backend 'llm-awq'" if version == "gemm" else f"version {version!r}"
        raise CheckpointError(f"{where}: AWQ {what} is not supported (only AutoAWQ's GEMM layout; an exllama or "
                              f"marlin repack needs the original GEMM checkpoint)")
    if bits != 4:
        raise CheckpointError(f"{where}: AWQ with {bits} bits is not supported (only 4)")
    if not zero:
        raise CheckpointError(f"{where}: AWQ without zero points is not supported")
    if not isinstance(group, int) or group <= 0:
        raise CheckpointError(f"{where}: AWQ group_size {group!r} is not supported (a positive group size)")
    _check_all_layers_quantized(qc.get("modules_to_not_convert") or [], raw, where)
    return f"awq-g{group}"


DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj")


def _check_all_layers_quantized(not_converted: list, raw: dict, where: str) -> None:
    """AutoAWQ's modules_to_not_convert (substrings of module names) may leave decoder linears dense: not supported
    yet, said in one line (entries naming other modules, the lm_head or a vision tower, are fine)."""
    names = [f"model.layers.{i}.{linear}" for i in range(int(raw.get("num_hidden_layers", 0)))
             for linear in DECODER_LINEARS]
    for entry in not_converted:
        hit = next((name for name in names if str(entry) in name), None)
        if hit:
            raise CheckpointError(f"{where}: modules_to_not_convert leaves {hit} (and maybe more) unquantized; a "
                                  f"checkpoint with dense decoder linears beside quantized ones is not supported yet")


def _gptq_of_config(qc: dict, where: str) -> str:
    bits, group = qc.get("bits"), qc.get("group_size", -1)
    fmt = str(qc.get("format") or qc.get("checkpoint_format") or "gptq").lower()   # GPTQModel lets "format" win
    for key, what in (("rotation", "an online rotation"), ("activation", "quantized activations"),
                      ("dynamic", "per-module overrides"), ("lm_head", "a quantized lm_head")):
        if qc.get(key):
            raise CheckpointError(f"{where}: GPTQ with {key}={qc[key]!r} ({what}) is not supported")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise CheckpointError(f"{where}: GPTQ pack_dtype {qc['pack_dtype']!r} is not supported (int32)")
    if bits not in (4, 8):
        raise CheckpointError(f"{where}: GPTQ with {bits} bits is not supported (4 or 8)")
    if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        raise CheckpointError(f"{where}: GPTQ checkpoint format {fmt!r} is not supported (gptq or gptq_v2; a marlin "
                              f"or exllama repack needs the original checkpoint)")
    if not isinstance(group, int) or group == 0 or group < -1:
        raise CheckpointError(f"{where}: GPTQ group_size {group!r} is not supported (a positive size, or -1)")
    return f"gptq-b{bits}-g{max(group, 0)}" + ("-v2" if fmt == "gptq_v2" else "")


def _ct_of_config(qc: dict, raw: dict, where: str) -> str:
    """compressed-tensors: one config group of weight-only int4/int8 over Linear layers, pack-quantized; -> the
    quantization without its scale dtype (Checkpoint adds it from the headers: with_scale_dtype)."""
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointError(f"{where}: compressed-tensors with {len(groups)} config groups is not supported (one)")
    (group_cfg,) = groups.values()
    fmt = str(group_cfg.get("format") or qc.get("format") or "").lower()
    weights = group_cfg.get("weights") or {}
    if fmt != "pack-quantized":
        raise CheckpointError(f"{where}: compressed-tensors format {fmt or '(none)'!r} is not supported (only "
                              f"pack-quantized int weights)")
    if group_cfg.get("input_activations") or group_cfg.get("output_activations"):
        raise CheckpointError(f"{where}: compressed-tensors with quantized activations is not supported "
                              f"(weight-only schemes such as W4A16)")
    if qc.get("transform_config"):
        raise CheckpointError(f"{where}: compressed-tensors with a transform_config (rotations such as QuIP or "
                              f"SpinQuant) is not supported")
    if qc.get("kv_cache_scheme"):
        raise CheckpointError(f"{where}: compressed-tensors with a kv_cache_scheme (a quantized KV cache) is not "
                              f"supported")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "weight", "static"):
        raise CheckpointError(f"{where}: compressed-tensors actorder {actorder!r} (a weight_g_idx per linear) is not "
                              f"supported yet")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
    if bits not in (4, 8) or kind != "int":
        raise CheckpointError(f"{where}: compressed-tensors {kind} weights of {bits} bits are not supported "
                              f"(int4, int8)")
    if strategy not in ("group", "channel"):
        raise CheckpointError(f"{where}: compressed-tensors strategy {strategy!r} is not supported (group, channel)")
    group = int(weights.get("group_size") or 0) if strategy == "group" else 0
    if strategy == "group" and group <= 0:
        raise CheckpointError(f"{where}: compressed-tensors group_size {weights.get('group_size')!r} is not supported")
    layers = [f"model.layers.{i}.{linear}" for i in range(int(raw.get("num_hidden_layers", 0)))
              for linear in DECODER_LINEARS]
    for entry in qc.get("ignore") or []:
        entry = str(entry)
        try:        # "re:<pattern>" matches names as compressed-tensors does (re.match); else the name itself
            hit = next((name for name in layers if (re.match(entry[3:], name) if entry.startswith("re:")
                                                    else name == entry)), None)
        except re.error as e:
            raise CheckpointError(f"{where}: compressed-tensors ignore entry {entry!r} is not a valid pattern "
                                  f"({e})") from None
        if hit:
            raise CheckpointError(f"{where}: its ignore list leaves {hit} (and maybe more) unquantized; a checkpoint "
                                  f"with dense decoder linears beside quantized ones is not supported yet")
    return f"ct-b{bits}-g{group}" + ("" if weights.get("symmetric", True) else "-asym")


def matrix_pieces(quant: str, shape: tuple[int, ...], field: Optional[str] = None) \
        -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The pieces an (N, K) matrix is published as: (suffix, shape, dtype). field: which matrix of a layer it is
    (a GGUF's types are per matrix)."""
    N, K = shape
    if gguf_blocks.is_gguf(quant):
        return [("blocks", (gguf_blocks.matrix_nbytes(quant, field, shape),), torch.uint8)]
    if quant.startswith("ct-"):
        bits, group, asym, scale_dtype = ct_params(quant)
        P, groups = 32 // bits, K // group if group else 1
        return ([("weight_packed", (N, K // P), torch.int32), ("weight_scale", (N, groups), scale_dtype)]
                + ([("weight_zero_point", (N // P, groups), torch.int32)] if asym else []))
    if quant.startswith("gptq-"):
        bits, group, _ = gptq_params(quant)
        P, groups = 32 // bits, -(-K // group) if group else 1
        return [("qweight", (K // P, N), torch.int32), ("qzeros", (groups, N // P), torch.int32),
                ("scales", (groups, N), torch.float16), ("g_idx", (K,), torch.int32)]
    G = awq_group(quant)
    return [("qweight", (K, N // 8), torch.int32), ("qzeros", (K // G, N // 8), torch.int32),
            ("scales", (K // G, N), torch.float16)]


def check_matrix(quant: str, shape: tuple[int, ...], name: str) -> Optional[str]:
    """Why an (N, K) matrix cannot be stored this way (None when it can): its sizes must divide."""
    N, K = shape
    if gguf_blocks.is_gguf(quant):
        return None        # gguf_read checks each matrix against its own type
    if quant.startswith("ct-"):
        bits, group, _, _ = ct_params(quant)
        P = 32 // bits
        if K % P or N % P or (group and K % group):
            return (f"{name}: {N} output and {K} input rows do not divide into {P} a word"
                    + (f" and groups of {group}" if group else ""))
        return None
    if quant.startswith("gptq-"):
        P = 32 // gptq_params(quant)[0]
        return (f"{name}: {N} output and {K} input rows are not both multiples of {P} (GPTQ packs {P} a word)"
                if N % P or K % P else None)
    G = awq_group(quant)
    if N % 8:
        return f"{name}: {N} output rows are not a multiple of 8 (AWQ packs 8 a word)"
    if K % G:
        return f"{name}: {K} input rows are not a multiple of the group size {G}"
    return None


def _nibbles(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) int32 -> its bytes' low and high nibbles, (R, C, 4) uint8 each: nibble 2j and 2j + 1 of every word.
    Byte views are little-endian, as CUDA devices and the hosts offspec runs on are; working on bytes spares the
    int32 shifts of every field."""
    b = words.contiguous().view(torch.uint8).view(words.shape[0], -1, 4)
    return b & 0xF, b >> 4


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (R, 8C) uint8 in column order (nibble i of word c holds column 8c + AWQ_ORDER[i]): columns
    8c .. 8c + 7 are nibbles 0 4 1 5 2 6 3 7 = low 0, low 2, high 0, high 2, low 1, low 3, high 1, high 3."""
    lo, hi = _nibbles(packed)
    order = (lo[..., 0], lo[..., 2], hi[..., 0], hi[..., 2], lo[..., 1], lo[..., 3], hi[..., 1], hi[..., 3])
    return torch.stack(order, -1).view(packed.shape[0], -1)


def _pack(values: torch.Tensor) -> torch.Tensor:
    """(R, 8C) values in 0..15 -> (R, C) int32, the inverse of _unpack: column 8c + AWQ_ORDER[i] into nibble i."""
    R = values.shape[0]
    return _pack_fields(values.reshape(R, -1, 8)[:, :, list(AWQ_ORDER)].reshape(R, -1), 4, dim=1)


def _step(rows: int, per_row: int, align: int) -> int:
    """Input rows a chunk of dequantization takes: about DEQUANT_ELEMENTS weights, a multiple of `align`."""
    return min(rows, max(align, DEQUANT_ELEMENTS // per_row // align * align))


def dequantize(quant: str, pieces: dict[str, torch.Tensor], out: torch.Tensor, field: Optional[str] = None,
               layer: Optional[int] = None) -> None:
    """out (N, K) in the compute dtype <- W = (q - z) * s in float16 (compressed-tensors: in the scales' dtype; a
    GGUF matrix: its type's formula in float32, gguf_blocks.dequantize), a chunk of rows at a time, so the
    temporaries stay about DEQUANT_ELEMENTS weights (and GPTQ's unpacked zeros, a group's row each) whatever the
    matrix: within the plan's reserve. field, layer: which matrix of which layer (a GGUF's type can differ between
    layers)."""
    if gguf_blocks.is_gguf(quant):
        gguf_blocks.dequantize(gguf_blocks.type_of(quant, field, layer), pieces["blocks"], out)
        return
    if quant.startswith("gptq-"):
        _dequantize_gptq(quant, pieces, out)
        return
    if quant.startswith("ct-"):
        _dequantize_ct(quant, pieces, out)
        return
    G = awq_group(quant)
    qweight, qzeros, scales = pieces["qweight"], pieces["qzeros"], pieces["scales"]    # (K, N/8), (K/G, N/8), (K/G, N)
    (K, _), N = qweight.shape, scales.shape[1]
    step = _step(K, N, G)                                                     # K and step are multiples of G
    for a in range(0, K, step):
        b = min(K, a + step)
        # Transposed while still bytes, so the float16 work is laid out as `out` is: (N, groups, G).
        q = _unpack(qweight[a:b]).t().reshape(N, (b - a) // G, G)             # uint8
        z = _unpack(qzeros[a // G: b // G]).t()[:, :, None]                   # (N, groups, 1) uint8
        s = scales[a // G: b // G].t()[:, :, None]                            # (N, groups, 1) float16
        out[:, a:b] = ((q.to(torch.float16) - z.to(torch.float16)) * s).view(N, b - a)   # differences exact


def _fields(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """(R, C) int32 words -> their 32/bits fields (4 or 8 bits) in order, lowest bits first, as uint8, spread along
    `dim` (0: each word becomes that many rows, (R·P, C); 1: that many columns, (R, C·P))."""
    R, C = words.shape
    if bits == 8:
        fields = words.contiguous().view(torch.uint8).view(R, C, 4)          # (R, C, P): byte i = field i
    else:
        fields = torch.stack(_nibbles(words), -1).view(R, C, 8)              # nibble 2j, 2j + 1 of byte j
    return fields.transpose(1, 2).reshape(-1, C) if dim == 0 else fields.view(R, -1)


def v1_zeros_as_v2(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """v1 qzeros (each field its zero minus one) -> v2's, as GPTQModel converts them: one added to every field,
    as a 32-bit word sum (int32 wraps as that sum does)."""
    ones = sum(1 << (bits * i) for i in range(32 // bits))
    return qzeros + (ones - (1 << 32) if ones >= 1 << 31 else ones)


def _dequantize_gptq(quant: str, pieces: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    bits, _, v2 = gptq_params(quant)
    qzeros = pieces["qzeros"] if v2 else v1_zeros_as_v2(pieces["qzeros"], bits)
    zeros = _fields(qzeros, bits, dim=1)                                          # (groups, N)
    scales, g_idx = pieces["scales"], pieces["g_idx"]
    K, P = g_idx.shape[0], 32 // bits
    step = _step(K, scales.shape[1], P)
    for a in range(0, K, step):
        b = min(K, a + step)
        q = _fields(pieces["qweight"][a // P: b // P], bits, dim=0)              # (b - a, N) uint8
        g = g_idx[a:b].long()
        out[:, a:b] = ((q.to(torch.float16) - zeros[g].to(torch.float16)) * scales[g]).t()   # differences exact


def _pack_fields(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of _fields: fields in 0..2^bits-1 along `dim` -> int32 words (the top field may set the sign)."""
    P = 32 // bits
    v = values.to(torch.int64)
    v = v.reshape(-1, P, v.shape[1]) if dim == 0 else v.reshape(v.shape[0], -1, P).transpose(1, 2)
    words = sum(v[:, i] << (bits * i) for i in range(P))                       # (rows, cols) int64
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()


def _quantize_gptq(quant: str, w: torch.Tensor, order: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Min-max per group, GPTQ's packing: asymmetric with v2 zeros; symmetric (zero 2^(B-1)) with v1's, whose
    stored zero minus one never borrows. order: act-order, the input rows in the order they were quantized."""
    bits, group, v2 = gptq_params(quant)
    maxq, (N, K) = 2 ** bits - 1, w.shape
    G, dev = group or K, w.device
    g_idx = torch.empty(K, dtype=torch.int32, device=dev)
    g_idx[torch.arange(K, device=dev) if order is None else order.to(dev)] = \
        (torch.arange(K, device=dev) // G).to(torch.int32)
    W = w.float().t()                                                            # (K, N)
    n_groups = -(-K // G)
    scales, zeros = torch.empty(n_groups, N, device=dev), torch.empty(n_groups, N, device=dev)
    for g in range(n_groups):
        rows = W[g_idx == g]
        lo, hi = rows.amin(0), rows.amax(0)
        if v2:
            scales[g], zeros[g] = (hi - lo).clamp(min=1e-5) / maxq, 0
            zeros[g] = torch.round(-lo / scales[g].to(torch.float16).float()).clamp(0, maxq)
        else:
            scales[g], zeros[g] = (2 * torch.maximum(lo.abs(), hi.abs())).clamp(min=1e-5) / maxq, (maxq + 1) // 2
    scales = scales.to(torch.float16)
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]                     # (K, N) each
    q = (torch.round(W / s) + z).clamp(0, maxq)
    stored = zeros if v2 else zeros - 1
    return {"qweight": _pack_fields(q, bits, dim=0), "qzeros": _pack_fields(stored, bits, dim=1),
            "scales": scales, "g_idx": g_idx}


def _dequantize_ct(quant: str, pieces: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """compressed-tensors: a chunk of output rows at a time (the values are packed along the input rows)."""
    bits, _, asym, scale_dtype = ct_params(quant)
    P, offset = 32 // bits, 1 << (bits - 1)
    scales = pieces["weight_scale"]                                               # (N, groups)
    (N, groups), K = scales.shape, out.shape[1]
    step = _step(N, K, P)
    for a in range(0, N, step):
        b = min(N, a + step)
        # The stored fields are value + offset (uint8); in the scale dtype the signed values and their
        # differences are exact small integers, as compressed-tensors' own x_q - zero_point is.
        v = _fields(pieces["weight_packed"][a:b], bits, dim=1).to(scale_dtype) - offset       # (b - a, K)
        v = v.view(b - a, groups, K // groups)
        s = scales[a:b][:, :, None]                                               # (b - a, groups, 1)
        if asym:
            z = _fields(pieces["weight_zero_point"][a // P: -(-b // P)], bits, dim=0).to(scale_dtype) - offset
            v = v - z[: b - a, :, None]                                           # (rows, groups) zero points
        out[a:b] = (v * s).view(b - a, K)


def _quantize_ct(quant: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Min-max per group into compressed-tensors' pack-quantized pieces (symmetric: no zero point)."""
    bits, group, asym, scale_dtype = ct_params(quant)
    lo_q, hi_q = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    N, K = w.shape
    G = group or K
    x = w.float().view(N, K // G, G)
    if asym:
        lo, hi = x.amin(-1), x.amax(-1)
        scale = ((hi - lo).clamp(min=1e-5) / (hi_q - lo_q)).to(scale_dtype)
        zero = (lo_q - torch.round(lo / scale.float())).clamp(lo_q, hi_q)
    else:
        scale = (x.abs().amax(-1).clamp(min=1e-5) / hi_q).to(scale_dtype)
        zero = torch.zeros(N, K // G, device=w.device)
    v = (torch.round(x / scale.float()[..., None]) + zero[..., None]).clamp(lo_q, hi_q).view(N, K)
    pieces = {"weight_packed": _pack_fields(v + (1 << (bits - 1)), bits, dim=1), "weight_scale": scale}
    if asym:
        pieces["weight_zero_point"] = _pack_fields(zero + (1 << (bits - 1)), bits, dim=0)
    return pieces


def quantize(quant: str, w: torch.Tensor, order: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """w (N, K) -> its pieces by min-max quantization per group: AWQ (AutoAWQ's pseudo_quantize and GEMM packing,
    without the activation-aware scale search, which only changes w before this step) or GPTQ (_quantize_gptq,
    without GPTQ's error feedback, which only changes the values). For tests and the probe; a published checkpoint
    is read as it is."""
    if quant.startswith("gptq-"):
        return _quantize_gptq(quant, w, order)
    if quant.startswith("ct-"):
        return _quantize_ct(quant, w)
    G = awq_group(quant)
    N, K = w.shape
    groups = w.float().t().reshape(K // G, G, N)                              # (K/G, G, N)
    lo, hi = groups.amin(dim=1), groups.amax(dim=1)                           # (K/G, N)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.float()
    zeros = (-torch.round(lo / s)).clamp(0, 15)
    q = (torch.round(groups / s[:, None]) + zeros[:, None]).clamp(0, 15).reshape(K, N)
    return {"qweight": _pack(q), "qzeros": _pack(zeros), "scales": scales}
