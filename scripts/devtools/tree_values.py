#!/usr/bin/env python
"""Do a tree's node values predict what the target accepts? The budget planner's expected tokens a round, E(N), is
the sum of the tree's values (engine/controller.py), so this is what it prices trees by.

One fixed tree setting on a pair, loaded as bench_accept loads it (bf16, EOS ignored); every round's tree is kept
and set beside the tokens the target accepted (the bonus not counted). Per round: the sum of the values the tree
was grown with (a Sequoia tree: f(v), its acceptance by rank), the sum of the draft's probability products (what
dyspec's values are), and by depth d the rounds that accepted at least d tokens against each model's mass at d.

  T=~/.cache/offspec/models/qwen2.5-coder-1.5b-instruct
  python scripts/devtools/tree_values.py --target $T --draft self --tree sequoia-64 --prompt-set chat --prompts 4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]  # offspec, scripts/
import _common  # noqa: E402
import peer_hf  # noqa: E402

DEPTHS = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 48, 64)


def draft_values(tree) -> list[float]:
    """The product of the draft's probabilities along each node's path (root: 1), the node values of dyspec."""
    values = [1.0]
    for n in range(1, tree.n_nodes):
        values.append(values[int(tree.parents[n])] * tree.draft_prob(n))
    return values


def round_record(tree, accepted: int) -> dict:
    """One round: accepted tokens, both models' sums, and each model's mass by depth (index d - 1)."""
    depths = tree.depths.tolist()
    grown, drafted = tree.values.tolist(), draft_values(tree)
    by_depth = [[0.0, 0.0] for _ in range(max(depths))]
    for n in range(1, tree.n_nodes):
        by_depth[depths[n] - 1][0] += grown[n]
        by_depth[depths[n] - 1][1] += drafted[n]
    return {"accepted": accepted, "grown": sum(grown[1:]), "draft": sum(drafted[1:]), "by_depth": by_depth}


def summary(rounds: list[dict]) -> list[str]:
    """Markdown lines: the per-round means, then by depth."""
    R = len(rounds)
    mean = {k: sum(r[k] for r in rounds) / R for k in ("accepted", "grown", "draft")}
    lines = [f"{R} tree rounds; a round's mean: accepted {mean['accepted']:.2f}, grown values {mean['grown']:.2f}, "
             f"draft-probability values {mean['draft']:.2f}", "",
             "| depth d | rounds that accepted >= d | grown values at d | draft values at d |", "|---|---|---|---|"]
    for d in (d for d in DEPTHS if any(len(r["by_depth"]) >= d for r in rounds)):
        at = [r["by_depth"][d - 1] if len(r["by_depth"]) >= d else (0.0, 0.0) for r in rounds]
        reached = sum(r["accepted"] >= d for r in rounds) / R
        lines.append(f"| {d} | {reached:.3f} | {sum(a[0] for a in at) / R:.3f} | {sum(a[1] for a in at) / R:.3f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True, help="a folder, or self (the target's twin)")
    ap.add_argument("--tree", default="sequoia-64", help="<policy>-<N>, a fixed budget (offspec.bench.runner)")
    ap.add_argument("--max-depth", type=int, default=None, help="default: auto (32 at a fixed budget)")
    ap.add_argument("--prompt-set", default="chat", choices=("chat", "code"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    from offspec.errors import OffspecError
    try:
        rounds = measure(args)
    except OffspecError as e:
        raise SystemExit(f"tree_values: {e}") from None
    print("\n".join(summary(rounds)))
    return 0


def measure(args) -> list[dict]:
    import offspec.engine.generate as generate
    from offspec.bench import runner as bench
    from offspec.config import OffloadConfig, TreeConfig
    from offspec.engine.load import Models, parse_dtype, runtime_config
    from offspec.engine.request import GenerationRequest

    trees, grow = [], generate.grow_steps

    def kept(*a, **k):
        tree = yield from grow(*a, **k)
        trees.append(tree)
        return tree

    generate.grow_steps = kept
    models = Models.open(args.target, args.draft)
    tree = bench.system_tree(args.tree, TreeConfig(max_depth=args.max_depth))
    prompts = peer_hf.encoded_prompts(args.prompt_set, args.prompts, 0, models.tokenizer)
    limits = bench.bench_limits([tree], max(len(ids) for _, ids in prompts) + args.new_tokens, sampling=False)
    runtime = runtime_config(_common.compute_device("auto"), parse_dtype("bfloat16"), "auto", twin=models.twin)
    engine = models.load(OffloadConfig(mode="auto"), runtime, limits, progress=False).engine
    rounds = []
    for pid, ids in prompts:
        trees.clear()
        request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=args.new_tokens, tree=tree, ignore_eos=True)
        steps = [s for s in engine.generate(request) if s.tree_size > 0]
        grown = [t for t in trees if t.size > 0]
        rounds += [round_record(t, s.accepted) for t, s in zip(grown, steps, strict=True)]
        print(f"{pid}: {len(steps)} tree rounds", file=sys.stderr)
    return rounds


if __name__ == "__main__":
    sys.exit(main())
