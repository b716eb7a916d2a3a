#!/usr/bin/env python
"""One command for a GPU lent for minutes: the first-GPU checklist, then a 70B-shaped pass, every result
written under OUT as it comes (a kill at the time limit still leaves what was measured).

Parts, in order, each in its own process with its own time limit (a hang or a crash ends that part alone):
  check    scripts/gpu_check.py --quick --out OUT/gpu_check.json (its log in OUT/gpu_check.log)
  pass70b  random bf16 decoder layers of Llama-3.1-70B's shape (hidden 8192, intermediate 28672, 64 heads,
           8 KV heads; 1.71 GB a layer), as many as --layers (at least 16), first all resident (compute of a
           pass at each width), then all streamed from the pinned host arena through the ring's slots: per
           width (1, 64, 256, 1024 tree tokens after a --context prefix) the pass, the copies' own time, the
           compute stall, the host->device GB/s, overlap efficiency = max(transfer, compute) / pass, and the
           streamed logits against the resident ones (bitwise)
  drafts   one call of a 1B-shaped (Llama-3.2-1B) and an 8B-shaped (Llama-3.1-8B) draft, resident, at the
           same widths, after the same prefix
  twin     one 70B-shaped layer's seven matrices as a twin (--draft self) holds them: bf16, int4 (PyTorch's int4
           matmul, formats/int4.py; its groups of 32, and of 64 as int4-g64) and nf4 (bitsandbytes: dequantized per
           call), at 1, 4, 16 and 64 tree rows;
           and int4's error against its reference dequantization (the CUDA kernel's first check); and a 70B
           lm_head read by those rows, the target's bf16 one (a GPU twin shares it) against an int4 copy
  kernels  the Triton dequantization kernels' tests on the GPU (tests/test_kernels.py: every format and shape
           edge, bit for bit against the torch transcriptions; OUT/kernels.log, OUT/kernels_junit.xml)
  dequant  the dequantization of one 70B layer on the GPU, for every layer format offspec streams: int8 and nf4
           (nf4 where bitsandbytes imports: the yardstick), and the published ones read as they are: AWQ g128,
           GPTQ 4-bit g128 (v2 and v1 zeros), compressed-tensors int4 g128 and int8 per channel, and GGUF Q4_K_M
           (Q4_K, Q6_K for v and down; random blocks with sane scales). Each by the torch transcriptions
           (OFFSPEC_DEQUANT=torch) and by the kernels in each of TILE_SWEEP's tiles, the kernel's dense layer
           compared bit for bit with the torch path's; the block's bytes against the dense layer's
           (costmodel.DEQUANT holds the default tiles' figures)
  passq    streamed passes of --layers 70B-shaped AWQ g128 and Q4_K_M layers from the pinned arena through the
           ring: the dequantization on its own queue (offspec's) or on the copy queue, by the kernels or the torch
           path; each pass against its copies alone
OUT/gpu_70b.json holds the parts' results (rewritten after every row); OUT/gpu_70b.md renders them.

Examples:
  PYTHONUNBUFFERED=1 python3 scripts/gpu_session.py --out $OUT           # ~3.5 min on an H100
  python scripts/gpu_session.py --tiny --device cpu --out /tmp/s         # a smoke test of the code, any machine

nf4 (the dequant part, and the nf4 GPU tests of the check) needs bitsandbytes, which a machine with no package
registry lacks: carry it, e.g. its manylinux wheel unzipped into a git-ignored folder of the checkout with only
the libbitsandbytes_cuda1*.so matching the machine's CUDA kept (about 8 MB), that folder on PYTHONPATH. Without
it those are skipped, with the reason. $OFFSPEC_COMMIT names the commit where the copied tree has no .git.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import _common  # noqa: E402
from bench_stream import forward_at, make_inputs, prefill  # noqa: E402
from gpu_check import back_to_back, measure_overlap, random_globals, random_layers, write_text  # noqa: E402

from offspec.config import ModelConfig, OffloadConfig  # noqa: E402
from offspec.engine.load import open_target_layers  # noqa: E402
from offspec.engine.metrics import Timer  # noqa: E402
from offspec.model.forward import Model  # noqa: E402
from offspec.plan.placement import LayerPlan  # noqa: E402
from offspec.plan.sizes import layer_nbytes  # noqa: E402

PARTS = ("check", "kernels", "pass70b", "drafts", "twin", "dequant", "passq")
PART_LIMIT_S = {"check": 260, "kernels": 150, "pass70b": 150, "drafts": 60, "twin": 110, "dequant": 150,
                "passq": 150}
TWIN_ROWS = (1, 4, 16, 64)
WIDTHS = (1, 64, 256, 1024)

LLAMA_70B = ModelConfig(arch="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, n_layers=16,
                        n_heads=64, n_kv_heads=8, head_dim=128, rms_norm_eps=1e-5)
DRAFTS = {
    "1B": ModelConfig(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, n_layers=16,
                      n_heads=32, n_kv_heads=8, head_dim=64, rms_norm_eps=1e-5),
    "8B": ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32,
                      n_heads=32, n_kv_heads=8, head_dim=128, rms_norm_eps=1e-5),
}
# --tiny: the same code on shapes a CPU runs in seconds (a smoke test; its figures mean nothing)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, n_heads=4, n_kv_heads=2, head_dim=64)   # (K-quant rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--out", required=True, help="folder for every result file")
    p.add_argument("--parts", default=",".join(PARTS), help="comma separated, in order: " + ", ".join(PARTS))
    p.add_argument("--layers", type=int, default=16, help="70B-shaped layers streamed (1.71 GB each, pinned)")
    p.add_argument("--slots", type=int, default=2, help="ring slots for the streamed pass")
    p.add_argument("--context", type=int, default=256, help="tokens in the cache before each timed pass")
    p.add_argument("--passes", type=int, default=3, help="timed passes per width (after one warm-up)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: check the code on a CPU")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)   # the child process's one part
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if unknown := [s for s in args.parts if s not in PARTS]:
        p.error(f"--parts: unknown {', '.join(unknown)}")
    args.out = Path(args.out)
    return args


def shape(cfg: ModelConfig, args, n_layers: int | None = None) -> ModelConfig:
    cfg = dataclasses.replace(cfg, **TINY) if args.tiny else cfg
    return dataclasses.replace(cfg, n_layers=n_layers) if n_layers else cfg


# ---------------------------------------------------------------- results, written as they come

class Results:
    """OUT/gpu_70b.json: {part: {...}}; every update rewrites it (and the markdown) atomically."""

    def __init__(self, out: Path):
        self.path = out / "gpu_70b.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def update(self, part: str, **fields) -> None:
        self.data.setdefault(part, {}).update(fields)
        write_text(self.path, json.dumps(self.data, indent=2) + "\n")
        write_text(self.path.with_suffix(".md"), render(self.data))

    def add_row(self, part: str, row: dict) -> None:
        self.update(part, rows=[*self.data.get(part, {}).get("rows", []), row])


# ---------------------------------------------------------------- the parts (run in a child process)

def pass70b_part(args, device: torch.device, results: Results) -> None:
    cfg = shape(LLAMA_70B, args, args.layers)
    layer_bytes = layer_nbytes(cfg, torch.bfloat16)
    results.update("pass70b", model=dataclasses.asdict(cfg), layer_bytes=layer_bytes, slots=args.slots,
                   context=args.context, passes=args.passes, widths=list(WIDTHS))
    out = measure_overlap(device, cfg, torch.bfloat16, n_slots=args.slots, tokens=list(WIDTHS),
                          passes=args.passes, context=args.context)
    for r in out["rows"]:
        r["compute_per_layer_s"] = r["compute_s"] / cfg.n_layers
        r["transfer_per_layer_s"] = r["transfer_s"] / out["streamed_layers"]
    results.update("pass70b", streamed_layers=out["streamed_layers"], host=out["host"], rows=out["rows"])


def drafts_part(args, device: torch.device, results: Results) -> None:
    for name, base in DRAFTS.items():
        cfg = shape(base, args)
        model = Model(cfg, random_globals(cfg, device, torch.bfloat16),
                      open_target_layers(random_layers(cfg, device, torch.bfloat16), cfg,
                                         LayerPlan.of(cfg, OffloadConfig(mode="none"), torch.bfloat16), device,
                                         torch.bfloat16, progress=False))
        inputs = make_inputs(cfg.vocab_size, args.context, list(WIDTHS), device)
        cache = prefill(model, inputs, args.context + max(WIDTHS))
        for T in WIDTHS:
            forward_at(model, cache, args.context, inputs.new[T])                       # warm-up
            with Timer(device) as timer:
                for _ in range(args.passes):
                    forward_at(model, cache, args.context, inputs.new[T])
            results.add_row("drafts", {"draft": name, "tokens": T, "call_s": timer.seconds / args.passes,
                                       "layers": cfg.n_layers, "hidden": cfg.hidden_size})
        del model, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()


def twin_part(args, device: torch.device, results: Results) -> None:
    from offspec.errors import InputError
    from offspec.formats import int4
    from offspec.formats.layout import layer_shapes
    from offspec.formats.weights import HeldWeight, linear

    cfg = shape(LLAMA_70B, args, 1)
    gen = torch.Generator(device).manual_seed(0)
    dense = [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
             for s in layer_shapes(cfg).values() if len(s) == 2]
    x = torch.randn(3, dense[0].shape[1], generator=gen, device=device, dtype=torch.bfloat16)
    want = x.float() @ int4.reference(dense[0]).t()
    held = int4.Int4Weight.quantize(dense[0])              # 8192 rows: packed 512 at a time, laid end to end
    got = held.matmul(x).float()
    from_host = int4.Int4Weight.quantize(dense[0].cpu(), device=device)   # a twin's lm_head kept on the host
    rel = lambda out: float((out.float() - want).abs().max() / want.abs().max())     # noqa: E731
    results.update("twin", int4_max_rel_error=rel(got), int4_from_host_max_rel_error=rel(from_host.matmul(x)),
                   layers_per_70b=80)
    forms = {"bf16": lambda w: w, "int4": int4.Int4Weight.quantize,
             "int4-g64": lambda w: int4.Int4Weight.quantize(w, source=64),
             "nf4": lambda w: HeldWeight.quantize(w, "nf4")}
    for form, make in forms.items():
        try:
            held = [make(w) for w in dense]
        except InputError as err:          # nf4 without bitsandbytes
            results.add_row("twin", {"form": form, "skipped": str(err)[:120]})
            continue
        nbytes = sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes for w in held)
        for T in TWIN_ROWS:
            xs = [torch.randn(T, w.shape[1], generator=gen, device=device, dtype=torch.bfloat16) for w in dense]
            for w, xi in zip(held, xs):                                                 # warm-up
                linear(xi, w)
            with Timer(device) as timer:
                for _ in range(args.passes):
                    for w, xi in zip(held, xs):
                        linear(xi, w)
            results.add_row("twin", {"form": form, "tokens": T, "layer_s": timer.seconds / args.passes,
                                     "layer_bytes": nbytes})
        del held
        if device.type == "cuda":
            torch.cuda.empty_cache()
    twin_head_rows(cfg, device, gen, args.passes, results)


def twin_head_rows(cfg: ModelConfig, device: torch.device, gen: torch.Generator, passes: int,
                   results: Results) -> None:
    """The twin's lm_head read at tree rows: the target's own bf16 one (what draft_quant.draft_lm_head shares on a
    GPU) against an int4 copy (what it holds where the target's stays in host memory)."""
    from offspec.formats import int4
    from offspec.formats.weights import linear

    dense = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
    for form, w in (("lm_head bf16 (shared)", dense), ("lm_head int4", int4.Int4Weight.quantize(dense))):
        nbytes = w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes
        for T in TWIN_ROWS:
            x = torch.randn(T, cfg.hidden_size, generator=gen, device=device, dtype=torch.bfloat16)
            linear(x, w)                                                                # warm-up
            with Timer(device) as timer:
                for _ in range(passes):
                    linear(x, w)
            results.add_row("twin", {"form": form, "tokens": T, "layer_s": timer.seconds / passes,
                                     "layer_bytes": nbytes, "head": True})
    del dense


def dequant_quants(cfg: ModelConfig) -> tuple[str, ...]:
    """The layer formats timed: offspec's own, and the published ones at the group size the shape divides into
    (128 for the 70B; a --tiny shape's is smaller), GGUF where rows are whole 256-weight K-quant blocks."""
    group = next(g for g in (128, 32, 16, 8) if cfg.hidden_size % g == 0 and cfg.intermediate_size % g == 0)
    gguf = ("gguf:q4_k,q4_k,q6_k,q4_k,q4_k,q4_k,q6_k",) if cfg.hidden_size % 256 == 0 == cfg.intermediate_size % 256 \
        else ()
    return ("int8", "nf4", f"awq-g{group}", f"gptq-b4-g{group}-v2", f"gptq-b4-g{group}", f"ct-b4-g{group}-bf16",
            "ct-b8-g0-asym-f16") + gguf


@contextlib.contextmanager
def dequant_path(path: str, tile: Optional[tuple[int, int, int]] = None):
    """path "torch": the torch transcriptions (OFFSPEC_DEQUANT=torch); "kernel": the Triton kernels, in `tile`."""
    import os

    from offspec.formats import kernels
    before_env, before_tiles = os.environ.get("OFFSPEC_DEQUANT"), dict(kernels.TILES)
    os.environ["OFFSPEC_DEQUANT"] = "torch" if path == "torch" else "kernel"
    if tile is not None:
        kernels.TILES.update({family: tile for family in kernels.TILES})
    try:
        yield
    finally:
        kernels.TILES.clear()
        kernels.TILES.update(before_tiles)
        if before_env is None:
            os.environ.pop("OFFSPEC_DEQUANT", None)
        else:
            os.environ["OFFSPEC_DEQUANT"] = before_env


def time_dequant(layout, block: torch.Tensor, dense: torch.Tensor, device: torch.device, calls: int) -> dict:
    """Seconds a call on the device (Timer) and to issue it from the host (before the device finishes): where
    the two are close, the host's per-kernel dispatch sets the pace, not the device."""
    layout.dequantize(block, dense)                                               # warm-up (and compile)
    with Timer(device) as timer:
        start = time.perf_counter()
        for _ in range(calls):
            layout.dequantize(block, dense)
        issued = time.perf_counter() - start
    return {"seconds": timer.seconds / calls, "issue_seconds": issued / calls}


def sane_gguf_block(layout, quant: str, block: torch.Tensor) -> None:
    """block <- random GGML blocks whose float16 scale fields are small and finite (random bytes there would be
    inf or NaN in a few blocks, and NaN never compares equal)."""
    from offspec.formats import gguf_blocks
    block.copy_(torch.randint(0, 256, block.shape, dtype=torch.uint8, device=block.device))
    pieces = layout.pieces(block)
    scale = torch.tensor([1e-3], dtype=torch.float16, device=block.device).view(torch.uint8)   # (2,) bytes
    for name, shape, _ in layout.dense.entries:
        if len(shape) != 2:
            continue
        t = gguf_blocks.BY_NAME[gguf_blocks.type_of(quant, name, 0)]
        raw = pieces[f"{name}.blocks"][: shape[0] * gguf_blocks.row_nbytes(t.name, shape[1])].view(-1, t.size)
        for at in ((208,) if t.name == "Q6_K" else (0, 2) if t.name in ("Q4_K", "Q5_K", "Q4_1", "Q5_1") else (0,)):
            raw[:, at:at + 2] = scale


def quantized_block(cfg: ModelConfig, quant: str, device: torch.device, weights) -> tuple:
    """(layout, one packed layer block on the device) for `quant`: packed from `weights`, or random sane GGML
    blocks for a GGUF layout."""
    from offspec.formats.quant import QuantizedLayout
    layout = QuantizedLayout.of(cfg, torch.bfloat16, quant)
    block = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)          # (nbytes,) the moved block
    if quant.startswith("gguf:"):
        sane_gguf_block(layout, quant, block)
    else:
        layout.pack(weights, block)
    return layout, block


