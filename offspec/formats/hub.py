"""Model names -> model folders: a folder as given, or a Hugging Face hub id found in the local Hugging Face cache.

`--target`, `--draft`, `models info|prepare` and load_engine all go through resolve_model, which decides:
  1. A path that exists is used as it is: a folder ./Qwen/Qwen2.5-7B wins over the hub id of the same spelling.
  2. A name shaped like a hub id (owner/name, e.g. Qwen/Qwen2.5-7B-Instruct) is looked up in the local cache
     ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub, read when called): the snapshot that
     refs/main points to, if it holds config.json, the weights and a tokenizer. This never touches the network,
     so a cached model loads the same offline; it is always the cached revision (`hf download ID` updates it).
  3. Not cached, or only in part (transformers may have fetched just config.json or the tokenizer):
       HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set -> one-line CheckpointError naming the cache searched and how
                                                       to get the model;
       otherwise -> the files offspec reads (HUB_FILES: config, *.safetensors, tokenizer, chat template) are
                    downloaded into that cache by huggingface_hub, as transformers' from_pretrained would.
  4. Anything else (no such path, not an id) goes on unchanged; Checkpoint then says "no such model folder".
`models info` plans without the weights: resolve_headers follows rules 1, 2 and 4, and in place of 3 fetches only
config and tokenizer and reads the weight files' safetensors headers from the hub (a 70B plans from a few MB).
The headers are kept under offspec's home (hub-headers/), by repo and commit, so the same plan works offline after.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

from offspec.errors import CheckpointError

# owner/name as the hub spells it: letters, digits, '-', '_', '.'; no '--' or '..'; no leading '.' or '-'.
HUB_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9_][\w.-]{0,95}/[A-Za-z0-9_][\w.-]{0,95}")

# What a download fetches: config and generation config, weights (+ index), tokenizer files, chat template.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
# Never: subfolders (e.g. original/ with a second, consolidated copy of the weights) or Mistral's
# consolidated.safetensors next to the sharded files, which would double the download.
HUB_SKIP = ["*/*", "consolidated*"]
# What a plan fetches of a hub model not in the cache (resolve_headers): config and tokenizer, never a weight file;
# the weights' safetensors headers are read from the hub instead.
PLAN_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "vocab.json",
              "merges.txt", "*.tiktoken", "*.jinja"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")

_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder, from the environment as it is now (huggingface_hub reads it at import)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or transformers' TRANSFORMERS_OFFLINE) is set: no downloads."""
    return any((os.environ.get(var) or "").upper() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_model(name: str | Path) -> Path:
    """A model folder or a hub id -> the folder to load (see the module docstring for the rules)."""
    folder = _as_given_or_cached(name)
    if folder is not None:
        return folder
    repo_id, cache = str(name), hub_cache_dir()
    if hub_offline():
        raise CheckpointError(
            f"{repo_id}: no such folder, and no complete copy of this hub model in the Hugging Face cache {cache} "
            f"(HF_HUB_OFFLINE is set, so offspec does not download); get it with `hf download {repo_id}` where the "
            f"hub is reachable (into this cache: set HF_HUB_CACHE), or pass a model folder")
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP))
    except (OSError, ValueError) as e:   # hub errors are OSErrors (HTTP, not found, offline); bad ids ValueErrors
        raise CheckpointError(f"{repo_id}: no such folder, and downloading it from the Hugging Face hub into {cache} "
                              f"failed ({_first_line(e)}); check the id and the network, or pass a model "
                              "folder") from None
    return folder


def _as_given_or_cached(name: str | Path) -> Optional[Path]:
    """Rules 1, 2 and 4 of the module docstring: the path as given (one that exists, or a name that is no hub
    id), or a hub id's complete snapshot in the local cache; None for a hub id not cached whole. No network."""
    path = Path(name).expanduser()
    if path.exists() or not HUB_ID.fullmatch(str(name)):
        return path
    return cached_snapshot(str(name), hub_cache_dir())


