"""Hub ids (owner/name) for --target, --draft, models info|prepare and load_engine, resolved through a Hugging Face
cache folder built here (models--owner--name/{blobs, refs/main, snapshots/<commit>}), as huggingface_hub lays it
out. No test reaches the network: HF_HUB_OFFLINE is set, or snapshot_download is replaced."""
import hashlib
import shutil
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import LocalEntryNotFoundError
import pytest
import torch
from click.testing import CliRunner

from offspec.cli import main
from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig
from offspec.errors import CheckpointError
from offspec.generate import GenerationRequest, run
from offspec.hub import HUB_FILES, HUB_SKIP, hub_cache_dir, resolve_model
from offspec.load import load_engine
from tiny import hf_config, make_model, perturbed_copy, save_checkpoint

RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(cache: Path, repo_id: str, folder: Path, only: tuple[str, ...] | None = None) -> Path:
    """Put `folder`'s files into `cache` as huggingface_hub would (blobs + symlinks); returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for file in sorted(folder.iterdir()):
        if only is not None and file.name not in only:
            continue
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub_models")
    target = make_model(hf_config("llama", n_layers=2), seed=5, scale=3.0)
    return (save_checkpoint(target, root / "target"),
            save_checkpoint(perturbed_copy(target, noise=0.02), root / "draft"))


@pytest.fixture
def cache(tmp_path, monkeypatch, folders):
    """An offline Hugging Face cache holding tiny-org/tiny-target and tiny-org/tiny-draft."""
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache_model(cache, "tiny-org/tiny-target", folders[0])
    cache_model(cache, "tiny-org/tiny-draft", folders[1])
    return cache


def snapshot_of(cache: Path, repo_id: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT


def greedy_tokens(loaded, n=12):
    request = GenerationRequest(prompt_ids=tuple(range(5, 20)), max_new_tokens=n, ignore_eos=True,
                                tree=TreeConfig(policy="dyspec", budget=8))
    return run(loaded.engine, request)[0].tokens


def test_a_hub_id_loads_from_the_cache(cache, folders):
    assert resolve_model("tiny-org/tiny-target") == snapshot_of(cache, "tiny-org/tiny-target")
    by_id = load_engine("tiny-org/tiny-target", "tiny-org/tiny-draft", OffloadConfig(), RUNTIME, progress=False)
    by_folder = load_engine(folders[0], folders[1], OffloadConfig(), RUNTIME, progress=False)
    assert by_id.target_ckpt.path == snapshot_of(cache, "tiny-org/tiny-target")
    assert by_id.draft_ckpt.path == snapshot_of(cache, "tiny-org/tiny-draft")
    assert greedy_tokens(by_id) == greedy_tokens(by_folder)


def test_hf_home_locates_the_cache_when_hf_hub_cache_is_unset(tmp_path, monkeypatch, folders):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    cache_model(tmp_path / "home" / "hub", "tiny-org/tiny-target", folders[0])
    assert resolve_model("tiny-org/tiny-target") == snapshot_of(tmp_path / "home" / "hub", "tiny-org/tiny-target")


@pytest.mark.parametrize("case", ["absent", "partial"])
def test_an_id_not_in_the_cache_offline_is_one_line(cache, folders, case):
    if case == "partial":       # e.g. only what AutoConfig / AutoTokenizer fetched: no weights
        cache_model(cache, "tiny-org/missing", folders[0], only=("config.json", "tokenizer.json"))
    with pytest.raises(CheckpointError) as caught:
        resolve_model("tiny-org/missing")
    message = str(caught.value)
    assert "\n" not in message
    for needle in ("tiny-org/missing", f"Hugging Face cache {cache}", "HF_HUB_OFFLINE",
                   "hf download tiny-org/missing", "pass a model folder"):
        assert needle in message, message


def test_a_folder_wins_over_a_hub_id_of_the_same_spelling(cache, folders, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(folders[1], tmp_path / "tiny-org" / "tiny-target")
    assert resolve_model("tiny-org/tiny-target") == Path("tiny-org/tiny-target")
    loaded = load_engine("tiny-org/tiny-target", None, OffloadConfig(), RUNTIME, progress=False)
    assert loaded.target_ckpt.path.resolve() == (tmp_path / "tiny-org" / "tiny-target").resolve()


@pytest.mark.parametrize("name", ["./tiny-org/tiny-target", "/no/such/model", "a/b/c", "a--b/c", "-a/b", "plain"])
def test_names_that_are_not_hub_ids_stay_paths(cache, name):
    assert resolve_model(name) == Path(name)


def test_online_a_missing_id_is_downloaded_with_the_model_files_only(cache, folders, monkeypatch):
    """Without HF_HUB_OFFLINE the files offspec reads are downloaded into the cache (snapshot_download is
    replaced here, so nothing leaves the machine); a failed download is one line."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        return str(cache_model(Path(kwargs["cache_dir"]), repo_id, folders[0]))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model("tiny-org/new") == snapshot_of(cache, "tiny-org/new")
    (_, lookup), (_, download) = [c for c in calls if c[0] == "tiny-org/new"]
    assert lookup["local_files_only"] and not download.get("local_files_only")
    assert download["cache_dir"] == cache
    assert download["allow_patterns"] == HUB_FILES and download["ignore_patterns"] == HUB_SKIP

    def unreachable(repo_id, **kwargs):
        raise LocalEntryNotFoundError(
            "An error happened while trying to locate the files on the Hub\nand more")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(CheckpointError, match=r"^tiny-org/gone: no such folder, and downloading it from the Hugging "
                                              r"Face hub .* failed \(An error happened .* Hub\); check the id") as caught:
        resolve_model("tiny-org/gone")
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------ through the command line
def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], prog_name="offspec")


FAST = ["--device", "cpu", "--dtype", "float32", "--offload", "none"]


def test_cli_takes_hub_ids(cache, folders, tmp_path):
    by_id = cli("generate", "--target", "tiny-org/tiny-target", "--draft", "tiny-org/tiny-draft", *FAST,
                "--raw", "--max-new-tokens", 6, "--quiet", "hello")
    by_folder = cli("generate", "--target", folders[0], "--draft", folders[1], *FAST,
                    "--raw", "--max-new-tokens", 6, "--quiet", "hello")
    assert by_id.exit_code == 0, (by_id.output, by_id.exception)
    assert by_id.stdout == by_folder.stdout
    info = cli("models", "info", "tiny-org/tiny-target", "--dtype", "float32")
    assert info.exit_code == 0 and f"folder:          {snapshot_of(cache, 'tiny-org/tiny-target')}" in info.stdout
    store = tmp_path / "store"
    prepared = cli("models", "prepare", "tiny-org/tiny-target", "--dtype", "float32", "--store-dir", store)
    assert prepared.exit_code == 0 and (store / "layers.bin").is_file()

    missing = cli("generate", "--target", "tiny-org/missing", *FAST, "hello")
    assert missing.exit_code == 1 and "Traceback" not in missing.output
    last = missing.stderr.strip().splitlines()[-1]
    assert last.startswith("offspec: error: tiny-org/missing: no such folder") and "hf download" in last