def dequant_part(args, device: torch.device, results: Results) -> None:
    """Per format: the torch path, then the kernels in each of TILE_SWEEP's tiles (the first is offspec's
    default), each checked bit for bit against the torch path's dense layer on the device."""
    from offspec.errors import InputError
    from offspec.formats.kernels import TILES, tile_key
    from offspec.formats.published import is_published, short
    cfg = shape(LLAMA_70B, args, 1)
    weights = random_layers(cfg, device, torch.bfloat16)(0)
    for quant in dequant_quants(cfg):
        try:
            layout, block = quantized_block(cfg, quant, device, weights)
        except InputError as err:                  # nf4 without bitsandbytes
            results.add_row("dequant", {"quant": quant, "skipped": str(err)})
            continue
        name = short(quant) if is_published(quant) else quant
        dense = torch.empty(layout.dense.nbytes, dtype=torch.uint8, device=device)   # (dense nbytes,)
        row = {"quant": name, "block_bytes": layout.nbytes, "dense_bytes": layout.dense.nbytes}
        with dequant_path("torch"):
            results.add_row("dequant", {**row, "path": "torch",
                                        **time_dequant(layout, block, dense, device, args.passes * 3)})
        if quant == "nf4":
            continue
        reference = dense.clone()
        family = tile_key(quant)
        for tile in [TILES[family], *(t for t in TILE_SWEEP[family] if t != TILES[family])]:
            dense.fill_(0)
            with dequant_path("kernel", tile):
                timed = time_dequant(layout, block, dense, device, args.passes * 3)
            results.add_row("dequant", {**row, "path": "kernel", "tile": list(tile), **timed,
                                        "equal": bool(torch.equal(dense, reference))})
        del block, dense, reference


