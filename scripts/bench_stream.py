#!/usr/bin/env python
"""How well does layer streaming hide the weight transfer behind compute?

For each offload mode (cpu: host arena; disk: packed store), with every decoder layer streamed through
a ring of --slots device slots, three things are timed in the same run, each over the same layers:

  pass     one full target forward (Model.forward) over --tokens new tokens after a --context-token
           prefix already in the KV cache: the shape of a decode step (1 token) or a tree verification
           (many tokens). Warm-up pass excluded; the median of --passes.
  compute  the same forward with every layer resident (offload none, the same packed layer blocks).
  move     the streamed bytes merely moved from the same source, with nothing computed:
             cpu   every layer block copied from the host arena into a slot buffer (the streamer's own
                   transfer backend: the copy worker thread on CPU, a side stream on CUDA);
             disk  every layer read from layers.bin by a DiskStore (the streamer's reads into staging
                   buffers) and copied from staging into a slot buffer.

  overlap efficiency = max(move, compute) / pass    (1.0 = transfer completely hidden; goal >= 0.9)

In disk mode the file is also dropped from the page cache (posix_fadvise DONTNEED) before every pass, so
every read is cold. Copy, read and wait seconds come from the streamer's own counters
(TargetLayers.stats(), StreamStats): wait is the time compute stood still waiting for a layer.

On this CPU-only machine the "device" is host memory and the copies share the cores (and the memory
bus) with compute, so the ideal of 1.0 is not reachable: the numbers say how far off it is.

Disk mode then measures the read rate of layers.bin itself, cold, --read-reps times, every reader once
per repetition, each repetition starting at another reader (the drive is shared: its speed drifts, and a
read's speed also depends on what ran just before it):

  plain    the whole file front to back in 64 MiB reads, one at a time (like dd bs=64M): buffered;
           buffered with each range dropped from the page cache right after it is read; O_DIRECT (where
           the filesystem allows it)
  store    a DiskStore (--reads-in-flight) reading every layer into its staging buffers, as the
           streamer's loader does, minus the copy
  All of them read into the same memory (the store's staging buffers), since the memory read into
  changes the rate on this VM.

  read ratio = store / the fastest plain read    (goal >= 0.9)

Examples:
  python scripts/bench_stream.py --modes cpu --passes 1 --tokens 1 --layers 4 --context 32   # smoke
  python scripts/bench_stream.py --modes cpu,disk --passes 5 --tokens 1,64 --write-docs      # full
  python scripts/bench_stream.py --modes disk --passes 1 --tokens 1 --reads-in-flight 8   # another read setting
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's offspec, not an installed one
import _common  # noqa: E402

from offspec.config import OffloadConfig
from offspec.engine.load import TargetLayers, open_target_layers, parse_device, parse_dtype, store_dir_for
from offspec.engine.metrics import Timer
from offspec.formats.checkpoint import Checkpoint
from offspec.formats.demo import DEFAULT_TARGET, ensure_demo_model, offspec_home
from offspec.formats.layout import LAYER_PARTS, LayerLayout
from offspec.model.forward import Model, RowSpan
from offspec.model.kv_cache import KVCache
from offspec.plan.placement import LayerPlan
from offspec.stream.disk import LAYERS_BIN, READS_IN_FLIGHT, DiskStore, drop_page_cache, sequential_read
from offspec.stream.stores import HostArenaStore
from offspec.stream.transfer import format_bytes, make_backend

SECTION = "bench_stream"
SETTLE_TIMEOUT_S = 120.0   # the streamer's prefetch of the next pass must finish within this
PLAIN_READ_BYTES = 64 << 20   # bytes per read of the plain sequential baselines (dd bs=64M)
READ_GOAL = 0.9            # the store's read rate / the fastest plain read


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--target", default=None, help="HF checkpoint folder of the target (default: the demo target, "
                                                   f"{DEFAULT_TARGET}, converted on first use)")
    p.add_argument("--dtype", default="bfloat16", help="weight and compute dtype")
    p.add_argument("--device", default="cpu", help="compute device (cpu or cuda[:N])")
    p.add_argument("--modes", default="cpu,disk", help="offload modes to measure, comma separated (cpu, disk)")
    p.add_argument("--passes", type=int, default=None, help="timed passes per (mode, tokens), after one warm-up "
                                                            "[default 5; 1 with --quick]")
    p.add_argument("--tokens", default=None, help="new tokens per pass, comma separated (1 = a decode step, "
                                                  "64 = a 63-node tree verification) [default 1,64; 1 with --quick]")
    p.add_argument("--context", type=int, default=None, help="tokens already in the KV cache before each pass "
                                                             "[default 128; 32 with --quick]")
    p.add_argument("--slots", type=int, default=2, help="ring slots the streamed layers rotate through")
    p.add_argument("--layers", type=int, default=None, help="use only the first N decoder layers (smoke tests; "
                                                            "the disk store then goes to a temporary folder) "
                                                            "[default all; 4 with --quick]")
    p.add_argument("--store-dir", default=None, help="disk mode: packed store folder (default: offspec's own, "
                                                     "shared with `offspec generate --offload disk`; built once "
                                                     "when missing)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--read-reps", type=int, default=3, help="disk mode: repetitions of the read-rate measurement")
    p.add_argument("--reads-in-flight", type=int, default=READS_IN_FLIGHT,
                   help="disk mode: the read-rate DiskStore's reads_in_flight (the streamer runs with the default)")
    p.add_argument("--quick", action="store_true", help="smoke-test sizes: 1 pass, 1 token, 4 layers, context 32 "
                                                        "(explicit flags win)")
    p.add_argument("--write-docs", action="store_true", help=f"write the table into docs/benchmarks.md "
                                                             f"(section {SECTION})")
    args = p.parse_args(argv)
    quick = args.quick
    args.passes = args.passes if args.passes is not None else (1 if quick else 5)
    args.tokens = [int(t) for t in (args.tokens or ("1" if quick else "1,64")).split(",")]
    args.context = args.context if args.context is not None else (32 if quick else 128)
    args.layers = args.layers if args.layers is not None else (4 if quick else None)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in ("cpu", "disk"):
            p.error(f"--modes: unknown mode {m!r} (cpu, disk)")
    if args.passes < 1 or min(args.tokens) < 1 or args.context < 1 or args.slots < 2:
        p.error("--passes, --tokens and --context must be >= 1, --slots >= 2")
    if args.read_reps < 1 or args.reads_in_flight < 1:
        p.error("--read-reps and --reads-in-flight must be >= 1")
    return args


# ---------------------------------------------------------------- passes

@dataclass
class Inputs:
    """Fixed random token ids: the values do not change the work a pass does."""
    context: torch.Tensor              # (C,) prefix ids, prefilled once per model
    new: dict[int, torch.Tensor]       # T -> (T,) ids of the timed pass


def make_inputs(vocab: int, context: int, tokens: list[int], device: torch.device) -> Inputs:
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, vocab, (context,), generator=gen)
    new = {t: torch.randint(0, vocab, (t,), generator=gen).to(device) for t in tokens}
    return Inputs(ctx.to(device), new)


def forward_at(model: Model, cache: KVCache, start: int, ids: torch.Tensor) -> torch.Tensor:
    """One forward over ids (T,) at positions/slots start .. start+T-1, attending causally to the cache.

    Every timed pass writes the same slots (start = the context length), so passes are identical and the
    cache never grows. Logits for all T rows, as a tree verification needs them."""
    T = ids.shape[0]
    positions = torch.arange(start, start + T, device=model.device)                # (T,) also the slots
    cols = torch.arange(start + T, device=model.device)
    mask = cols[None, :] <= positions[:, None]                                     # (T, start+T)
    return model.forward(ids, positions, [RowSpan(0, T, 0, positions, mask)], cache)   # (T, V)


def timed_passes(model: Model, cache: KVCache, inputs: Inputs, T: int, n: int, before_each=None) -> list[float]:
    """Wall seconds of n passes over T new tokens (device work included)."""
    seconds = []
    for _ in range(n):
        if before_each is not None:
            before_each()
        with Timer(model.device) as timer:
            forward_at(model, cache, inputs.context.shape[0], inputs.new[T])
        seconds.append(timer.seconds)
    return seconds


def prefill(model: Model, inputs: Inputs, capacity: int) -> KVCache:
    cache = KVCache.for_model(model.cfg, capacity, model.dtype, model.device)
    forward_at(model, cache, 0, inputs.context)
    cache.set_length(inputs.context.shape[0])
    return cache


# ---------------------------------------------------------------- streaming counters

def settle(layers: TargetLayers, n_slots: int) -> None:
    """Wait until the streamer has finished the loads it posts ahead (the first n_slots layers of the next
    pass), so the counters are complete and nothing streams while we measure something else.
    After P complete passes (prefill and warm-ups included) it has posted P * n_streamed + n_slots loads."""
    n_streamed = len(layers.placement.streamed) * (len(LAYER_PARTS) if layers.placement.split else 1)   # loads a pass
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        stats = layers.stats()
        if stats.layers >= stats.passes * n_streamed + n_slots:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the streamer did not finish its prefetch within {SETTLE_TIMEOUT_S:.0f} s")
        time.sleep(0.005)


def move_passes_cpu(store: HostArenaStore, streamed: tuple[int, ...], layout: LayerLayout, device: torch.device,
                    n_slots: int, n: int) -> list[float]:
    """n+1 times (the first is the warm-up, dropped): copy every streamed layer's arena block into a ring of
    slot buffers through a fresh transfer backend of the streamer's kind; wall seconds of each."""
    backend = make_backend(device)
    try:
        slots = [backend.device_buffer(layout.nbytes) for _ in range(n_slots)]
        pinned = store.info().pinned
        seconds = []
        for _ in range(n + 1):
            done = backend.new_event()
            start = time.perf_counter()
            for k, layer in enumerate(streamed):
                backend.copy_async(slots[k % n_slots], store.block(layer), src_pinned=pinned)
            done.record(backend.copy_queue)
            done.synchronize()
            seconds.append(time.perf_counter() - start)
        return seconds[1:]
    finally:
        backend.close()


