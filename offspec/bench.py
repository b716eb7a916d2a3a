"""`offspec bench`: the Sequoia / DySpec protocol on one engine — prompts cut to a fixed length, a fixed
number of new tokens (EOS ignored, so every run makes the same count), plain autoregressive against
speculative, at each temperature."""
from __future__ import annotations

import statistics
from dataclasses import replace

from .config import SamplingConfig, TreeConfig
from .generate import Engine, GenerationRequest, run


def bench_prompts(tokenizer, items, prompt_tokens: int) -> list[tuple[str, tuple[int, ...]]]:
    """(id, first `prompt_tokens` ids of the raw prompt text) for each item; chat messages are templated."""
    from .prompt import encode_prompt
    out = []
    for item in items:
        ids = encode_prompt(tokenizer, item.prompt, raw=isinstance(item.prompt, str))
        out.append((item.id, tuple(ids[:prompt_tokens])))
    return out


def run_bench(engine: Engine, prompts, tree: TreeConfig, sampling: SamplingConfig, temperatures, new_tokens: int,
              on_result=None) -> list[dict]:
    """One row per (temperature, system, prompt)."""
    rows = []
    for temperature in temperatures:
        s = replace(sampling, temperature=temperature)
        for system, tree_cfg in (("autoregressive", replace(tree, policy="none")), (f"offspec-{tree.policy}", tree)):
            for prompt_id, ids in prompts:
                request = GenerationRequest(prompt_ids=ids, max_new_tokens=new_tokens, tree=tree_cfg, sampling=s,
                                            ignore_eos=True)
                report, steps = run(engine, request)
                row = {"temperature": temperature, "system": system, "id": prompt_id,
                       "seconds_per_token": report.seconds_per_token, "tokens_per_pass": report.tokens_per_pass,
                       "tokens_per_second": 1 / report.seconds_per_token if report.seconds_per_token > 0 else 0.0,
                       "passes": report.passes, "new_tokens": report.new_tokens,
                       "mean_tree_size": statistics.fmean([st.tree_size for st in steps]) if steps else 0.0,
                       "tokens": report.tokens}
                rows.append(row)
                if on_result is not None:
                    on_result(row)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Median s/token and tokens/pass per (temperature, system), with the speedup over autoregressive."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["temperature"], r["system"]), []).append(r)
    table = []
    for (temperature, system), rs in groups.items():
        table.append({"temperature": temperature, "system": system, "prompts": len(rs),
                      "median_seconds_per_token": statistics.median(r["seconds_per_token"] for r in rs),
                      "median_tokens_per_second": statistics.median(r["tokens_per_second"] for r in rs),
                      "median_tokens_per_pass": statistics.median(r["tokens_per_pass"] for r in rs),
                      "mean_tree_size": statistics.fmean(r["mean_tree_size"] for r in rs)})
    for row in table:
        base = next(t for t in table if t["temperature"] == row["temperature"] and t["system"] == "autoregressive")
        row["speedup"] = base["median_seconds_per_token"] / row["median_seconds_per_token"]
    return table


def format_table(table: list[dict]) -> str:
    head = f"{'T':>4}  {'system':<18} {'prompts':>7} {'s/token':>9} {'tok/pass':>9} {'tree':>7} {'speedup':>8}"
    lines = [head, "-" * len(head)]
    for r in table:
        lines.append(f"{r['temperature']:>4.1f}  {r['system']:<18} {r['prompts']:>7} {r['median_seconds_per_token']:>9.4f} "
                     f"{r['median_tokens_per_pass']:>9.2f} {r['mean_tree_size']:>7.1f} {r['speedup']:>7.2f}x")
    return "\n".join(lines)