def _first_line(err: Exception) -> str:
    """A hub error's first line (its messages run on over several), or its type where it has none."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def resolve_headers(name: str | Path) -> tuple[Path, Optional[dict[str, dict[str, dict]]]]:
    """A model folder or a hub id -> (folder, headers) to plan from, without downloading any weight file.

    headers None: read them from the folder's *.safetensors (a folder as given, or a complete cached snapshot:
    rules 1, 2 and 4 of the module docstring). Otherwise (a hub id not cached whole) the folder is the cached
    snapshot of the hub's small files only (PLAN_FILES: config, tokenizer) and headers are the weight files'
    safetensors headers as the hub serves them, {file: {tensor: {"dtype", "shape", "data_offsets"}}}: a few
    KB a file, read by range requests. HF_HUB_OFFLINE set: one-line CheckpointError."""
    folder = _as_given_or_cached(name)
    if folder is not None:
        return folder, None
    repo_id, cache = str(name), hub_cache_dir()
    planned = planned_snapshot(repo_id, cache)
    if planned is not None:
        return planned
    if hub_offline():
        raise CheckpointError(
            f"{repo_id}: no such folder, and not in the Hugging Face cache {cache}; HF_HUB_OFFLINE is set, so its "
            "config and safetensors headers cannot be read from the hub: unset HF_HUB_OFFLINE, or pass a model folder")
    from huggingface_hub import get_safetensors_metadata, snapshot_download
    from huggingface_hub.errors import NotASafetensorsRepoError, SafetensorsParsingError

    try:
        folder = Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=PLAN_FILES, ignore_patterns=HUB_SKIP))
        # the headers of the revision whose config was fetched (the snapshot folder is named for its commit)
        metadata = get_safetensors_metadata(repo_id, revision=folder.name)
    except (OSError, ValueError, NotASafetensorsRepoError, SafetensorsParsingError) as e:   # HTTP, offline; bad ids
        raise CheckpointError(f"{repo_id}: no such folder, and reading its config and safetensors headers from the "
                              f"Hugging Face hub failed ({_first_line(e)}); check the id and the network, or pass a "
                              "model folder") from None
    headers = _headers_of({file: {tensor: {"dtype": info.dtype, "shape": info.shape, "data_offsets": info.data_offsets}
                                  for tensor, info in meta.tensors.items()}
                           for file, meta in metadata.files_metadata.items()})
    path = headers_file(repo_id, folder.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(headers))
        os.replace(tmp, path)
    except OSError:                      # a read-only home: the plan still works, the next one asks the hub again
        pass
    return folder, headers


def headers_file(repo_id: str, revision: str) -> Path:
    """Where a hub model's safetensors headers are kept once read: offspec's home, by repo and commit."""
    from offspec.formats.demo import offspec_home
    return offspec_home() / "hub-headers" / repo_id.replace("/", "--") / f"{revision}.json"


def planned_snapshot(repo_id: str, cache: Path) -> Optional[tuple[Path, dict]]:
    """(folder, headers) of a hub model planned before: its config in the cache at refs/main and its headers
    kept for that commit (headers_file). No network; None when either is missing or unreadable."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True, allow_patterns=PLAN_FILES,
                                        ignore_patterns=HUB_SKIP))
        headers = _headers_of(json.loads(headers_file(repo_id, folder.name).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):   # not cached, none kept, or damaged: ask
        return None
    return (folder, headers) if (folder / "config.json").is_file() else None


def _headers_of(files: dict) -> dict[str, dict[str, dict]]:
    """{file: {tensor: {"dtype", "shape", "data_offsets"}}} with shapes and offsets as tuples, as Checkpoint reads
    them (from the hub's answer, or from the JSON kept of it)."""
    return {file: {tensor: {"dtype": t["dtype"], "shape": tuple(t["shape"]), "data_offsets": tuple(t["data_offsets"])}
                   for tensor, t in tensors.items()}
            for file, tensors in files.items()}


def cached_snapshot(repo_id: str, cache: Path) -> Optional[Path]:
    """The cached snapshot of `repo_id` at refs/main when it holds a loadable model, else None. No network."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True,
                                        allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP))
    except (OSError, ValueError):        # not cached (LocalEntryNotFoundError), incomplete, or a bad id
        return None
    return folder if has_model_files(folder) else None


def model_name(folder: Path) -> str:
    """A model folder's name for reports: owner/name for a cache snapshot (.../models--owner--name/snapshots/<commit>),
    else the folder's own name."""
    folder = Path(folder)
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/", 1)
    return folder.name


def has_model_files(folder: Path) -> bool:
    """config.json, every weight shard (all the index lists, else at least one *.safetensors) and a tokenizer.
    Cached files are symlinks into blobs/: a link whose blob is missing does not count."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return True                  # Checkpoint reports the malformed index with its path
        if not all((folder / shard).is_file() for shard in shards):
            return False
    elif not any(f.is_file() for f in folder.glob("*.safetensors")):
        return False
    return any((folder / f).is_file() for f in TOKENIZER_FILES)