def move_passes_disk(directory: str, layout: LayerLayout, n_layers: int, streamed: tuple[int, ...],
                     device: torch.device, n_slots: int, n: int, source_id: str) -> tuple[list[float], list[float]]:
    """n+1 times (the first, which also checks every layer's crc32, is dropped): drop layers.bin from the page
    cache, then read every streamed layer into a staging buffer of a second DiskStore on the same files (the
    streamer's reader, DiskStore.io) and copy it into a ring of slot buffers, as the streamer's loader does.
    -> (wall seconds, read seconds) of each."""
    backend = make_backend(device)
    store = None
    try:
        store = DiskStore(directory, layout, n_layers, backend, source_id=source_id, drop_page_cache=True)
        slots = [backend.device_buffer(layout.nbytes) for _ in range(n_slots)]
        path = os.path.join(directory, LAYERS_BIN)
        seconds, reads = [], []
        for _ in range(n + 1):
            drop_page_cache(path)
            done = backend.new_event()
            read_s = 0.0
            start = time.perf_counter()
            for k, layer in enumerate(streamed):
                # reads one layer ahead within the pass, as the streamer's loader does (not into the next pass:
                # its first read comes after the page cache is dropped)
                staged = store.acquire(layer, next_layer=streamed[k + 1] if k + 1 < len(streamed) else None)
                backend.copy_async(slots[k % n_slots], staged.block, src_pinned=staged.pinned)
                staged.gate.record(backend.copy_queue)       # the staging buffer may be refilled after this
                read_s += staged.read_s
            done.record(backend.copy_queue)
            done.synchronize()
            seconds.append(time.perf_counter() - start)
            reads.append(read_s)
        return seconds[1:], reads[1:]
    finally:
        backend.close()        # the copy queue first: no copy may still read a staging buffer
        if store is not None:
            store.close()


