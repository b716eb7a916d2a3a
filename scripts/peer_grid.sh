#!/usr/bin/env bash
# The published peer grid (docs/benchmarks.md): offspec's default and its ablations against the transformers
# peer, code (HumanEval) and chat (MT-Bench first turns), 16 prompts each, 64 new tokens, greedy, bf16, host RAM
# and cold disk. Host RAM twice: as a CPU user runs offspec (--offload auto: the target left where it lies; the
# README's headline) and the streamed emulation (--offload cpu: every layer copied each pass on the cores that
# compute; an ablation). Every step resumes from its rows file, so a killed run is rerun as is. A step that reports a
# token difference float32 does not explain (exit 1) does not stop the others; the grid then exits 1.
# Its cost, planned and measured step by step: docs/notes/2026-11-26-one-harness-and-the-peer-grid.md.
# hf-plain runs in the host-RAM regime only (on a cold disk it would cost more than the rest of the grid).
# The peer's settings come from its sweeps: disk chat's is made here (64 new tokens, 1 run); the other three
# were measured earlier at 128 new tokens, 3 runs each (their rows say so).
set -uo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-docs/bench_peers}
status=0
for set in code chat; do
  python scripts/bench_peers.py --regime cpu --prompt-set "$set" --offload auto \
      --systems hf-assisted,hf-plain,default,none,chain-8,dyspec-16 \
      --sweep "$ROWS/sweep-cpu-$set.jsonl" --rows "$ROWS/cpu-auto-$set.jsonl" || status=1
  python scripts/bench_peers.py --regime cpu --prompt-set "$set" \
      --systems hf-assisted,hf-plain,default,none,chain-8,dyspec-16 \
      --sweep "$ROWS/sweep-cpu-$set.jsonl" --rows "$ROWS/cpu-$set.jsonl" || status=1
done
python scripts/bench_peers.py --regime disk --prompt-set code --sweep "$ROWS/sweep-disk-code.jsonl" \
    --rows "$ROWS/disk-code.jsonl" || status=1
python scripts/peer_hf.py --regime disk --prompt-set chat --prompts 5 --rows "$ROWS/sweep-disk-chat.jsonl" || status=1
python scripts/bench_peers.py --regime disk --prompt-set chat --sweep "$ROWS/sweep-disk-chat.jsonl" \
    --rows "$ROWS/disk-chat.jsonl" || status=1
exit $status
