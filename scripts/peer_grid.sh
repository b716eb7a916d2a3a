#!/usr/bin/env bash
# The published peer grid (docs/benchmarks.md): offspec's default and its ablations against the transformers
# peer, code (HumanEval) and chat (MT-Bench first turns), 16 prompts each, 64 new tokens, greedy, bf16, host RAM
# and cold disk. Every step resumes from its rows file, so a killed run is rerun as is.
# Cost on the 2-core CPU machine, measured per prompt in a one-prompt pilot (cpu) and from earlier rows (disk):
# cpu ~100 s a prompt (27 min a set), the disk sweep ~17 min, disk ~190 s a prompt (51 min a set): ~3 h in all.
# hf-plain runs in the host-RAM regime only: on cold disk it costs ~3 s a token (1.7 h for the two sets).
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-docs/bench_peers}
for set in code chat; do
  python scripts/bench_peers.py --regime cpu --prompt-set $set --systems hf-assisted,hf-plain,default,none,chain-8,dyspec-16 \
      --sweep $ROWS/sweep-cpu-$set.jsonl --rows $ROWS/cpu-$set.jsonl
done
python scripts/peer_hf.py --regime disk --prompt-set chat --prompts 5 --rows $ROWS/sweep-disk-chat.jsonl
for set in code chat; do
  python scripts/bench_peers.py --regime disk --prompt-set $set --sweep $ROWS/sweep-disk-$set.jsonl \
      --rows $ROWS/disk-$set.jsonl
done
python scripts/render_peers.py --rows $ROWS/disk-code.jsonl $ROWS/disk-chat.jsonl $ROWS/cpu-code.jsonl \
    $ROWS/cpu-chat.jsonl --write-docs
