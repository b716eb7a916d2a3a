"""The target's quantized layer blocks (`--target-quant int8|nf4`, and the published formats' pieces).

A streamed pass costs its bytes over the link, so each target layer can be stored, pinned, read and copied
quantized, and dequantized on the compute device into a dense layer in the compute dtype right before it runs. A
QuantizedLayout is one layer's packed block: every matrix as its quantized payload plus its quantization state,
norms and biases as they are, all in ONE aligned block, so the arena, the disk store, the ring and the copy stay
what they are for dense layers.

    nf4   bitsandbytes' NormalFloat4, blocks of NF4_BLOCK weights: 2 weights a byte + one float32 absmax a
          block (4.5 bits a weight, 0.28x bf16)
    int8  symmetric per output row (int8_rows, as the draft's copy): 1 byte a weight + one scale a row (0.50x bf16)

Quantizing changes the target: with --target-quant the output is exactly the QUANTIZED target's (its greedy
tokens, its distribution), and every report says which target ran. A single matrix's pieces (matrix_pieces,
quantize_matrix, dequantize_matrix) also serve the draft's held matrices (weights.HeldWeight).
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from offspec.config import ModelConfig
from offspec.errors import InputError
from offspec.formats import kernels, published
from offspec.formats.layout import TENSOR_ALIGN, LayerLayout, LayerWeights, PartLayout, round_up, split_entries

TARGET_QUANTS = ("none", "int8", "nf4")      # the target's layer blocks
NF4_BLOCK = 64                               # weights per nf4 absmax (bitsandbytes' finest block size)


INT8_ROWS_AT_ONCE = 512     # int8_rows quantizes this many rows at a time (their float32 copy, not the matrix's)


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) floating -> q (N, K) int8, scale (N,) float32 with w ~= q * scale[:, None] (symmetric, per row:
    scale = max |row| / 127). The formula of bitsandbytes' int8_vectorwise_quant, written here so the draft's
    default CPU path does not import bitsandbytes (1.5 s); its rounding differs from it by one step at most."""
    N = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)                       # (N, K)
    scale = torch.empty(N, dtype=torch.float32, device=w.device)                      # (N,)
    for a in range(0, N, INT8_ROWS_AT_ONCE):        # a block of rows at a time: its float copy stays in cache
        wf = w[a:a + INT8_ROWS_AT_ONCE].to(torch.float32, copy=True)     # a copy: divided in place below
        s = wf.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        q[a:a + INT8_ROWS_AT_ONCE] = wf.div_(s[:, None]).round_().clamp_(-127, 127)
        scale[a:a + INT8_ROWS_AT_ONCE] = s
    return q, scale



# ---------------------------------------------------------------- the target's quantized layer blocks

@functools.cache
def bitsandbytes_ops():
    """torch.ops.bitsandbytes, imported on first use (1.5 s), or InputError in one line when it cannot be.
    Cached: the streamer asks for it for every matrix it dequantizes."""
    # bitsandbytes' CPU backend warns that its fused 4-bit kernel needs the `kernels` package; offspec dequantizes
    # and runs its own matmul (docs/notes/2026-11-23-held-quantized-layers-and-drafts.md): the warning is noise.
    cpu_ops_log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = cpu_ops_log.level
    cpu_ops_log.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes and its backends)
    except Exception as err:   # ImportError, or a broken native library raising anything at import
        raise InputError(f"nf4 (--target-quant / --draft-quant) needs bitsandbytes, which cannot be imported here "
                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                         f"pip install bitsandbytes, or use int8 (--target-quant int8, --draft-quant int8-held) "
                         f"or none") from None
    finally:
        cpu_ops_log.setLevel(level)
    return torch.ops.bitsandbytes