# Tiles (rows, columns, warps) timed per kernel family; offspec's default (kernels.TILES) first.
TILE_SWEEP = {"awq": [(128, 32, 4), (64, 64, 4), (256, 32, 8), (128, 64, 8)],
              "gptq": [(64, 64, 4), (128, 32, 4), (64, 128, 8)],
              "ct4": [(4, 1024, 8), (2, 1024, 4), (2, 2048, 8), (1, 2048, 8), (8, 512, 4), (4, 2048, 8)],
              "ct8": [(8, 512, 4), (4, 1024, 8), (1, 2048, 8), (4, 2048, 8)],
              "int8": [(16, 256, 4), (4, 1024, 8)],
              "gguf": [(2, 1024, 4), (1, 1024, 4), (1, 2048, 8), (4, 1024, 8), (2, 2048, 8), (4, 512, 4),
                       (8, 256, 4)]}
PASSQ_QUANTS = ("awq-g128", "gguf:q4_k,q4_k,q6_k,q4_k,q4_k,q4_k,q6_k", "nf4")
PASSQ_RUNS = (("two", "kernel"), ("one", "kernel"), ("two", "torch"), ("one", "torch"))   # (queues, path)


def passq_part(args, device: torch.device, results: Results) -> None:
    """Streamed passes of 70B-shaped quantized layers through the ring (pinned host arena, 2 slots): per format,
    the dequantization pipelined on its own queue or on the copy queue (one thing changed), by the kernels or the
    torch path; the pass against its copies alone (StreamStats' device-timed copy seconds)."""
    from bench_stream import settle

    from offspec.formats.published import short
    from offspec.stream.ring import LayerStreamer
    from offspec.stream.stores import HostArenaStore
    from offspec.stream.transfer import make_backend
    cfg = shape(LLAMA_70B, args, args.layers)
    globals_ = random_globals(cfg, device, torch.bfloat16)
    inputs = make_inputs(cfg.vocab_size, args.context, [1, 64], device)
    for quant in PASSQ_QUANTS if not args.tiny else dequant_quants(cfg)[2:3]:
        layout, block = quantized_block(cfg, quant, device, random_layers(cfg, device, torch.bfloat16)(0))
        host_block = block.cpu()
        del block
        for queues, path in PASSQ_RUNS if quant != "nf4" else PASSQ_RUNS[:2]:     # nf4: bitsandbytes' kernel
            backend = make_backend(device)
            if queues == "one":
                backend.dequant_queue = backend.copy_queue       # the dequantization follows each copy
            store = HostArenaStore.filled(lambda layer, b: b.copy_(host_block), layout, range(cfg.n_layers), backend,
                                          progress=False)
            with dequant_path(path), LayerStreamer(store, backend, cfg.n_layers, {}, args.slots) as streamer:
                layers = _Counted(streamer, cfg.n_layers)
                model = Model(cfg, globals_, streamer)
                cache = prefill(model, inputs, args.context + 64)
                for T in (1, 64):
                    back_to_back(model, cache, args.context, inputs.new[T], 1)           # warm-up
                    settle(layers, args.slots)
                    s0 = streamer.stats()
                    pass_s, _ = back_to_back(model, cache, args.context, inputs.new[T], args.passes)
                    settle(layers, args.slots)
                    s1 = streamer.stats()
                    copies = (s1.transfer_s - s0.transfer_s) / args.passes
                    dequant = (s1.dequant_s - s0.dequant_s) / args.passes
                    results.add_row("passq", {"quant": short(quant), "queues": queues, "path": path, "tokens": T,
                                              "layers": cfg.n_layers, "pass_s": pass_s, "copies_s": copies,
                                              "dequant_s": dequant, "pass_over_copies": pass_s / max(copies, 1e-9),
                                              "copy_gbps": (s1.bytes - s0.bytes) / max(s1.transfer_s - s0.transfer_s,
                                                                                        1e-9) / 1e9})
                del model, cache
            torch.cuda.empty_cache() if device.type == "cuda" else None


