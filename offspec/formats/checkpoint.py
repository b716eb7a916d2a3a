"""Hugging Face checkpoint folders -> ModelConfig and tensors by layer.

Tensors are read lazily through safetensors' memory map, one layer at a time, so the whole model never
has to sit in RAM. Every name, shape and dtype is checked when the folder is opened from the safetensors
headers alone (read here, a few KB per file, no data and no memory map), so a mismatched checkpoint fails
with one clear line before any work is done, and a folder of configs and headers is enough to plan a
run (`offspec models info` for machines and models you do not have). A truncated file is refused at
open unless the caller asks for headers only.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Optional

import torch

from offspec.config import ModelConfig, RopeScaling
from offspec.errors import CheckpointError
from offspec.formats import published
from offspec.formats.layout import GlobalWeights, LayerWeights, layer_shapes

# Architectures the functional forward implements (SmolLM/SmolLM2 are LlamaForCausalLM).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# The one HF -> internal name table. Layer names are relative to "model.layers.{i}.".
GLOBAL_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "post_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32"}
MAX_HEADER_BYTES = 100 << 20     # safetensors' own limit on the JSON header


def read_safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """-> ({tensor name: {"dtype", "shape", "data_offsets"}}, bytes the file must have to hold its data).

    The format: an 8-byte little-endian header length N, N bytes of JSON, then the data; data_offsets are
    relative to the end of the header. Reads only the header."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror})") from None
    try:
        header = json.loads(raw)
        if len(raw) < n or not isinstance(header, dict):
            raise ValueError("truncated header")
        header.pop("__metadata__", None)
        data_end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
        for t in header.values():
            t["shape"] = tuple(int(d) for d in t["shape"])
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable or corrupt safetensors header ({e})") from None
    return header, 8 + n + data_end


