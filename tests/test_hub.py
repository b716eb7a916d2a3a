"""Hub ids (owner/name) for --target, --draft, models info|prepare and load_engine, resolved through a Hugging Face
cache folder built here (models--owner--name/{blobs, refs/main, snapshots/<commit>}), as huggingface_hub lays it
out. No test reaches the network: HF_HUB_OFFLINE is set, or snapshot_download is replaced."""
import hashlib
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from click.testing import CliRunner
from huggingface_hub.errors import LocalEntryNotFoundError
from tiny import hf_config, make_model, perturbed_copy, save_checkpoint

from offspec.cli.main import main
from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig
from offspec.engine.generate import GenerationRequest, run
from offspec.engine.load import load_engine
from offspec.errors import CheckpointError
from offspec.formats.hub import HUB_FILES, HUB_SKIP, hub_cache_dir, resolve_model

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
    monkeypatch.setenv("OFFSPEC_HOME", str(tmp_path / "offspec-home"))     # kept hub headers go there
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


# ------------------------------------------------------------------ plans from the hub's headers (models info)
def fake_hub(monkeypatch, models: dict[str, str], shards: int = 30):
    """huggingface_hub as the hub answers for `models` ({repo id: tests/shapes.py name}): snapshot_download serves
    config.json (into the cache, as the real one would), get_safetensors_metadata the weight files' headers in
    huggingface_hub's own classes, split over `shards` files like the real checkpoints. Any call that would fetch
    a weight file fails the test. Returns the list of calls made."""
    import fnmatch
    import json

    import httpx2  # huggingface_hub's HTTP client: its errors carry a response
    from huggingface_hub.errors import RepositoryNotFoundError
    from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo
    from shapes import MODELS, tensor_shapes

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    calls, cached_only = [], huggingface_hub.snapshot_download

    def snapshot_download(repo_id, **kwargs):
        calls.append(("snapshot_download", repo_id, kwargs))
        if kwargs.get("local_files_only"):
            return cached_only(repo_id, **kwargs)           # the cache as it is (no network with local_files_only)
        if repo_id not in models:
            url = f"https://huggingface.co/api/models/{repo_id}"
            raise RepositoryNotFoundError(f"404 Client Error. Repository Not Found for {repo_id}.\nmore",
                                          response=httpx2.Response(404, request=httpx2.Request("GET", url)))
        weight = "model-00001-of-00030.safetensors"
        assert not any(fnmatch.fnmatch(weight, p) for p in kwargs["allow_patterns"]), kwargs["allow_patterns"]
        source = Path(kwargs["cache_dir"]).parent / "served" / repo_id
        source.mkdir(parents=True, exist_ok=True)
        (source / "config.json").write_text(json.dumps(MODELS[models[repo_id]]))
        return str(cache_model(Path(kwargs["cache_dir"]), repo_id, source))

    def get_safetensors_metadata(repo_id, revision=None, **kwargs):
        calls.append(("get_safetensors_metadata", repo_id, dict(kwargs, revision=revision)))
        shapes = list(tensor_shapes(MODELS[models[repo_id]]).items())
        files, per_file = {}, -(-len(shapes) // shards)
        for s in range(shards):
            tensors, offset = {}, 0
            for name, shape in shapes[s * per_file:(s + 1) * per_file]:
                nbytes = 2 * int(torch.tensor(shape).prod())
                tensors[name] = TensorInfo(dtype="BF16", shape=list(shape), data_offsets=(offset, offset + nbytes))
                offset += nbytes
            files[f"model-{s + 1:05d}-of-{shards:05d}.safetensors"] = SafetensorsFileMetadata(metadata={}, tensors=tensors)
        return SafetensorsRepoMetadata(metadata=None, sharded=True, files_metadata=files,
                                       weight_map={t: f for f, m in files.items() for t in m.tensors})

    def hf_hub_download(repo_id, filename, **kwargs):
        raise AssertionError(f"downloaded {filename} of {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", get_safetensors_metadata)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    return calls


def test_models_info_plans_a_hub_id_from_its_headers_without_the_weights(cache, monkeypatch):
    calls = fake_hub(monkeypatch, {"meta-llama/Llama-3.1-70B-Instruct": "Llama-3.1-70B-Instruct",
                                   "meta-llama/Llama-3.2-1B-Instruct": "Llama-3.2-1B-Instruct"})
    result = cli("models", "info", "meta-llama/Llama-3.1-70B-Instruct", "--draft", "meta-llama/Llama-3.2-1B-Instruct",
                 "--device-memory", "24GB", "--host-memory", "64GB", "--target-quant", "nf4")
    assert result.exit_code == 0, (result.output, result.exception)
    snapshot = snapshot_of(cache, "meta-llama/Llama-3.1-70B-Instruct")
    for needle in (f"folder:          {snapshot}", "parameters:      70.554 B", "stored dtype:    bfloat16",
                   "layers:          80 (hidden 8192, heads 64/8 kv, mlp 28672, vocab 128256",
                   "meta-llama/Llama-3.1-70B-Instruct: 30 weight file(s), 141.11 GB, not downloaded", "PREDICTED pass:"):
        assert needle in result.stdout, needle
    assert "WARNING" not in result.stdout                     # one vocabulary: the draft may speculate
    assert not list(cache.glob("models--meta-llama--*/**/*.safetensors"))    # no weight file came down
    headers = [c for c in calls if c[0] == "get_safetensors_metadata"]
    assert [c[1] for c in headers] == ["meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"]
    assert headers[0][2]["revision"] == COMMIT                # the headers of the config's revision

    # The headers were kept: the same plan works offline, and asks the hub nothing.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls.clear()
    again = cli("models", "info", "meta-llama/Llama-3.1-70B-Instruct", "--draft", "meta-llama/Llama-3.2-1B-Instruct",
                "--device-memory", "24GB", "--host-memory", "64GB", "--target-quant", "nf4")
    assert again.exit_code == 0, again.output
    assert again.stdout == result.stdout
    assert not [c for c in calls if c[0] == "get_safetensors_metadata"]


def test_doctor_plans_a_hub_id_from_its_headers_without_the_weights(cache, monkeypatch, tmp_path):
    fake_hub(monkeypatch, {"meta-llama/Llama-3.2-1B-Instruct": "Llama-3.2-1B-Instruct"})
    result = cli("doctor", "--target", "meta-llama/Llama-3.2-1B-Instruct", "--device", "cpu", "--quick",
                 "--store-dir", str(tmp_path / "stores"))
    assert result.exit_code == 0, (result.output, result.exception)
    assert "memory plan: cpu" in result.stdout
    assert "recommended: offspec generate --target meta-llama/Llama-3.2-1B-Instruct" in result.stdout
    assert not list(cache.glob("models--meta-llama--*/**/*.safetensors"))    # no weight file came down


def test_models_info_on_a_hub_id_offline_or_unreachable_is_one_line(cache, monkeypatch):
    result = cli("models", "info", "meta-llama/Llama-3.1-70B-Instruct")       # HF_HUB_OFFLINE=1 (the fixture)
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("offspec: error: meta-llama/Llama-3.1-70B-Instruct: no such folder, and not in the "
                           "Hugging Face cache") and "HF_HUB_OFFLINE is set" in line

    # online: a cached model plans from the cache; an unknown id, or a repo without safetensors, is one line
    fake_hub(monkeypatch, {"owner/bin-weights": "Llama-3.2-1B-Instruct"})
    from huggingface_hub.errors import NotASafetensorsRepoError

    def not_safetensors(repo_id, **kwargs):
        raise NotASafetensorsRepoError(f"'{repo_id}' is not a safetensors repo.\nmore")
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", not_safetensors)
    result = cli("models", "info", "tiny-org/tiny-target", "--dtype", "float32")
    assert result.exit_code == 0 and "weights incomplete" not in result.stdout
    for repo_id, reason in (("owner/unknown", "404 Client Error. Repository Not Found for owner/unknown."),
                            ("owner/bin-weights", "'owner/bin-weights' is not a safetensors repo.")):
        result = cli("models", "info", repo_id)
        assert result.exit_code == 1 and "Traceback" not in result.output
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"offspec: error: {repo_id}: no such folder, and reading its config and safetensors "
                               f"headers from the Hugging Face hub failed ({reason}); check the id"), line