class _Counted:
    """What bench_stream.settle reads of a TargetLayers: stats() and the placement's streamed layers."""

    def __init__(self, streamer, n_layers: int):
        self.stats = streamer.stats
        self.placement = dataclasses.make_dataclass("P", ["streamed", "split"])(tuple(range(n_layers)), False)


PART_FNS = {"pass70b": pass70b_part, "drafts": drafts_part, "twin": twin_part, "dequant": dequant_part,
            "passq": passq_part}


def child(args) -> int:
    results = Results(args.out)
    device = torch.device(args.device)
    started = time.perf_counter()
    results.update(args.part, status="running")
    try:
        PART_FNS[args.part](args, device, results)
        results.update(args.part, status="passed", seconds=round(time.perf_counter() - started, 1))
        return 0
    except Exception as err:
        results.update(args.part, status="failed", error=f"{type(err).__name__}: {err}",
                       traceback=traceback.format_exc(limit=8).splitlines()[-10:],
                       seconds=round(time.perf_counter() - started, 1))
        return 1


# ---------------------------------------------------------------- the parent: one process per part

def run_part(part: str, args, argv: list[str]) -> None:
    if part == "check":
        command = [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--quick", "--out",
                   str(args.out / "gpu_check.json")]
        log = args.out / "gpu_check.log"
    elif part == "kernels":
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
                   f"--junitxml={args.out / 'kernels_junit.xml'}"]
        log = args.out / "kernels.log"
    else:
        command = [sys.executable, __file__, *argv, "--part", part]
        log = args.out / "gpu_70b.log"
    print(f"[{part}] running (limit {PART_LIMIT_S[part]} s)", flush=True)
    start = time.perf_counter()
    with open(log, "a") as sink:
        try:
            rc = subprocess.run(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                timeout=PART_LIMIT_S[part]).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.perf_counter() - start
    if part not in ("check", "kernels") and rc == "timeout":
        Results(args.out).update(part, status="timeout", seconds=round(seconds, 1))
    print(f"[{part}] exit {rc} in {seconds:.0f} s", flush=True)


