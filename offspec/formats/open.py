"""Opening a model by its path, a Hugging Face folder or a GGUF file: its checkpoint and its tokenizer."""
from __future__ import annotations

from pathlib import Path

from offspec.errors import CheckpointError
from offspec.formats.checkpoint import TOKENIZER_FILES, Checkpoint
from offspec.formats.demo import offspec_home
from offspec.formats.gguf_read import GGUFCheckpoint, tokenizer_dir


def open_checkpoint(path: str | Path, headers_only: bool = False) -> Checkpoint:
    """A model folder (Checkpoint), or a GGUF file (gguf_read.GGUFCheckpoint: a `.gguf` path, or the first part of
    a split one)."""
    if str(path).endswith(".gguf"):
        return GGUFCheckpoint(path, headers_only)
    return Checkpoint(path, headers_only)


def tokenizer_folder(path: str | Path) -> Path:
    """Where a model's tokenizer files are: its folder, or for a GGUF file the folder its tokenizer is converted
    into once (gguf_read.tokenizer_dir)."""
    if str(path).endswith(".gguf"):
        return tokenizer_dir(path, offspec_home())
    return Path(path)


TOKENIZER_DESCRIPTION = TOKENIZER_FILES + ("merges.txt", "tokenizer_config.json", "special_tokens_map.json",
                                           "added_tokens.json")   # every file a tokenizer is read from


def same_tokenizer_files(a: str | Path, b: str | Path) -> bool:
    """Both folders describe one tokenizer byte for byte: each of TOKENIZER_DESCRIPTION is in neither, or in
    both with the same bytes (a draft converted beside its target often is; then one tokenizer serves both).
    A GGUF file stands for the folder its tokenizer is converted into."""
    a, b = tokenizer_folder(a), tokenizer_folder(b)
    for name in TOKENIZER_DESCRIPTION:
        x, y = Path(a) / name, Path(b) / name
        if x.is_file() != y.is_file():
            return False
        if x.is_file() and (x.stat().st_size != y.stat().st_size or x.read_bytes() != y.read_bytes()):
            return False
    return any((Path(a) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path):
    """The checkpoint's own tokenizer (with its chat template), via transformers. A folder with none of
    TOKENIZER_FILES is refused here: transformers would build an empty tokenizer for some architectures, and
    every prompt would then encode to nothing."""
    from transformers import AutoTokenizer

    path = tokenizer_folder(path)
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); copy the "
                              "tokenizer files (with tokenizer_config.json) from the model's download into it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
    if len(tokenizer) == 0:
        raise CheckpointError(f"{path}: the tokenizer files hold no tokens")
    return tokenizer