# ---------------------------------------------------------------- read rate of layers.bin

@dataclass
class ReadRow:
    reader: str                # what read the file
    store: bool                # the DiskStore (compared with the plain reads)
    gbps: list[float] = dataclasses.field(default_factory=list)   # GB/s of each repetition
    refused: str = ""          # why this reader could not run here ("" when it ran)


def measure_read_rates(directory: str, layout: LayerLayout, n_layers: int, device: torch.device, source_id: str,
                       reads_in_flight: int, reps: int) -> list[ReadRow]:
    """Cold whole-file read rates of layers.bin, plain sequential reads and a DiskStore's, `reps` times each,
    interleaved, each repetition starting at another reader.

    Every reader reads into the same memory, the DiskStore's two staging buffers: on this VM the rate of the
    same reads into different buffers differed by up to 20%, steadily, so separate buffers would compare
    memory, not readers. The store's first read of each layer checks its crc32, so it reads the file once
    before the timed repetitions."""
    path = os.path.join(directory, LAYERS_BIN)
    size = os.stat(path).st_size
    with contextlib.ExitStack() as cleanup:
        backend = make_backend(device)
        cleanup.callback(backend.close)
        store = DiskStore(directory, layout, n_layers, backend, source_id=source_id, reads_in_flight=reads_in_flight)
        cleanup.callback(store.close)
        for layer in range(n_layers):
            store.acquire(layer)                         # checks every crc32 (not timed)
        chunk = min(PLAIN_READ_BYTES, store.block_nbytes)                 # a multiple of 4096
        stages = [memoryview(stage.tensor.numpy())[:chunk] for stage in store._stages]   # page-aligned
        plain = f"{format_bytes(chunk)} reads, one at a time"
        readers: list[tuple[ReadRow, Callable[[], None]]] = [
            (ReadRow(f"plain buffered, {plain}", store=False),
             lambda: sequential_read(path, stages, direct=False, drop_behind=False)),
            (ReadRow(f"plain buffered + DONTNEED behind, {plain}", store=False),
             lambda: sequential_read(path, stages, direct=False, drop_behind=True)),
        ]
        if hasattr(os, "O_DIRECT"):
            readers.append((ReadRow(f"plain O_DIRECT, {plain}", store=False),
                            lambda: sequential_read(path, stages, direct=True, drop_behind=False)))
        # acquire() is the streamer's read, one layer ahead; its staging gates are never recorded here
        last = n_layers - 1
        readers.append((ReadRow(f"DiskStore: {store.io}", store=True),
                        lambda: [store.acquire(i, next_layer=i + 1 if i < last else None) for i in range(n_layers)]))
        for rep in range(reps):
            first = rep * len(readers) // reps        # the drive's speed drifts: vary who runs when
            for row, read in readers[first:] + readers[:first]:
                if row.refused:
                    continue
                drop_page_cache(path)
                start = time.perf_counter()
                try:
                    read()
                except OSError as err:
                    if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    row.refused = f"refused by the filesystem ({errno.errorcode[err.errno]})"
                    continue
                row.gbps.append(size / (time.perf_counter() - start) / 1e9)
                print(f"[read {rep + 1}/{reps}] {row.reader}: {row.gbps[-1]:.2f} GB/s", file=sys.stderr)
    return [row for row, _ in readers]