def parse_config(raw: dict, where: str) -> ModelConfig:
    """config.json (as a dict) -> ModelConfig; unsupported features are refused by name."""
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        model_type = raw.get("model_type")
        if model_type in ("llama", "mistral", "qwen2", "qwen3") and not archs:
            arch = model_type
        else:
            name = ", ".join(archs) or f"model_type={model_type!r}"
            raise CheckpointError(
                f"{where}: unsupported architecture {name}; offspec runs "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    try:
        hidden = int(raw["hidden_size"])
        n_heads = int(raw["num_attention_heads"])
        cfg_fields = dict(
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            n_layers=int(raw["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=int(raw.get("head_dim") or hidden // n_heads),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: config.json lacks or garbles a required field ({e})") from None
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    # transformers 5 keeps rope settings in "rope_parameters"; older configs use rope_theta + rope_scaling.
    rope = dict(raw.get("rope_scaling") or {})
    rope.update(raw.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    context = int(raw.get("max_position_embeddings", 4096))
    # A sliding window attends only to its last W tokens, which equals full attention while the context stays
    # within W: cap the context there (a longer prompt is refused as too long) rather than compute another model.
    # Mistral's window is on whenever it is set; Qwen's only with use_sliding_window.
    window = raw.get("sliding_window") if arch == "mistral" or raw.get("use_sliding_window") else None
    if window:
        context = min(context, int(window))
    return ModelConfig(
        **cfg_fields,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=_parse_rope_scaling(rope, where),
        max_position_embeddings=context,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
    )


def _parse_rope_scaling(rope: dict, where: str) -> Optional[RopeScaling]:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3", factor=float(rope["factor"]),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)))
    raise CheckpointError(f"{where}: rope scaling type {kind!r} is not supported (only llama3 and linear)")


class Checkpoint:
    """An HF folder: config.json, model.safetensors or sharded *.safetensors + index, tokenizer files."""

    def __init__(self, path: str | Path, headers_only: bool = False,
                 headers: Optional[dict[str, dict[str, dict]]] = None):
        """headers_only: accept weight files that hold their headers but not (all of) their data, for
        planning; such a checkpoint can describe itself but not load.
        headers: the weight files' headers read elsewhere (a hub model's, hub.resolve_headers), as
        {file name: {tensor name: {"dtype", "shape", "data_offsets"}}}; then `path` needs config.json (and
        the tokenizer, if any) but no weight file, and the checkpoint is headers_only."""
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: no such model folder")
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{self.path}: no config.json (is this a Hugging Face model folder?)")
        try:
            self.raw_config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
        self.config = parse_config(self.raw_config, str(self.path))
        self.quant = published.quant_of_config(self.raw_config, str(self.path))   # "none", or as published

        self._handles = {}
        self._where: dict[str, str] = {}       # tensor name -> file name
        self._header: dict[str, dict] = {}     # tensor name -> its safetensors header entry
        self.incomplete: list[str] = []        # headers_only: files whose data is not (all) there
        if headers is not None:
            self._use_headers(headers)
            self._check_tensors()
            return
        self._files = self._weight_files()
        for file in sorted(set(self._files.values())):
            header, needed = read_safetensors_header(self.path / file)
            size = (self.path / file).stat().st_size
            if size < needed and not headers_only:
                raise CheckpointError(f"{self.path / file}: truncated or corrupt ({size} bytes, its header needs "
                                      f"{needed}); download or convert the model again")
            if size < needed:
                self.incomplete.append(f"{file} holds {size:,} of {needed:,} bytes")
            self._header.update(header)
            self._where.update({name: file for name in header})
        self._check_tensors()

    def _use_headers(self, headers: dict[str, dict[str, dict]]) -> None:
        """Take the weight files' headers as given (see __init__); none of the files' data is here."""
        data_bytes = 0
        try:
            for file, header in sorted(headers.items()):
                for name, entry in header.items():
                    self._header[name] = dict(entry, shape=tuple(int(d) for d in entry["shape"]))
                    self._where[name] = file
                data_bytes += max((int(t["data_offsets"][1]) for t in header.values()), default=0)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{self.path}: unreadable safetensors headers ({e})") from None
        self._files = {name: file for name, file in self._where.items()}
        self.incomplete.append(f"{len(headers)} weight file(s), {data_bytes / 1e9:.2f} GB, not downloaded "
                               "(their headers read from the hub)")

    def _handle(self, file: str):
        """The safetensors handle (a memory map) of one file, opened on demand."""
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
        return self._handles[file]

    def close(self) -> None:
        """Unmap the files. Pages a memory map has touched stay mapped while it lives, and mapped pages
        cannot be dropped from the page cache (posix_fadvise DONTNEED skips them): after loading, the
        checkpoint must not keep the whole model resident. Reading a tensor again reopens the file."""
        self._handles = {}

    def _weight_files(self) -> dict[str, str]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e})") from None
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise CheckpointError(f"{self.path}: shard(s) listed in the index are missing: {', '.join(missing)}")
            return dict(weight_map)
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors weights (pytorch .bin checkpoints are not supported)")
        return {f: f for f in files}

    def _expected_tensors(self) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """Every tensor the folder must hold: name -> (shape, the safetensors dtypes it may have). A published
        quantization's matrices are their pieces (published.py), named '<matrix>.qweight' etc."""
        cfg = self.config
        expected = {GLOBAL_NAMES["embed"]: (cfg.vocab_size, cfg.hidden_size),
                    GLOBAL_NAMES["final_norm"]: (cfg.hidden_size,)}
        if not cfg.tie_word_embeddings or self.has_lm_head:
            expected[GLOBAL_NAMES["lm_head"]] = (cfg.vocab_size, cfg.hidden_size)
        floats = tuple(_FLOAT_DTYPES)
        tensors = {name: (shape, floats) for name, shape in expected.items()}
        for i in range(cfg.n_layers):
            for field, shape in layer_shapes(cfg).items():
                name = f"model.layers.{i}.{LAYER_NAMES[field]}"
                if self.quant == "none" or len(shape) != 2:
                    tensors[name] = (shape, floats)
                    continue
                base = name.removesuffix(".weight")
                problem = published.check_matrix(self.quant, shape, base)
                if problem:
                    raise CheckpointError(f"{self.path}: {problem}")
                for suffix, piece_shape, dtype in published.matrix_pieces(self.quant, shape):
                    tensors[f"{base}.{suffix}"] = (piece_shape, (_SAFETENSORS_DTYPES[dtype],))
        return tensors

    def _check_tensors(self) -> None:
        """Every expected tensor is there with its shape and dtype (a compressed-tensors quantization is first
        completed by its scales' dtype, which its headers give and its config does not)."""
        if self.quant.startswith("ct-"):
            scale = f"model.layers.0.{LAYER_NAMES['q_proj'].removesuffix('.weight')}.weight_scale"
            if scale not in self._header:
                raise CheckpointError(f"{self.path}: tensor {scale} is missing (the checkpoint is compressed-tensors)")
            try:
                self.quant = published.with_scale_dtype(self.quant, self._header[scale]["dtype"])
            except CheckpointError as e:
                raise CheckpointError(f"{self.path}: {e}") from None
        for name, (shape, dtypes) in self._expected_tensors().items():
            if name not in self._where:
                raise CheckpointError(f"{self.path}: tensor {name} is missing"
                                      + (f" (the checkpoint is {published.describe(self.quant)})"
                                         if self.quant != "none" else ""))
            entry = self._header[name]
            if entry["shape"] != shape:
                raise CheckpointError(f"{self.path}: tensor {name} has shape {entry['shape']}, config implies {shape}")
            if entry["dtype"] not in dtypes:
                want = "a float type" if len(dtypes) > 1 else dtypes[0]
                raise CheckpointError(f"{self.path}: tensor {name} has dtype {entry['dtype']}, expected {want}")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights are stored in (a published quantization's: its embedding's)."""
        name = f"model.layers.0.{LAYER_NAMES['q_proj']}" if self.quant == "none" else GLOBAL_NAMES["embed"]
        return _FLOAT_DTYPES[self._header[name]["dtype"]]

    @property
    def has_tokenizer(self) -> bool:
        """The folder holds tokenizer files (one of TOKENIZER_FILES)."""
        return any((self.path / name).is_file() for name in TOKENIZER_FILES)

    @property
    def has_lm_head(self) -> bool:
        """lm_head is stored (untied, or tied but saved anyway): GlobalWeights holds it as its own tensor."""
        return GLOBAL_NAMES["lm_head"] in self._where

    def tensor(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A tensor as stored (dtype: the one it is wanted in; a GGUF dequantizes into it, here it is a hint)."""
        try:
            return self._handle(self._where[name]).get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for truncated data
            raise CheckpointError(f"{self.path}: cannot read tensor {name} ({type(e).__name__}: {e})") from None

    def layer_tensors(self, i: int, dense: bool = False) -> dict[str, torch.Tensor]:
        """Layer i's tensors keyed by LayerWeights field names, in the stored dtype, on the CPU. A published
        quantization's matrices come as their pieces, keyed '<field>.<piece>' (quant.QuantizedLayout.pack
        takes them as they are), or with dense=True dequantized (in published.weight_dtype, the format's own
        arithmetic).

        Loading reads layer after layer and copies each one out; the maps are reopened per layer so that
        the pages of layers already copied are unmapped (tensors still held keep their own map alive),
        and loading never holds the whole file mapped on top of the copies."""
        self.close()
        tensors = {}
        for field, shape in layer_shapes(self.config).items():
            name = f"model.layers.{i}.{LAYER_NAMES[field]}"
            if self.quant == "none" or len(shape) != 2:
                tensors[field] = self.tensor(name)
                continue
            pieces = {suffix: self.tensor(f"{name.removesuffix('.weight')}.{suffix}")
                      for suffix, _, _ in published.matrix_pieces(self.quant, shape)}
            if dense:
                tensors[field] = torch.empty(shape, dtype=published.weight_dtype(self.quant))
                published.dequantize(self.quant, pieces, tensors[field])
            else:
                tensors.update({f"{field}.{suffix}": piece for suffix, piece in pieces.items()})
        return tensors

    # Weights kept for good are copied out of the memory map (copy=True): a tensor that aliases the map
    # keeps the whole file mapped, and with it every page ever read through it (see close()).
    def layer_weights(self, i: int, device: torch.device, dtype: torch.dtype) -> LayerWeights:
        """Layer i dense on `device` in `dtype` (a published quantization's dequantized)."""
        return LayerWeights(**{k: v.to(device=device, dtype=dtype, copy=True)
                               for k, v in self.layer_tensors(i, dense=True).items()})

    def global_weights(self, device: torch.device, dtype: torch.dtype, embed_device: Optional[torch.device] = None,
                       lm_head_device: Optional[torch.device] = None) -> GlobalWeights:
        """embed_device, lm_head_device: where the embedding / the lm_head live when not on `device`
        (plan.LayerPlan.embed_on_host, lm_head_on_host); a tied lm_head is the embedding's tensor, so an
        embedding elsewhere must be an untied one."""
        embed = self.tensor(GLOBAL_NAMES["embed"], dtype).to(device=embed_device or device, dtype=dtype, copy=True)
        if self.has_lm_head:
            lm_head = self.tensor(GLOBAL_NAMES["lm_head"], dtype).to(device=lm_head_device or device, dtype=dtype,
                                                                      copy=True)
        elif embed_device is not None and torch.device(embed_device) != torch.device(device):
            raise CheckpointError(f"{self.path}: its embedding is tied to the lm_head, so it stays with it on the "
                                  f"compute device")
        else:
            lm_head = embed
        final_norm = self.tensor(GLOBAL_NAMES["final_norm"], dtype).to(device=device, dtype=dtype, copy=True)
        return GlobalWeights(embed=embed, final_norm=final_norm, lm_head=lm_head)

    def parameter_count(self) -> int:
        cfg = self.config
        globals_ = cfg.vocab_size * cfg.hidden_size * (1 if GLOBAL_NAMES["lm_head"] not in self._where else 2)
        return globals_ + cfg.hidden_size + cfg.n_layers * sum(math.prod(s) for s in layer_shapes(cfg).values())

    def fingerprint(self) -> str:
        """Identifies the weights for caches derived from them (the disk store): files, sizes, mtimes."""
        parts = []
        for file in sorted(set(self._files.values())):
            st = (self.path / file).stat()
            parts.append(f"{file}:{st.st_size}:{int(st.st_mtime)}")
        return ";".join(parts)


# The files a tokenizer is built from (any one will do): a fast tokenizer's tokenizer.json, a sentencepiece
# tokenizer.model, a BPE vocab.json (with merges.txt). tokenizer_config.json alone describes one, it holds none.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