def summary_lines(out: Path) -> list[str]:
    lines = []
    check = out / "gpu_check.json"
    if check.exists():
        c = json.loads(check.read_text())
        lines.append(f"check: {c.get('status')}; " + ", ".join(f"{k} {v.get('status')}"
                                                               for k, v in c.get("sections", {}).items()))
    data = json.loads((out / "gpu_70b.json").read_text()) if (out / "gpu_70b.json").exists() else {}
    for part, d in data.items():
        if part == "environment":
            continue
        lines.append(f"{part}: {d.get('status')}" + (f" ({d['error']})" if "error" in d else ""))
        for r in d.get("rows", []):
            lines.append("  " + ", ".join(f"{k}={_common.fmt(v, 4) if isinstance(v, float) else v}"
                                          for k, v in r.items() if not isinstance(v, (dict, list))))
    return lines


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:
        return child(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --tiny --device cpu to smoke-test the code)")
        return 0
    Results(args.out).update("environment", command=_common.command_line(), torch=torch.__version__,
                             commit=_common.git_commit(),
                             gpu=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                             started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), tiny=args.tiny)
    for part in args.parts:
        run_part(part, args, argv)
    print("\n".join(summary_lines(args.out)))
    return 0


# ---------------------------------------------------------------- rendering

def render(data: dict) -> str:
    f = _common.fmt
    env = data.get("environment", {})
    lines = ["# A 70B-shaped pass on one GPU (`scripts/gpu_session.py`)", "",
             f"`{env.get('command', '')}` on {env.get('gpu', '?')}, torch {env.get('torch', '?')}, commit "
             f"{env.get('commit') or 'unknown'}, {env.get('started', '')}" + (" (--tiny: figures mean nothing)"
                                                                              if env.get("tiny") else ""), ""]
    p = data.get("pass70b")
    if p:
        lines += ["## pass70b", "", f"status {p.get('status')}" + (f": `{p['error']}`" if "error" in p else ""), ""]
        if p.get("rows"):
            lines += [f"{p.get('streamed_layers')} layers of {p['layer_bytes'] / 1e9:.2f} GB (bf16) streamed through "
                      f"{p['slots']} slots from the host arena ({'pinned' if p['host']['pinned'] else 'PAGEABLE'}), "
                      f"{p['passes']} passes per width after a {p['context']}-token prefix.", "",
                      _common.markdown_table(
                          ["tokens", "pass s", "transfer s", "wait s", "compute s", "compute/layer ms",
                           "copy GB/s", "efficiency", "logits == resident"],
                          [[r["tokens"], f(r["pass_s"]), f(r["transfer_s"]), f(r["wait_s"]), f(r["compute_s"]),
                            f(r["compute_per_layer_s"] * 1e3, 2), f(r["copy_gbps"], 1), f(r["efficiency"], 2),
                            "yes" if r["logits_equal"] else "**no**"] for r in p["rows"]]), ""]
    for part, heads, cells in (
            ("drafts", ["draft", "tokens", "call ms"], lambda r: [r["draft"], r["tokens"], f(r["call_s"] * 1e3, 2)]),
            ("twin", ["form", "tree rows", "ms per 70B layer (or lm_head)", "x 80 layers, ms", "GB"],
             lambda r: [r["form"], r.get("tokens", "–"), r.get("skipped") or f(r["layer_s"] * 1e3, 3),
                        f(r["layer_s"] * 80e3, 1) if "layer_s" in r and not r.get("head") else "–",
                        f(r.get("layer_bytes", 0) / 1e9, 3)]),
            ("dequant", ["quant", "path", "tile (rows, cols, warps)", "ms per layer", "ms to issue",
                         "== torch path", "block GB", "dense GB"],
             lambda r: [r["quant"], r.get("path", "–"), r.get("tile", "–"),
                        r.get("skipped") or f(r["seconds"] * 1e3, 3),
                        f(r["issue_seconds"] * 1e3, 3) if "issue_seconds" in r else "–",
                        {True: "yes", False: "**no**"}.get(r.get("equal"), "–"),
                        f(r.get("block_bytes", 0) / 1e9, 3), f(r.get("dense_bytes", 0) / 1e9, 3)]),
            ("passq", ["quant", "dequantization queue", "path", "tokens", "layers", "pass s", "copies s",
                       "dequant s", "pass / copies", "copy GB/s"],
             lambda r: [r["quant"], "its own" if r["queues"] == "two" else "the copy queue", r["path"], r["tokens"],
                        r["layers"], f(r["pass_s"], 4), f(r["copies_s"], 4), f(r["dequant_s"], 4),
                        f(r["pass_over_copies"], 3), f(r["copy_gbps"], 1)])):
        d = data.get(part)
        if d:
            lines += [f"## {part}", "", f"status {d.get('status')}" + (f": `{d['error']}`" if "error" in d else ""),
                      ""]
            if d.get("rows"):
                lines += [_common.markdown_table(heads, [cells(r) for r in d["rows"]]), ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