def read_ratio(rows: list[ReadRow]) -> tuple[float, list[float]]:
    """The DiskStore's rate / the fastest plain rate: (of the medians, of each repetition)."""
    plain = [r for r in rows if not r.store and r.gbps]
    store = next(r for r in rows if r.store)
    per_rep = [g / max(r.gbps[i] for r in plain) for i, g in enumerate(store.gbps)]
    return statistics.median(store.gbps) / max(statistics.median(r.gbps) for r in plain), per_rep


def read_table(rows: list[ReadRow]) -> tuple[list[str], list[list[str]]]:
    """Columns: reader, GB/s of each repetition, median; the store's row also its read_ratio()."""
    f = _common.fmt
    reps = max(len(r.gbps) for r in rows)
    ratio, per_rep = read_ratio(rows)
    headers = ["reader"] + [f"run {i + 1} GB/s" for i in range(reps)] + ["median GB/s", "store / fastest plain"]
    out = []
    for r in rows:
        if r.refused:
            out.append([r.reader] + ["–"] * reps + [r.refused, "–"])
            continue
        cell = f"{f(ratio, 2)} (runs: {', '.join(f(x, 2) for x in per_rep)})" if r.store else "–"
        out.append([r.reader] + [f(g, 2) for g in r.gbps] + [f(statistics.median(r.gbps), 2), cell])
    return headers, out


