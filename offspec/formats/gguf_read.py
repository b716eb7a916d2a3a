"""GGUF files -> a checkpoint: the config and tensor table from the header, the layers' matrices as their GGML
blocks (gguf_blocks.py), the tokenizer converted once into a cached folder.

A GGUF file (version 2 or 3, little-endian): "GGUF", version u32, tensor count u64, metadata count u64; the
metadata as (key, type, value); each tensor's (name, dims, GGML type, offset); then, at the next multiple of
`general.alignment` (32), the data. Dims are innermost first: a matrix (N out, K in) is [K, N], stored row by
row. A model split by llama.cpp's gguf-split is `<name>-00001-of-0000M.gguf` ... each file a GGUF of its own,
the first one holding the metadata; every part is read.

Tensor names are llama.cpp's (`blk.{i}.attn_q.weight`, ...), mapped to LayerWeights fields below. For the
llama architecture llama.cpp's converter permutes the rows of q and k (each head's two rotary halves
interleaved); they are put back here, row by row of blocks, so no weight changes.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from offspec.errors import CheckpointError
from offspec.formats import gguf_blocks
from offspec.formats.checkpoint import GLOBAL_NAMES, Checkpoint, parse_config
from offspec.formats.layout import layer_shapes

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# LayerWeights field -> llama.cpp's name within "blk.{i}."; Hugging Face global name -> llama.cpp's.
LAYER_TENSORS = {
    "input_norm": "attn_norm.weight", "q_proj": "attn_q.weight", "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight", "o_proj": "attn_output.weight", "q_bias": "attn_q.bias", "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_norm": "ffn_norm.weight", "gate_proj": "ffn_gate.weight", "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
}
GLOBAL_TENSORS = {GLOBAL_NAMES["embed"]: "token_embd.weight", GLOBAL_NAMES["final_norm"]: "output_norm.weight",
                  GLOBAL_NAMES["lm_head"]: "output.weight"}
ROPE_FREQS = "rope_freqs.weight"     # llama 3.1+'s rope scaling, stored as one divisor per frequency
SPLIT_NAME = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf$")
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
TOKENIZER_DIGEST = "offspec.tokenizer_digest"   # read_header's digest of the tokenizer entries, kept in the metadata
KEEP_ARRAY = 64                      # metadata arrays longer than this (the vocabulary) are skipped, not kept


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


class _Reader:
    def __init__(self, f, path: Path):
        self.f, self.path = f, path
        self.size = os.fstat(f.fileno()).st_size

    def corrupt(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt GGUF header ({what})")

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        raw = self.f.read(n)
        if len(raw) < n:
            raise CheckpointError(f"{self.path}: truncated GGUF header")
        return struct.unpack(fmt, raw)[0]

    def string(self) -> str:
        n = self.take("<Q")
        if n > 1 << 24:
            raise self.corrupt(f"a string of {n} bytes")
        raw = self.f.read(n)
        if len(raw) < n:
            raise CheckpointError(f"{self.path}: truncated GGUF header")
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind != 9:
            raise self.corrupt(f"metadata type {kind}")
        item, count = self.take("<I"), self.take("<Q")
        if count > self.size:
            raise self.corrupt(f"an array of {count} items")
        if count <= KEEP_ARRAY:
            return [self.value(item) for _ in range(count)]
        if item in _SCALARS:                       # skipped whole
            skip = count * struct.calcsize(_SCALARS[item])
            if self.f.tell() + skip > self.size:
                raise CheckpointError(f"{self.path}: truncated GGUF header")
            self.f.seek(skip, os.SEEK_CUR)
        else:
            for _ in range(count):
                self.value(item)
        return None


def read_header(path: Path) -> tuple[dict, dict[str, tuple[int, tuple[int, ...], int]], int]:
    """-> (metadata, {tensor: (GGML type id, torch shape (outermost first), absolute offset)}, bytes the file must
    have). Reads the header only, once per file version (opening a model reads it for the checkpoint and again for
    its tokenizer): the result is shared, not to be changed. metadata[TOKENIZER_DIGEST]: a digest of every
    tokenizer.* entry's bytes, which two files with one tokenizer share."""
    try:
        st = path.stat()
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror})") from None
    return _read_header(path.resolve(), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _read_header(path: Path, size: int, mtime_ns: int):
    """read_header's work, keyed by the file's size and time as well: a file written again is read again."""
    try:
        with open(path, "rb") as f:
            r = _Reader(f, path)
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{path}: not a GGUF file (its first bytes are not 'GGUF')")
            version = r.take("<I")
            if version not in (2, 3):
                swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
                raise CheckpointError(f"{path}: " + ("big-endian GGUF files are not supported" if swapped in (2, 3)
                                                     else f"GGUF version {version} is not supported (2 or 3)"))
            n_tensors, n_kv = r.take("<Q"), r.take("<Q")
            meta, digest = {}, hashlib.sha1()
            for _ in range(n_kv):
                start = f.tell()
                key = r.string()
                meta[key] = r.value(r.take("<I"))
                if key.startswith("tokenizer."):
                    end = f.tell()
                    f.seek(start)
                    digest.update(f.read(end - start))
            meta[TOKENIZER_DIGEST] = digest.hexdigest()
            infos = []
            for _ in range(n_tensors):
                name = r.string()
                n_dims = r.take("<I")
                if n_dims > 4:
                    raise r.corrupt(f"tensor {name} has {n_dims} dimensions")
                dims = tuple(r.take("<Q") for _ in range(n_dims))
                infos.append((name, r.take("<I"), dims[::-1], r.take("<Q")))
            align = meta.get("general.alignment", 32)
            if not isinstance(align, int) or align <= 0 or align & (align - 1):
                raise r.corrupt(f"general.alignment {align!r}")
            start = -(-f.tell() // align) * align
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror})") from None
    tensors, end = {}, start
    for name, kind, shape, offset in infos:
        tensors[name] = (kind, shape, start + offset)
        if kind in gguf_blocks.GGML_TYPES:
            t = gguf_blocks.GGML_TYPES[kind]
            end = max(end, start + offset + math.prod(shape) // t.block * t.size)
    return meta, tensors, end


def split_files(path: Path) -> list[Path]:
    """The files of a (maybe split) GGUF model, in order; CheckpointError naming any part that is missing."""
    m = SPLIT_NAME.fullmatch(path.name)
    if not m:
        return [path]
    count = int(m.group(3))
    if not 1 <= int(m.group(2)) <= count:
        raise CheckpointError(f"{path}: not a part of a split GGUF (part {int(m.group(2))} of {count})")
    files = [path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: the model is split into {count} files and {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing beside it")
    return files


class GGUFCheckpoint(Checkpoint):
    """One GGUF model (a file, or the parts of a split one), with Checkpoint's interface: its decoder matrices
    come as their GGML blocks (`<field>.blocks`, quant = gguf_blocks' string), or dequantized with dense=True."""

    def __init__(self, path: str | Path, headers_only: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        self._files = split_files(self.path)
        self._tensors: dict[str, tuple[str, tuple[int, ...], Path, int]] = {}   # name -> (type, shape, file, at)
        self.incomplete: list[str] = []
        meta: dict = {}
        for file in self._files:
            file_meta, tensors, needed = read_header(file)
            meta = meta or file_meta
            for name, (kind, shape, at) in tensors.items():
                self._tensors[name] = (gguf_blocks.check_type(kind, name, str(file)), shape, file, at)
            size = file.stat().st_size
            if size < needed and not headers_only:
                raise CheckpointError(f"{file}: truncated or corrupt ({size:,} bytes, its header needs {needed:,}); "
                                      f"download it again")
            if size < needed:
                self.incomplete.append(f"{file.name + ' ' if len(self._files) > 1 else ''}holds {size:,} of "
                                       f"{needed:,} bytes")
        self.meta = meta
        self.raw_config = self._config_dict()
        self.config = parse_config(self.raw_config, str(self.path))
        self._check_tensors()
        self.quant = gguf_blocks.quant_string(
            {field: [self._type(i, field) for i in range(self.config.n_layers)] for field in gguf_blocks.MATRICES})

    # -------------------------------------------------------------- config and checks

    def _config_dict(self) -> dict:
        """The metadata as the config.json it stands for (checkpoint.parse_config reads it), every value checked."""
        arch = self.meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(f"{self.path}: GGUF architecture {arch!r} is not supported (offspec runs "
                                  f"{', '.join(ARCHITECTURES)})")

        def get(key: str, kind: type = int, default=None):
            """{arch}.{key}: a positive int, or a float (kind float); missing without a default: refused."""
            value = self.meta.get(f"{arch}.{key}", default)
            if value is None:
                raise CheckpointError(f"{self.path}: GGUF metadata {arch}.{key} is missing"
                                      + (" or a per-layer array (not supported)" if f"{arch}.{key}" in self.meta
                                         else ""))
            if isinstance(value, list):
                raise CheckpointError(f"{self.path}: GGUF metadata {arch}.{key} is a per-layer array; offspec runs "
                                      f"models whose layers are all alike")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and (
                    not isinstance(value, int) or value <= 0)) or not value > 0:
                raise CheckpointError(f"{self.path}: GGUF metadata {arch}.{key} is {value!r}, not a positive "
                                      f"{'integer' if kind is int else 'number'}")
            return value

        embed = self._tensors.get("token_embd.weight")
        if embed is None or len(embed[1]) != 2:
            raise CheckpointError(f"{self.path}: tensor token_embd.weight is missing or not a matrix")
        heads = get("attention.head_count")
        head_dim = next((get(key) for key in ("attention.key_length", "rope.dimension_count")
                         if f"{arch}.{key}" in self.meta), None) or get("embedding_length") // heads
        for key in ("attention.value_length", "rope.dimension_count"):     # partial rotary, odd value heads
            if self.meta.get(f"{arch}.{key}", head_dim) != head_dim:
                raise CheckpointError(f"{self.path}: GGUF metadata {arch}.{key} is {self.meta[f'{arch}.{key}']!r}, "
                                      f"not the head size {head_dim}: not supported")
        raw = {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "vocab_size": embed[1][0],
               "hidden_size": get("embedding_length"), "intermediate_size": get("feed_forward_length"),
               "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
               "num_key_value_heads": get("attention.head_count_kv", default=heads), "head_dim": head_dim,
               "rms_norm_eps": get("attention.layer_norm_rms_epsilon", float),
               "rope_theta": get("rope.freq_base", float, 10000.0), "max_position_embeddings": get("context_length"),
               "tie_word_embeddings": "output.weight" not in self._tensors,
               "attention_bias": "blk.0.attn_q.bias" in self._tensors}
        scaling = self.meta.get(f"{arch}.rope.scaling.type")
        if scaling == "linear":
            raw["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor", float)}
        elif scaling not in (None, "none"):
            raise CheckpointError(f"{self.path}: GGUF rope scaling {scaling!r} is not supported (linear, or llama3's "
                                  f"rope_freqs)")
        if ROPE_FREQS in self._tensors and not self.incomplete:     # (a header alone plans without it)
            raw["rope_scaling"] = self._llama3_scaling(raw)
        return raw

    def _llama3_scaling(self, raw: dict) -> dict:
        """llama.cpp stores llama 3's rope scaling as its per-frequency divisors: find the parameters that give
        them (Llama 3.1 and 3.3: factor 8; 3.2: 32), or refuse."""
        kind, shape, _, _ = self._tensors[ROPE_FREQS]
        head_dim = raw["head_dim"]
        if shape != (head_dim // 2,) or kind not in ("F32", "F16", "BF16"):
            raise CheckpointError(f"{self.path}: tensor {ROPE_FREQS} is {kind} of shape {shape}; llama 3's rope "
                                  f"scaling is F32, F16 or BF16 of shape ({head_dim // 2},)")
        stored = self._read_dense(ROPE_FREQS)
        inv = 1.0 / (float(raw["rope_theta"]) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        wavelen = 2 * math.pi / inv
        for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
            low, high, old = 1.0, 4.0, 8192
            smooth = (old / wavelen - low) / (high - low)
            want = torch.where(wavelen < old / high, torch.ones_like(inv),
                               torch.where(wavelen > old / low, torch.full_like(inv, factor),
                                           1 / ((1 - smooth) / factor + smooth)))
            if want.shape == stored.shape and torch.allclose(want, stored, rtol=1e-5):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": old}
        raise CheckpointError(f"{self.path}: its {ROPE_FREQS} is not llama 3's rope scaling with factor 2 to 32; "
                              f"this rope scaling is not supported")

    def _check_tensors(self) -> None:
        """The file holds exactly the tensors this config's model has (one more would be a part of the model that
        offspec would not run), each with the shape the config implies, each matrix's rows whole blocks."""
        cfg = self.config
        expected = {self._name(i, field): shape for i in range(cfg.n_layers)
                    for field, shape in layer_shapes(cfg).items()}
        expected.update({"token_embd.weight": (cfg.vocab_size, cfg.hidden_size), "output_norm.weight": (cfg.hidden_size,)})
        if not cfg.tie_word_embeddings:
            expected["output.weight"] = (cfg.vocab_size, cfg.hidden_size)
        extra = next((name for name in self._tensors if name not in expected and name != ROPE_FREQS), None)
        if extra:
            raise CheckpointError(f"{self.path}: tensor {extra} is not one offspec runs in a {cfg.arch} model (it "
                                  f"runs dense llama, qwen2 and qwen3 decoders)")
        for name, shape in expected.items():
            self._check(name, shape)

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        kind, stored, _, _ = self._tensors[name]
        if stored != shape:
            raise CheckpointError(f"{self.path}: tensor {name} has shape {stored}, the metadata implies {shape}")
        if shape[-1] % gguf_blocks.BY_NAME[kind].block:
            raise CheckpointError(f"{self.path}: tensor {name}: rows of {shape[-1]} do not divide into {kind} "
                                  f"blocks of {gguf_blocks.BY_NAME[kind].block}")
        if len(shape) == 1 and kind not in ("F32", "F16", "BF16"):
            raise CheckpointError(f"{self.path}: tensor {name} is {kind}; offspec reads vectors in F32, F16 or BF16")

    # -------------------------------------------------------------- tensors

    def _name(self, i: int, field: str) -> str:
        return f"blk.{i}.{LAYER_TENSORS[field]}"

    def _type(self, i: int, field: str) -> str:
        return self._tensors[self._name(i, field)][0]

    def _raw(self, name: str) -> torch.Tensor:
        """A tensor's bytes, (rows, row bytes) uint8 (a vector's rows are its elements), with llama's q and k rows
        (and biases) back in the checkpoint's order."""
        kind, shape, file, at = self._tensors[name]
        t = gguf_blocks.BY_NAME[kind]
        rows = math.prod(shape[:-1]) if len(shape) > 1 else shape[0]
        raw = torch.empty(math.prod(shape) // t.block * t.size, dtype=torch.uint8)
        view, done = memoryview(raw.numpy()), 0
        try:
            with open(file, "rb", buffering=0) as f:
                f.seek(at)
                while done < len(view):            # one read returns at most ~2 GiB
                    n = f.readinto(view[done:])
                    if not n:
                        raise CheckpointError(f"{file}: truncated; tensor {name} runs past its end")
                    done += n
        except OSError as e:
            raise CheckpointError(f"{file}: unreadable ({e.strerror})") from None
        raw = raw.view(rows, -1)
        if not name.startswith("blk.") or self.config.arch != "llama":
            return raw
        heads = {"attn_q": self.config.n_heads, "attn_k": self.config.n_kv_heads}.get(name.split(".")[2])
        if heads:           # (heads, hd/2, 2) rows -> (heads, 2, hd/2)
            raw = raw.view(heads, -1, 2, raw.shape[1]).transpose(1, 2).reshape(rows, -1)
        return raw

    def _read_dense(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        kind, shape, _, _ = self._tensors[name]
        out = torch.empty(shape, dtype=dtype)
        gguf_blocks.dequantize(kind, self._raw(name).reshape(-1), out.view(-1, shape[-1]))
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of a float GGUF (F32, F16, BF16: its token embedding's); bfloat16 for a quantized one."""
        return {"F32": torch.float32, "F16": torch.float16}.get(self._tensors["token_embd.weight"][0], torch.bfloat16)

    @property
    def has_lm_head(self) -> bool:
        return "output.weight" in self._tensors

    @property
    def has_tokenizer(self) -> bool:
        """The tokenizer is in the metadata; transformers reads it from a whole file only."""
        return not self.incomplete

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A global tensor by its Hugging Face name (GLOBAL_NAMES), dequantized in `dtype` (a chunk of rows at a
        time: no float32 copy of a whole embedding)."""
        return self._read_dense(GLOBAL_TENSORS[name], dtype)

    def layer_tensors(self, i: int, dense: bool = False) -> dict[str, torch.Tensor]:
        """Layer i: vectors in float32; each matrix as '<field>.blocks', its GGML blocks padded with zeros to the
        bytes the layer block reserves (gguf_blocks.matrix_nbytes), or with dense=True dequantized in float32."""
        tensors = {}
        for field, shape in layer_shapes(self.config).items():
            name = self._name(i, field)
            if len(shape) != 2 or dense:
                tensors[field] = self._read_dense(name)
                continue
            raw = self._raw(name).reshape(-1)
            blocks = torch.zeros(gguf_blocks.matrix_nbytes(self.quant, field, shape), dtype=torch.uint8)
            blocks[: raw.numel()] = raw
            tensors[f"{field}.blocks"] = blocks
        return tensors

    def parameter_count(self) -> int:
        return sum(math.prod(shape) for name, (_, shape, _, _) in self._tensors.items() if name != ROPE_FREQS)

    def fingerprint(self) -> str:
        return ";".join(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in self._files)

    def close(self) -> None:
        """Nothing is kept open or mapped: each tensor is read with a plain read."""


def tokenizer_dir(path: str | Path, home: Path) -> Path:
    """The GGUF's tokenizer (with its chat template) as a Hugging Face tokenizer folder, converted by transformers
    from the file's metadata the first time (seconds: the vocabulary is rebuilt) and cached under home/tokenizers
    by the digest of its tokenizer entries: files with one tokenizer (a target and its draft) share the folder."""
    path = Path(path)
    files = split_files(path)
    meta = read_header(files[0])[0]
    folder = home / "tokenizers" / f"{meta.get('general.architecture')}-{meta[TOKENIZER_DIGEST][:16]}"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(files[0].parent), gguf_file=files[0].name)
    except Exception as e:      # transformers' GGUF conversion raises many kinds: one line, the file named
        raise CheckpointError(f"{path}: cannot read its tokenizer ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0]})") from None
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    except OSError:             # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
