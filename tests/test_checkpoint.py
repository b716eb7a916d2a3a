"""Checkpoint folders: config parsing, sharded files, and clear errors for bad input."""
import json
import shutil

import pytest
import torch
from tiny import hf_config, make_model, save_checkpoint

from offspec.errors import CheckpointError
from offspec.formats.checkpoint import Checkpoint, parse_config


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    return save_checkpoint(make_model(hf_config("llama")), path)


def copy(good, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(good, dst)
    return dst


def test_config_fields(good):
    ckpt = Checkpoint(good)
    cfg = ckpt.config
    assert (cfg.arch, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == ("llama", 4, 4, 2, 16)
    assert set(ckpt.layer_tensors(0)) >= {"q_proj", "down_proj", "input_norm"}
    assert ckpt.dtype == torch.float32


def test_sharded_checkpoint(tmp_path):
    model = make_model(hf_config("qwen2"))
    model.save_pretrained(tmp_path / "s", max_shard_size="100KB")
    assert (tmp_path / "s" / "model.safetensors.index.json").exists()
    ckpt = Checkpoint(tmp_path / "s")
    assert ckpt.config.attention_bias
    torch.testing.assert_close(ckpt.layer_tensors(3)["k_bias"], model.model.layers[3].self_attn.k_proj.bias.detach())


@pytest.mark.parametrize("arch,sliding,context", [
    ("mistral", dict(sliding_window=256), 256),                           # Mistral's window is on when set
    ("mistral", dict(sliding_window=None), 512),
    ("qwen2", dict(sliding_window=256, use_sliding_window=False), 512),   # Qwen's only with use_sliding_window
    ("qwen2", dict(sliding_window=256, use_sliding_window=True), 256),
])
def test_a_sliding_window_caps_the_context(arch, sliding, context):
    """Within its window a sliding-window model attends like a full one; past it offspec's forward would be another
    model, so the context stops at the window (a longer prompt is refused as too long)."""
    raw = hf_config(arch).to_dict() | sliding
    assert parse_config(raw, "m").max_position_embeddings == context


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="no such model folder"):
        Checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint(tmp_path / "empty")


def test_unsupported_architecture(good, tmp_path):
    path = copy(good, tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    raw["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="unsupported architecture GPT2LMHeadModel"):
        Checkpoint(path)


def test_truncated_safetensors(good, tmp_path):
    path = copy(good, tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt|cannot read"):
        ckpt = Checkpoint(path)
        for i in range(ckpt.config.n_layers):
            ckpt.layer_tensors(i)


def test_headers_only_folder_describes_itself_but_does_not_load(good, tmp_path):
    """A folder of config + safetensors headers (no data) is enough to plan: headers_only opens it."""
    from offspec.formats.checkpoint import read_safetensors_header
    path = copy(good, tmp_path)
    f = path / "model.safetensors"
    header, needed = read_safetensors_header(f)
    assert needed == f.stat().st_size
    data = f.read_bytes()
    f.write_bytes(data[: 8 + int.from_bytes(data[:8], "little")])    # the header alone
    ckpt = Checkpoint(path, headers_only=True)
    assert ckpt.config.n_layers > 0 and ckpt.parameter_count() > 0
    with pytest.raises(CheckpointError, match="truncated"):
        Checkpoint(path)


def test_headers_given_describe_the_checkpoint_without_weight_files(good, tmp_path):
    """headers= (a hub model's, read from the hub): config.json alone on disk, the same description as the folder."""
    from offspec.formats.checkpoint import read_safetensors_header
    header, _ = read_safetensors_header(good / "model.safetensors")
    path = tmp_path / "config_only"
    path.mkdir()
    shutil.copy(good / "config.json", path)
    names = sorted(header)
    split = {"model-00001-of-00002.safetensors": {n: header[n] for n in names[::2]},
             "model-00002-of-00002.safetensors": {n: dict(header[n], shape=list(header[n]["shape"])) for n in names[1::2]}}
    given, local = Checkpoint(path, headers=split), Checkpoint(good)
    assert (given.config, given.parameter_count(), given.dtype, given.has_lm_head) == \
           (local.config, local.parameter_count(), local.dtype, local.has_lm_head)
    assert given.incomplete and "2 weight file(s)" in given.incomplete[0]
    with pytest.raises(CheckpointError, match="cannot read tensor"):
        given.layer_tensors(0)
    missing = {f: {n: e for n, e in h.items() if n != "model.norm.weight"} for f, h in split.items()}
    with pytest.raises(CheckpointError, match="tensor model.norm.weight is missing"):
        Checkpoint(path, headers=missing)
    with pytest.raises(CheckpointError, match="unreadable safetensors headers"):
        Checkpoint(path, headers={"model.safetensors": {"model.norm.weight": {"dtype": "F32"}}})


def test_garbage_header(good, tmp_path):
    path = copy(good, tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage-header}" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="corrupt"):
        Checkpoint(path)


def test_shape_mismatch(good, tmp_path):
    path = copy(good, tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["intermediate_size"] = 100
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="has shape"):
        Checkpoint(path)


def test_bad_json_config(good, tmp_path):
    path = copy(good, tmp_path)
    (path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Checkpoint(path)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_folder_without_tokenizer_files_says_so(arch, tmp_path):
    """Without tokenizer files transformers builds an empty Qwen2 tokenizer (every prompt then encodes to
    nothing) and fails on a Llama folder with a message about its backend: both are one line naming the folder
    and the files it lacks."""
    from offspec.formats.checkpoint import TOKENIZER_FILES
    from offspec.formats.open import load_tokenizer
    path = save_checkpoint(make_model(hf_config(arch, n_layers=1)), tmp_path / arch)
    for file in path.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            file.unlink()
    with pytest.raises(CheckpointError, match="no tokenizer files") as e:
        load_tokenizer(path)
    assert str(path) in str(e.value) and all(name in str(e.value) for name in TOKENIZER_FILES)


def test_a_tied_embedding_stays_with_its_lm_head(tmp_path):
    """global_weights: a tied lm_head is the embedding's tensor, on the compute device as given (any spelling of
    it); asked to put a tied embedding elsewhere, one line."""
    from offspec.errors import CheckpointError
    ckpt = Checkpoint(save_checkpoint(make_model(hf_config(tie=True)), tmp_path / "tied"))
    g = ckpt.global_weights(torch.device("meta"), torch.float32)
    assert g.lm_head is g.embed and g.embed.device.type == "meta"
    assert ckpt.global_weights("cpu", torch.float32, embed_device=torch.device("cpu")).lm_head is not None
    with pytest.raises(CheckpointError, match="tied to the lm_head"):
        ckpt.global_weights(torch.device("meta"), torch.float32, embed_device=torch.device("cpu"))