READ_NOTES = f"""Cold whole-file reads of the same `layers.bin` (the page cache dropped before each) into the same
memory (the DiskStore's two staging buffers), every reader once per run, each run starting at another
reader (the drive is shared and its speed drifts). **plain**: front to back, one read at a time
(buffered; buffered with each range dropped right after it is read; O_DIRECT). **DiskStore**: every layer
read as the streamer's loader does, minus the copy. **store / fastest plain** = the store's median / the
fastest plain median (each run's own ratio in brackets); goal ≥ {READ_GOAL}."""


# ---------------------------------------------------------------- the run

@dataclass
class Row:
    mode: str
    tokens: int
    pass_s: float          # median streamed pass
    compute_s: float       # median resident pass (same tokens)
    move_s: float          # median move-only pass
    wait_s: float          # per pass: compute stood still waiting for a layer (StreamStats)
    copy_s: float          # per pass: the copies' own time on the copy queue (StreamStats)
    read_s: float          # per pass: disk reads (StreamStats; 0 in cpu mode)
    move_read_s: float     # disk: per move-only pass, seconds of reading
    bytes_per_pass: int

    @property
    def efficiency(self) -> float:
        return max(self.move_s, self.compute_s) / self.pass_s

    def gbps(self, seconds: float) -> float:
        return self.bytes_per_pass / seconds / 1e9 if seconds > 0 else float("nan")


def measure_resident(ckpt: Checkpoint, cfg, globals_, inputs: Inputs, args, device, dtype, capacity) -> dict[int, float]:
    print(f"[none] loading {cfg.n_layers} layers resident", file=sys.stderr)
    layers = open_target_layers(ckpt.layer_tensors, cfg,
                                LayerPlan.of(cfg, OffloadConfig(mode="none"), dtype),
                                device, dtype, progress=True, source_id=ckpt.fingerprint())
    with layers:
        model = Model(cfg, globals_, layers)
        cache = prefill(model, inputs, capacity)
        out = {}
        for T in args.tokens:
            timed_passes(model, cache, inputs, T, 1)                               # warm-up
            seconds = timed_passes(model, cache, inputs, T, args.passes)
            out[T] = statistics.median(seconds)
            print(f"[none] T={T}: compute {out[T]:.3f} s/pass (passes: {', '.join(f'{s:.3f}' for s in seconds)})",
                  file=sys.stderr)
    return out


def measure_streamed(mode: str, ckpt: Checkpoint, cfg, globals_, inputs: Inputs, args, device, dtype, capacity,
                     store_dir: Optional[str], compute: dict[int, float]) -> tuple[list[Row], str]:
    layout = LayerLayout.of(cfg, dtype)
    offload = OffloadConfig(mode=mode, n_slots=args.slots, gpu_budget=args.slots * layout.nbytes,
                            store_dir=store_dir, drop_page_cache=True)
    print(f"[{mode}] opening {cfg.n_layers} streamed layers", file=sys.stderr)
    layers = open_target_layers(ckpt.layer_tensors, cfg,
                                LayerPlan.of(cfg, offload, dtype, store_dir=store_dir),
                                device, dtype, progress=True, source_id=ckpt.fingerprint())
    with layers:
        streamed = layers.placement.streamed
        assert len(streamed) == cfg.n_layers and layers.placement.n_slots == args.slots, layers.placement
        host = layers.host
        where = f"{host.kind}, {'pinned' if host.pinned else 'pageable (' + host.reason + ')'}"
        if host.io:
            where += f", {host.io}"
        model = Model(cfg, globals_, layers)
        bin_path = os.path.join(store_dir, LAYERS_BIN) if mode == "disk" else None
        cold = (lambda: drop_page_cache(bin_path)) if bin_path else None
        if cold:
            cold()
        cache = prefill(model, inputs, capacity)
        per_T = {}
        for T in args.tokens:
            timed_passes(model, cache, inputs, T, 1, cold)                         # warm-up
            s0 = layers.stats()
            seconds = timed_passes(model, cache, inputs, T, args.passes, cold)
            settle(layers, args.slots)
            s1 = layers.stats()
            d_layers = s1.layers - s0.layers                 # ~ passes * n_streamed (+ the prefetch in flight at s0)
            per_layer = lambda x: x / d_layers * len(streamed) if d_layers else float("nan")
            per_T[T] = dict(pass_s=statistics.median(seconds), wait_s=(s1.wait_s - s0.wait_s) / args.passes,
                            copy_s=per_layer(s1.transfer_s - s0.transfer_s), read_s=per_layer(s1.read_s - s0.read_s))
            print(f"[{mode}] T={T}: pass {per_T[T]['pass_s']:.3f} s (passes: {', '.join(f'{s:.3f}' for s in seconds)}), "
                  f"wait {per_T[T]['wait_s']:.3f} s, copy {per_T[T]['copy_s']:.3f} s, read {per_T[T]['read_s']:.3f} s",
                  file=sys.stderr)
        # Move only: the streamer is settled (idle) now; its store stays open, so the same arena is read.
        move_read = [0.0]
        if mode == "cpu":
            move = move_passes_cpu(layers.source.store, streamed, layout, device, args.slots, args.passes)
        else:
            move, move_read = move_passes_disk(store_dir, layout, cfg.n_layers, streamed, device, args.slots,
                                               args.passes, ckpt.fingerprint())
        print(f"[{mode}] move only: {statistics.median(move):.3f} s/pass (passes: {', '.join(f'{s:.3f}' for s in move)})",
              file=sys.stderr)
    rows = [Row(mode, T, compute_s=compute[T], move_s=statistics.median(move), move_read_s=statistics.median(move_read),
                bytes_per_pass=len(streamed) * layout.nbytes, **v) for T, v in per_T.items()]
    return rows, where