def check_target_quant(quant: str, device: torch.device, dtype: torch.dtype, option: str = "") -> None:
    """Refuse, in one line, a quantization this device and dtype cannot run: try it on a small matrix now,
    not after packing a 70B store. option: how the user asked for it (default --target-quant QUANT)."""
    if quant not in TARGET_QUANTS and not published.is_published(quant):
        raise InputError(f"unknown target quantization {quant!r}; choose one of {', '.join(TARGET_QUANTS)}")
    if quant == "none":
        return
    option = option or f"--target-quant {quant}"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InputError(f"{option} dequantizes into float32, bfloat16 or float16, not {dtype}")
    if published.is_published(quant):
        return             # plain torch on every device
    probe = torch.linspace(-1, 1, 2 * NF4_BLOCK).view(2, NF4_BLOCK)   # (2, 64)
    pieces = {name: t.to(device) for name, t in quantize_matrix(quant, probe, dtype).items()}
    out = torch.empty(probe.shape, dtype=dtype, device=device)
    try:
        dequantize_matrix(quant, pieces, out)
    except Exception as err:   # bitsandbytes without a kernel for this device raises NotImplementedError & co.
        raise InputError(f"{option} cannot run on {device} in {str(dtype).removeprefix('torch.')} "
                         f"with this bitsandbytes ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if not torch.allclose(out.float().cpu(), probe, atol=0.2):   # nf4 levels are up to 0.28 apart
        raise InputError(f"{option}: bitsandbytes' {device} kernels return wrong values here")


def matrix_pieces(quant: str, shape: tuple[int, ...], dtype: torch.dtype,
                   field: Optional[str] = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The pieces a quantized (N, K) matrix (the layer's `field`) is stored as: (suffix, shape, dtype)."""
    if published.is_published(quant):
        return published.matrix_pieces(quant, shape, field)
    n = math.prod(shape)
    if quant == "nf4":
        return [("nf4", ((n + 1) // 2,), torch.uint8), ("absmax", (-(-n // NF4_BLOCK),), torch.float32)]
    return [("int8", shape, torch.int8), ("scale", (shape[0],), dtype)]


def quantize_matrix(quant: str, w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """w (N, K) -> its pieces by suffix, on w's device (bitsandbytes quantizes nf4 from the float32 values)."""
    if published.is_published(quant):
        return published.quantize(quant, w)
    if quant == "nf4":
        packed, state = bitsandbytes_ops().quantize_4bit(w.float(), NF4_BLOCK, "nf4", torch.uint8)
        return {"nf4": packed.reshape(-1), "absmax": state}
    q, scale = int8_rows(w)
    return {"int8": q, "scale": scale.to(dtype)}


def dequantize_matrix(quant: str, pieces: dict[str, torch.Tensor], out: torch.Tensor, field: Optional[str] = None,
                       layer: Optional[int] = None) -> None:
    """out (N, K), in the compute dtype <- the matrix its pieces hold (field of layer: see published.dequantize).
    On a CUDA device by one fused kernel (kernels.py); elsewhere, or where the kernels cannot run, by the torch
    transcriptions below: the same values, bit for bit."""
    if kernels.dequantize(quant, pieces, out, field, layer):
        return
    if quant == "int8":
        # q then a row scale, in place: two passes over `out`, no temporary (the fastest of the ways tried:
        # docs/notes/2026-11-23-held-quantized-layers-and-drafts.md).
        out.copy_(pieces["int8"])
        out.mul_(pieces["scale"][:, None])
        return
    if published.is_published(quant):
        published.dequantize(quant, pieces, out, field, layer)
        return
    ops = bitsandbytes_ops()
    args = (pieces["nf4"], pieces["absmax"], NF4_BLOCK, "nf4", list(out.shape), out.dtype)
    if out.device.type == "cuda":
        ops.dequantize_4bit.out(*args, out=out)       # straight into the slot
    else:
        out.copy_(ops.dequantize_4bit(*args))          # the CPU backend has no .out variant


@dataclass(frozen=True)
class QuantizedLayout:
    """One target layer as ONE flat uint8 block: each matrix's quantized payload and its quantization state,
    the norms and biases in the compute dtype, every piece on a TENSOR_ALIGN boundary. Moving a layer stays
    one copy; dequantize() then fills a dense block (`dense`, the layout the forward reads) in place."""
    quant: str                                                          # "int8" | "nf4"
    dense: LayerLayout                                                  # what a block dequantizes into
    entries: tuple[tuple[str, tuple[int, ...], int, torch.dtype], ...]  # (piece, shape, byte offset, dtype)
    nbytes: int                                                         # block size, a multiple of TENSOR_ALIGN

    @staticmethod
    def of(cfg: ModelConfig, dtype: torch.dtype, quant: str) -> "QuantizedLayout":
        if quant not in TARGET_QUANTS[1:] and not published.is_published(quant):
            raise InputError(f"unknown target quantization {quant!r}; choose one of {', '.join(TARGET_QUANTS)}")
        dense = LayerLayout.of(cfg, dtype)
        entries, offset = [], 0
        for name, shape, _ in dense.entries:
            pieces = (matrix_pieces(quant, shape, dtype, name) if len(shape) == 2 else [("", shape, dtype)])
            for suffix, piece_shape, piece_dtype in pieces:
                entries.append((f"{name}.{suffix}" if suffix else name, piece_shape, offset, piece_dtype))
                offset += round_up(math.prod(piece_shape) * piece_dtype.itemsize, TENSOR_ALIGN)
        return QuantizedLayout(quant=quant, dense=dense, entries=tuple(entries), nbytes=offset)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype the layer dequantizes into."""
        return self.dense.dtype

    def describe(self) -> list:
        """The layout as JSON values (the disk store's manifest records it)."""
        return [[name, list(shape), offset, str(dtype).removeprefix("torch.")]
                for name, shape, offset, dtype in self.entries]

    def pieces(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every piece as a typed view into `block` (uint8, (≥ nbytes,)); nothing is copied."""
        return _pieces(block, self.entries, self.nbytes)

    def pack(self, weights: dict[str, torch.Tensor], block: torch.Tensor) -> None:
        """Named tensors into their places in `block`, padding zeroed: a matrix given dense (any float dtype) is
        quantized here, one given as its pieces ('q_proj.qweight', ...: a published checkpoint's) is copied as
        it is."""
        block.zero_()
        out = self.pieces(block)
        for name, shape, _ in self.dense.entries:
            if len(shape) == 2 and name not in weights:
                given = {suffix: weights[f"{name}.{suffix}"] for suffix, _, _ in
                         matrix_pieces(self.quant, shape, self.dtype, name)}
            else:
                src = weights[name]
                if tuple(src.shape) != shape:
                    raise ValueError(f"{name}: expected shape {shape}, got {tuple(src.shape)}")
                if len(shape) != 2:
                    out[name].copy_(src)
                    continue
                given = quantize_matrix(self.quant, src, self.dtype)
            for suffix, piece in given.items():
                if piece.numel() != out[f"{name}.{suffix}"].numel():
                    raise ValueError(f"{name}.{suffix}: expected shape {tuple(out[f'{name}.{suffix}'].shape)}, got "
                                     f"{tuple(piece.shape)}")
                out[f"{name}.{suffix}"].copy_(piece.reshape(out[f"{name}.{suffix}"].shape))

    def dequantize(self, block: torch.Tensor, dense_block: torch.Tensor, layer: Optional[int] = None) -> None:
        """dense_block ((≥ dense.nbytes,) uint8, on the compute device) <- the layer in `block` (same device),
        in the compute dtype: the bytes dense.views() reads as LayerWeights. layer: which one it is (a GGUF's
        matrix types can differ between layers)."""
        _dequantize_entries(self.quant, _pieces(block, self.entries, self.nbytes), self.dense.views(dense_block),
                            self.dense.entries, layer)

    def moved_nbytes(self, layer: Optional[int]) -> int:
        """Bytes a load of `layer` copies (QuantizedPart.runs_for: a GGUF matrix's unused tail is left out)."""
        return sum(n for _, _, n in self.parts(split=False)[0].runs_for(layer))

    def parts(self, split: bool) -> tuple["QuantizedPart", ...]:
        """How a ring slot holds this layer: whole (the block as it is), or split into LAYER_PARTS as the dense
        layout is, each part's pieces packed one after another from the slot's start."""
        dense_parts = self.dense.parts(split)
        if not split:
            return (QuantizedPart(self.quant, ((0, 0, self.nbytes),), self.entries, self.nbytes, dense_parts[0]),)
        return tuple(QuantizedPart(self.quant, runs, entries, nbytes, dense)
                     for (runs, entries, nbytes), dense in zip(split_entries(self.entries, self.nbytes).values(),
                                                               dense_parts))


@dataclass(frozen=True)
class QuantizedPart:
    """One part of a quantized layer as a ring slot holds it (QuantizedLayout.parts): its pieces, copied run by
    run into the slot, dequantized from there into a buffer that `dense` (a layout.PartLayout) reads."""
    quant: str
    runs: tuple[tuple[int, int, int], ...]                              # (block offset, slot offset, nbytes)
    entries: tuple[tuple[str, tuple[int, ...], int, torch.dtype], ...]  # (piece, shape, slot offset, dtype)
    nbytes: int                                                         # bytes of the slot it fills
    dense: PartLayout                                                   # what it dequantizes into

    def runs_for(self, layer: Optional[int]) -> tuple[tuple[int, int, int], ...]:
        """The runs a load of `layer` copies: `runs`, less the tail of each GGUF matrix that this layer's type
        leaves unused (its piece holds the bytes of the matrix's largest type over the layers), so a pass moves
        the bytes the file holds."""
        if not published.per_layer_sizes(self.quant):
            return self.runs
        shapes = {name: shape for name, shape, _ in self.dense.entries}
        ends = [entry[2] for entry in self.entries[1:]] + [self.nbytes]
        runs: list[list[int]] = []
        for (name, _, dst, _), end in zip(self.entries, ends):
            src = next(s + dst - d for s, d, n in self.runs if d <= dst < d + n)    # where it sits in the block
            field = name.split(".")[0]
            used = (published.used_nbytes(self.quant, field, shapes[field], layer) if name.endswith(".blocks")
                    else end - dst)
            if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
                runs[-1][2] += used
            else:
                runs.append([src, dst, used])
        return tuple(map(tuple, runs))

    def dequantize(self, slot: torch.Tensor, dense_buffer: torch.Tensor, layer: Optional[int] = None) -> None:
        """dense_buffer ((≥ dense.nbytes,) uint8) <- this part of the layer in `slot` (same device)."""
        _dequantize_entries(self.quant, _pieces(slot, self.entries, self.nbytes), self.dense.views(dense_buffer),
                            self.dense.entries, layer)


def _pieces(block: torch.Tensor, entries, nbytes: int) -> dict[str, torch.Tensor]:
    """Every (piece, shape, byte offset, dtype) entry as a typed view into `block` ((≥ nbytes,) uint8)."""
    assert block.dtype == torch.uint8 and block.numel() >= nbytes
    return {name: block[offset: offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for name, shape, offset, dtype in entries}


def _dequantize_entries(quant: str, pieces: dict[str, torch.Tensor], out: LayerWeights, dense_entries,
                        layer: Optional[int] = None) -> None:
    """Each dense entry (name, shape, offset) of `out` <- its pieces: a matrix dequantized, a norm or bias copied."""
    for name, shape, _ in dense_entries:
        if len(shape) != 2:
            getattr(out, name).copy_(pieces[name])
            continue
        dequantize_matrix(quant, {suffix: pieces[f"{name}.{suffix}"] for suffix, _, _ in
                                   matrix_pieces(quant, shape, getattr(out, name).dtype, name)},
                           getattr(out, name), name, layer)


def target_layout(cfg: ModelConfig, dtype: torch.dtype, quant: str = "none"):
    """The block layout of a target layer as stored and moved: dense (LayerLayout) or QuantizedLayout."""
    return LayerLayout.of(cfg, dtype) if quant == "none" else QuantizedLayout.of(cfg, dtype, quant)


@dataclass(frozen=True)
class QuantizedResident:
    """A resident target layer held on the device as its quantized block (`--resident-quant`), so it takes the
    block's bytes there, not the dense layer's: 0.28x (nf4) / 0.50x (int8) of bf16, plus ONE dense scratch
    layer that every such layer shares. Each pass dequantizes it into the scratch right before it runs
    (weights()), with the streamer's dequantization (QuantizedLayout.dequantize) on the compute queue: in
    stream order after the previous layer's kernels, which read the scratch before, so no event is needed.
    That costs compute every pass (docs/notes/2026-11-23-held-quantized-layers-and-drafts.md), which is
    why a layer is held so only where that lets more layers stay resident (plan/placement.py)."""
    layout: QuantizedLayout
    block: torch.Tensor      # (layout.nbytes,) uint8 on the device, for good
    scratch: torch.Tensor    # (layout.dense.nbytes,) uint8 on the device, shared by every quantized resident layer
    layer: Optional[int] = None   # which layer it is (a GGUF's matrix types can differ between layers)

    def weights(self) -> LayerWeights:
        """The layer as dense views into the scratch: valid until the next quantized resident layer's weights()
        (as a streamed layer is until the next layer is asked for)."""
        self.layout.dequantize(self.block, self.scratch, self.layer)
        return self.layout.dense.views(self.scratch)


def layer_weights(layer) -> LayerWeights:
    """A resident layer as the forward reads it: a LayerWeights as it is, a QuantizedResident dequantized now."""
    return layer.weights() if isinstance(layer, QuantizedResident) else layer


def dequantized(layout, block: torch.Tensor, layer: Optional[int] = None) -> tuple[torch.Tensor, LayerWeights]:
    """A block of `layout` (dense or quantized; layer: which one it is) as a dense layer on the block's device ->
    (the dense block, its LayerWeights views). A dense block is returned as it is."""
    if isinstance(layout, LayerLayout):
        return block, layout.views(block)
    dense_block = torch.empty(layout.dense.nbytes, dtype=torch.uint8, device=block.device)
    layout.dequantize(block, dense_block, layer)
    return dense_block, layout.dense.views(dense_block)