HEADERS = ["mode", "tokens", "pass s", "compute s", "move s", "efficiency", "wait s", "copy s", "read s",
           "stream GB/s", "move GB/s", "copy GB/s", "read GB/s"]


def table_rows(rows: list[Row]) -> list[list[str]]:
    f = _common.fmt
    out = []
    for r in rows:
        disk = r.mode == "disk"
        out.append([r.mode, r.tokens, f(r.pass_s), f(r.compute_s), f(r.move_s), f(r.efficiency, 2), f(r.wait_s),
                    f(r.copy_s), f(r.read_s) if disk else "–", f(r.gbps(r.pass_s), 2), f(r.gbps(r.move_s), 2),
                    f(r.gbps(r.copy_s), 2), f(r.gbps(r.read_s), 2) if disk else "–"])
    return out


COLUMN_NOTES = """Columns (seconds are per pass; medians over the timed passes, warm-up excluded):
- **pass s**: one streamed target forward; **compute s**: the same forward with all layers resident;
  **move s**: moving the same bytes from the same source with no compute (cpu: arena → slot copies;
  disk: cold DiskStore reads of `layers.bin` into staging + staging → slot copies).
- **efficiency** = max(move, compute) / pass: 1.0 means the transfer is fully hidden (goal ≥ 0.9).
- **wait s**: compute stood still waiting for a layer; **copy s** / **read s**: the streamer's own copy and
  (disk) read time (`StreamStats`), overlapped with compute.
- **stream GB/s** = streamed bytes / pass s (the rate a pass consumes weights); **move GB/s** = bytes / move s;
  **copy GB/s**, **read GB/s** = bytes / copy s, bytes / read s."""


def main(argv=None) -> int:
    args = parse_args(argv)
    started, load_at_start = time.time(), _common.load_average()
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = Path(args.target) if args.target else ensure_demo_model(DEFAULT_TARGET)
    ckpt = Checkpoint(target)
    full_layers = ckpt.config.n_layers
    cfg = ckpt.config
    if args.layers is not None:
        if not 1 <= args.layers <= full_layers:
            raise SystemExit(f"--layers must be in 1..{full_layers}")
        cfg = dataclasses.replace(cfg, n_layers=args.layers)
    if cfg.n_layers <= args.slots:
        raise SystemExit(f"{cfg.n_layers} layers with {args.slots} slots: nothing would stream; use fewer slots")
    layout = LayerLayout.of(cfg, dtype)
    print(f"target {target} ({cfg.n_layers} of {full_layers} layers, {layout.nbytes / 2**20:.1f} MiB each in "
          f"{args.dtype}); load average {load_at_start}", file=sys.stderr)

    globals_ = ckpt.global_weights(device, dtype)     # embedding, final norm, lm_head: resident in every mode
    inputs = make_inputs(cfg.vocab_size, args.context, args.tokens, device)
    capacity = args.context + max(args.tokens)
    torch.manual_seed(0)

    with contextlib.ExitStack() as cleanup:
        store_dir = args.store_dir
        if "disk" in args.modes and store_dir is None:
            if cfg.n_layers == full_layers:
                store_dir = str(store_dir_for(ckpt, dtype, offspec_home()))
            else:   # a store of the first N layers only: temporary (the shared store holds the whole model)
                parent = offspec_home() / "stores"
                parent.mkdir(parents=True, exist_ok=True)
                store_dir = tempfile.mkdtemp(prefix=f".bench-{target.name}-first{cfg.n_layers}-", dir=parent)
                os.rmdir(store_dir)                        # open_target_layers builds it there
                cleanup.callback(shutil.rmtree, store_dir, ignore_errors=True)

        compute = measure_resident(ckpt, cfg, globals_, inputs, args, device, dtype, capacity)
        rows, sources = [], {}
        for mode in args.modes:
            mode_rows, sources[mode] = measure_streamed(mode, ckpt, cfg, globals_, inputs, args, device, dtype,
                                                        capacity, store_dir if mode == "disk" else None, compute)
            rows += mode_rows
        read_rows = []
        if "disk" in args.modes:
            read_rows = measure_read_rates(store_dir, layout, cfg.n_layers, device, ckpt.fingerprint(),
                                           args.reads_in_flight, args.read_reps)

    print()
    print(_common.text_table(HEADERS, table_rows(rows)))
    worst = min(r.efficiency for r in rows)
    verdict = "met" if worst >= 0.9 else "NOT met"
    print(f"\noverlap efficiency goal (>= 0.9 in every row): {verdict} (lowest {worst:.2f})")
    print("\n" + COLUMN_NOTES)
    if read_rows:
        print()
        print(_common.text_table(*read_table(read_rows)))
        ratio = read_ratio(read_rows)[0]
        read_verdict = "met" if ratio >= READ_GOAL else "NOT met"
        print(f"\nread rate goal (DiskStore >= {READ_GOAL} x the fastest plain read): {read_verdict} ({ratio:.2f})")
        print("\n" + READ_NOTES)

    if args.write_docs:
        partial = (f" **Partial run: only the first {cfg.n_layers} of {full_layers} layers.**"
                   if cfg.n_layers != full_layers else "")
        setup = (f"Target `{target.name}`, {cfg.n_layers} decoder layers of {layout.nbytes / 1e6:.1f} MB "
                 f"({args.dtype}) = {cfg.n_layers * layout.nbytes / 1e9:.2f} GB streamed per pass, all layers "
                 f"streamed through {args.slots} slots; embeddings, final norm and lm_head resident. Each pass "
                 f"follows a {args.context}-token prefix in the KV cache; {args.passes} timed pass(es) after one "
                 f"warm-up. Sources: " + "; ".join(f"{m}: {s}" for m, s in sources.items()) + "." + partial)
        body = "\n\n".join([
            "\n".join(["## Layer streaming: pass time vs transfer and compute (`scripts/bench_stream.py`)",
                       _common.run_header(device, started, load_at_start),
                       setup + " Seconds are per pass, medians over the timed passes; efficiency = max(move, "
                       "compute) / pass (1.0: the transfer wholly hidden); the columns: the script's docstring. "
                       "Below, the read rate of the same `layers.bin`, cold, into the same memory: each reader "
                       "once a run, the runs starting at another reader."]),
            _common.markdown_table(HEADERS, table_rows(rows)),
            *([_common.markdown_table(*read_table(read_rows))] if read_rows else []),
            "\n".join([f"Overlap efficiency goal (≥ 0.9 in every row): **{verdict}** (lowest {worst:.2f})."]
                      + ([f"Read rate goal (DiskStore ≥ {READ_GOAL} × the fastest plain read): **{read_verdict}** "
                          f"({ratio:.2f})."] if read_rows else [])),
        ])
        _common.write_doc_section(SECTION, body)
        print(f"wrote section {SECTION} of {_common.BENCHMARKS_MD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    _common.run_main(main)
