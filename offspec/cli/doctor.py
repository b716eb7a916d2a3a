"""`offspec doctor`: what this machine offers a run, measured, and the flags to run a target with.

    check(target_dir, draft_dir, device, store_dir, quick) -> dict      (every section says ok / skipped / failed)

  devices    CUDA devices with free and total memory, and the card of offspec's table each is (costmodel.GPUS:
             what `models info` predicts for); none: the CPU is the device
  host       MemTotal, MemAvailable, this process's cgroup limit, and what a run may use of them
  pinning    the largest host buffer that can be pinned (CUDA: cudaHostRegister on an exact-size mapping, the
             arena's own path, halving from the pinned budget); not applicable without CUDA
  link       host -> device copy rate through offspec's own transfer backend: pinned and pageable on CUDA; on a
             CPU the copy worker's memcpy (the streamer's "transfer" there)
  drive      cold sequential read rate of the drive that holds the disk stores (a packed store of the target
             when one exists, read as the streamer reads it; else a temporary file)
  advice     for --target (and --draft): the memory plan on this machine (offspec/plan/), the predicted pass time
             from the measured rates, and the --offload / --gpu-budget / --slots / --tree-budget to use

The link and drive rates measured are kept (model_info.save_rates): `offspec models info` predicts with them.
Each section catches its own failure (recorded with the error) so one broken piece never hides the rest.
Nothing here allocates more than a probe needs, and every probe frees what it took.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import click
import psutil
import torch

from offspec.cli.model_info import save_rates
from offspec.cli.options import check_writable, default_device, headers_checkpoint, write_report
from offspec.errors import OffspecError
from offspec.formats import cpu_bf16
from offspec.plan.costmodel import find_gpu, gpu_keys
from offspec.stream.transfer import PAGE_BYTES, HostBuffer, format_bytes, make_backend

PROBE_BYTES = 256 << 20        # one copy in the link probe
DRIVE_PROBE_BYTES = 1 << 30    # the temporary file of the drive probe (when no store exists)
READ_BYTES = 64 << 20          # bytes per read of the drive probe (dd bs=64M)
MIN_PIN_BYTES = 256 << 20      # the pinning probe stops halving below this


def check(target, draft, device: torch.device, store_dir: Optional[str], quick: bool = False,
          progress: Callable[[str], None] = lambda line: None) -> dict:
    """Every section, in order; `progress` hears a line as each starts. target, draft: checkpoint.Checkpoints
    (headers are enough: a hub id's, read without its weights; draft may be None), or no target."""
    report: dict = {"device": str(device)}
    sections = [("devices", lambda: devices()), ("host", lambda: host()),
                ("pinning", lambda: pinning(device, quick)), ("link", lambda: link(device, quick)),
                ("drive", lambda: drive(store_dir, target, quick))]
    for name, run in sections:
        progress(f"checking {name} ...")
        report[name] = _guarded(run)
    if target is not None:
        progress("planning the target ...")
        report["advice"] = _guarded(lambda: advice(target, draft, device, report))
    else:
        report["advice"] = {"status": "skipped", "why": "no --target given (and the demo models are not prepared)"}
    return report


def _guarded(run: Callable[[], dict]) -> dict:
    try:
        out = run()
        out.setdefault("status", "ok")
        return out
    except Exception as err:      # recorded, not swallowed: the section says failed, with the error
        return {"status": "failed", "error": f"{type(err).__name__}: {err}",
                "where": traceback.format_exc(limit=3).splitlines()[-3:]}


# ---------------------------------------------------------------- sections

def devices() -> dict:
    if not torch.cuda.is_available():
        return {"status": "ok", "cuda": False, "devices": [], "note": "no CUDA device: the CPU is the compute device",
                "cpu_cores": psutil.cpu_count(logical=False), "cpu_threads": psutil.cpu_count(),
                "cpu": cpu_bf16.cpu_info().get("model name"), "cpu_bf16": cpu_bf16.native_bf16()}
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        props = torch.cuda.get_device_properties(i)
        card = find_gpu(props.name)
        out.append({"index": i, "name": props.name, "free_bytes": int(free), "total_bytes": int(total),
                    "capability": f"{props.major}.{props.minor}", "card": card.key if card else None})
    return {"cuda": True, "cuda_version": torch.version.cuda, "devices": out}


def host() -> dict:
    from offspec.plan.machine import PINNED_FRACTION, _cgroup_available, host_memory_limit
    vm = psutil.virtual_memory()
    usable, source = host_memory_limit()
    return {"mem_total_bytes": vm.total, "mem_available_bytes": vm.available,
            "cgroup_available_bytes": _cgroup_available(), "usable_bytes": usable, "usable_source": source,
            "default_pinned_budget_bytes": int(PINNED_FRACTION * usable)}


def pinning(device: torch.device, quick: bool) -> dict:
    """The largest exactly-sized host buffer that cudaHostRegister accepts, halving from the default pinned
    budget (the arena's own path: transfer.CudaBackend.host_buffer). Each try maps, pins, unpins and unmaps."""
    if device.type != "cuda":
        return {"status": "skipped", "why": "no CUDA device: nothing is pinned on a CPU-only run"}
    from offspec.plan.machine import PINNED_FRACTION, host_memory_limit
    backend = make_backend(device)
    try:
        size = int(PINNED_FRACTION * host_memory_limit()[0]) // PAGE_BYTES * PAGE_BYTES
        if quick:
            size = min(size, 8 << 30)
        tried = []
        while size >= MIN_PIN_BYTES:
            start = time.perf_counter()
            buffer = backend.host_buffer(size)
            pinned, reason = buffer.pinned, buffer.reason
            buffer.close()
            tried.append({"bytes": size, "pinned": pinned, "seconds": time.perf_counter() - start,
                          **({"why_not": reason} if not pinned else {})})
            if pinned:
                return {"largest_pinned_bytes": size, "tries": tried}
            size //= 2
        return {"largest_pinned_bytes": 0, "tries": tried, "note": "nothing could be pinned: copies will be pageable"}
    finally:
        backend.close()


def time_copies(backend, dst: torch.Tensor, src: torch.Tensor, src_pinned: bool, repeats: int) -> dict:
    """`repeats` copies src -> dst on the backend's copy queue after one warm-up: median GB/s by the backend's
    timing events (CUDA: device time between two events recorded on copy_s around the copy) and by the host
    clock (issue to completion)."""
    device_s, host_s = [], []
    for i in range(repeats + 1):
        start, end = backend.new_event(timing=True), backend.new_event(timing=True)
        t0 = time.perf_counter()
        start.record(backend.copy_queue)
        backend.copy_async(dst, src, src_pinned=src_pinned)
        end.record(backend.copy_queue)
        end.synchronize()
        if i:
            device_s.append(start.elapsed_s(end))
            host_s.append(time.perf_counter() - t0)
    n = src.numel() * src.element_size()
    return {"gbps": n / max(statistics.median(device_s), 1e-9) / 1e9,
            "host_gbps": n / max(statistics.median(host_s), 1e-9) / 1e9}


def measure_bandwidth(device: torch.device, sizes: list[int], repeats: int) -> list[dict]:
    """For each size: copy into a device buffer from offspec's pinned HostBuffer and from a pageable tensor,
    through the streamer's own transfer backend. On a CPU both are the copy worker's memcpy."""
    backend = make_backend(device)
    rows = []
    try:
        for nbytes in sizes:
            dst = backend.device_buffer(nbytes)
            t0 = time.perf_counter()
            pinned = backend.host_buffer(nbytes)          # exactly nbytes, pinned when the backend can
            pin_s = time.perf_counter() - t0
            try:
                pageable = torch.empty(nbytes, dtype=torch.uint8)
                pinned.tensor.fill_(1)                    # touch every page: no first-touch faults in the timing
                pageable.fill_(1)
                row = {"bytes": nbytes, "pinned": pinned.pinned, "pin_seconds": pin_s}
                if not pinned.pinned:
                    row["not_pinned_because"] = pinned.reason
                row.update({f"pinned_{k}": v for k, v in
                            time_copies(backend, dst, pinned.tensor, pinned.pinned, repeats).items()})
                row.update({f"pageable_{k}": v for k, v in
                            time_copies(backend, dst, pageable, False, repeats).items()})
            finally:
                pinned.close()
            rows.append(row)
            del dst
    finally:
        backend.close()
    return rows


def link(device: torch.device, quick: bool) -> dict:
    """Copy rates into the device through the streamer's own backend: from pinned and from pageable host
    memory on CUDA; on a CPU the copy worker's memcpy (the "transfer" of a CPU run)."""
    row = measure_bandwidth(device, [(64 << 20) if quick else PROBE_BYTES], repeats=3)[0]
    out = {"bytes_per_copy": row["bytes"], "pageable_gbps": row["pageable_gbps"]}
    if device.type == "cuda":
        out["pinned_gbps"] = row["pinned_gbps"] if row["pinned"] else None
        if not row["pinned"]:
            out["pinned_note"] = row["not_pinned_because"]
    else:
        out["note"] = "CPU: host memory is the device; this is the copy worker's memcpy rate"
    return out


def drive(store_dir: Optional[str], target, quick: bool) -> dict:
    """Cold read rate of the drive holding the stores: the target's packed store read as the streamer reads it
    (DiskStore: O_DIRECT where allowed, several reads in flight) when it exists; else a temporary file written
    there and read back front to back, buffered and with O_DIRECT."""
    from offspec.formats.demo import offspec_home
    from offspec.stream.disk import drop_page_cache, sequential_read
    folder = Path(store_dir) if store_dir else offspec_home() / "stores"
    folder.mkdir(parents=True, exist_ok=True)
    out: dict = {"folder": str(folder)}
    store = _target_store(target) if target is not None and not store_dir else None
    if store is not None:
        out.update(_read_store(*store))
        out["disk_io"] = "direct" if out["direct_gbps"] >= out["buffered_gbps"] else "buffered"
        return out
    nbytes = (256 << 20) if quick else DRIVE_PROBE_BYTES
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".offspec-doctor-", suffix=".bin") as f:
        chunk = os.urandom(1 << 20) * (READ_BYTES >> 20)
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
        buffer = memoryview(HostBuffer.map(READ_BYTES))               # page-aligned, as O_DIRECT needs
        out["file_bytes"] = nbytes
        for name, direct in (("buffered", False), ("direct", True)):
            drop_page_cache(f.name)
            start = time.perf_counter()
            try:
                sequential_read(f.name, [buffer], direct=direct, drop_behind=not direct)
            except OSError as err:
                out[f"{name}_gbps"] = None
                out[f"{name}_note"] = f"refused: {err.strerror}"
                continue
            out[f"{name}_gbps"] = nbytes / (time.perf_counter() - start) / 1e9
    rates = {name: out.get(f"{name}_gbps") for name in ("direct", "buffered") if out.get(f"{name}_gbps")}
    out["read_gbps"] = max(rates.values()) if rates else None
    out["disk_io"] = max(rates, key=rates.get) if rates else "buffered"   # the faster way to read this drive
    return out


def _target_store(ckpt):
    """(store folder, checkpoint) of the target's default bf16 disk store, if it has been built (a target whose
    weights are not all here has none)."""
    from offspec.engine.load import store_dir_for
    from offspec.formats.demo import offspec_home
    from offspec.stream.disk import disk_store_exists
    if ckpt.incomplete:
        return None
    folder = store_dir_for(ckpt, torch.bfloat16, offspec_home())
    return (str(folder), ckpt) if disk_store_exists(str(folder)) else None


def _read_store(folder: str, ckpt) -> dict:
    """The target's store read cold, every layer, as the streamer reads it: once with O_DIRECT (where the
    filesystem allows it) and once buffered with each range dropped behind (--disk-io direct / buffered)."""
    from offspec.formats.layout import LayerLayout
    from offspec.stream.disk import LAYERS_BIN, DiskStore, drop_page_cache
    layout = LayerLayout.of(ckpt.config, torch.bfloat16)
    out = {"store": folder, "note": "the target's packed store, read cold as the streamer reads it"}
    for name, direct in (("direct", True), ("buffered", False)):
        backend = make_backend(torch.device("cpu"))
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(backend.close)
            store = DiskStore(folder, layout, ckpt.config.n_layers, backend, source_id=ckpt.fingerprint(),
                              direct_io=direct)
            cleanup.callback(store.close)
            drop_page_cache(os.path.join(folder, LAYERS_BIN))
            start = time.perf_counter()
            for layer in range(ckpt.config.n_layers):
                store.acquire(layer)
            out[f"{name}_gbps"] = store.file_size / (time.perf_counter() - start) / 1e9
            out[f"{name}_io"] = store.io
            out["file_bytes"] = store.file_size
    out["read_gbps"] = max(out["direct_gbps"], out["buffered_gbps"])
    return out


def advice(target, draft, device: torch.device, report: dict) -> dict:
    """The memory plan for the target on this machine, the predicted pass time from the measured rates, and
    the flags to run with. The tree budget: on a GPU streaming the target, a pass costs its transfer time
    almost whatever it computes, so the largest tree whose verification compute stays under that time
    (from a measured matmul rate) is free; on a compute-bound run, `auto` measures it."""
    from offspec.config import OffloadConfig, RunLimits, RuntimeConfig
    from offspec.plan.costmodel import LINK_GB_PER_S as LINK_GBPS
    from offspec.plan.costmodel import PAGEABLE_GB_PER_S
    from offspec.plan.machine import Machine
    from offspec.plan.passtime import predicted_pass_seconds
    from offspec.plan.search import make_plan
    from offspec.plan.sizes import ModelSpec

    runtime = RuntimeConfig(device=device, dtype=torch.bfloat16, draft_quant="int8" if device.type == "cpu" else "none")
    plan = make_plan(ModelSpec.of(target), ModelSpec.of(draft) if draft else None, OffloadConfig(mode="auto"), runtime,
                     RunLimits(context=4096), Machine.measure(device))
    link_gbps = report.get("link", {}).get("pinned_gbps")
    pageable_gbps = report.get("link", {}).get("pageable_gbps") or PAGEABLE_GB_PER_S
    disk_gbps = report.get("drive", {}).get("read_gbps")
    out = {"plan": plan.to_dict(), "plan_text": plan.describe()}
    flags = [f"--offload {plan.mode}"]
    if plan.placement.disk_layers and report.get("drive", {}).get("disk_io"):
        flags.append(f"--disk-io {report['drive']['disk_io']}")
    if plan.placement.streamed:
        card = find_gpu(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        pass_s = predicted_pass_seconds(plan, link_gbps or LINK_GBPS, disk_gbps, pageable_gbps, card=card)
        out["predicted_pass_seconds"] = pass_s
        out["prediction_inputs"] = {"link_gbps": link_gbps, "pageable_gbps": pageable_gbps, "disk_gbps": disk_gbps,
                                    "streamed_bytes": plan.streamed_bytes}
        if device.type == "cuda":
            flags.append(f"--gpu-budget {int(plan.placement.device_bytes / 1e8) / 10:g}GB")
        from offspec.formats.layout import LAYER_PARTS
        p = plan.placement           # --slots counts layers: a split ring's slots hold parts of them
        flags.append(f"--slots {-(-p.n_slots // len(LAYER_PARTS)) if p.split else p.n_slots}")
        flops = matmul_flops(device)
        params = plan.streamed_bytes / runtime.dtype.itemsize
        free_tokens = int(pass_s * flops / (2 * params))            # tokens whose compute hides under the transfer
        budget = 1 << max(4, min(free_tokens, plan.tree_budget).bit_length() - 1)
        out["matmul_tflops"] = flops / 1e12
        out["tree_budget_reasoning"] = (f"a pass streams {format_bytes(plan.streamed_bytes)} in ≈{pass_s:.2f} s "
                                        f"(predicted); at {flops / 1e12:.1f} TFLOP/s verifying ≈{free_tokens} tokens "
                                        f"costs no more than that; capped by the plan at {plan.tree_budget}")
        flags.append(f"--tree-budget {budget}" if device.type == "cuda" else "--tree-budget auto")
    else:
        flags.append("--tree-budget auto")
        out["tree_budget_reasoning"] = "nothing streams: a pass is compute-bound, and auto sizes trees from measured times"
    out["recommended_flags"] = " ".join(flags)
    if device.type == "cuda":     # on a CPU a pass is compute: link and drive rates rank nothing
        from offspec.plan.options import compare
        out["options"] = compare(ModelSpec.of(target), ModelSpec.of(draft) if draft else None, OffloadConfig(mode="auto"),
                                 runtime, RunLimits(context=4096), plan.machine,
                                 link_gbps or LINK_GBPS,
                                 disk_gbps or 3.0).table()
    return out


def matmul_flops(device: torch.device) -> float:
    """A bf16 (2048 x 2048) @ (2048 x 2048) rate: the order of magnitude of verification compute."""
    n = 2048
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    reps = 20 if device.type == "cuda" else 3
    a @ b
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


def summary(report: dict) -> str:
    """The report for people: a few lines a section."""
    lines = []
    d = report["devices"]
    if d.get("status") == "ok":
        if d.get("cuda"):
            for dev in d["devices"]:
                lines.append(f"device {dev['index']}: {dev['name']} (sm {dev['capability']}), "
                             f"{format_bytes(dev['free_bytes'])} free of {format_bytes(dev['total_bytes'])}; "
                             + (f"`models info` predicts for it as {dev['card']}" if dev.get("card") else
                                f"not in offspec's card table: `models info --gpu` names the nearest "
                                f"({gpu_keys()})"))
        else:
            bf16 = ("with bfloat16 instructions" if d.get("cpu_bf16") else
                    "without bfloat16 instructions: in bf16, prompts and trees are computed in float32")
            lines.append(f"device: none (CPU only, {d['cpu_cores']} cores / {d['cpu_threads']} threads): "
                         f"the CPU is the compute device; {d.get('cpu') or 'the CPU'} {bf16}")
    for name in ("host", "pinning", "link", "drive"):
        s = report[name]
        if s.get("status") != "ok":
            lines.append(f"{name}: {s.get('status')}: {s.get('why') or s.get('error')}")
            continue
        if name == "host":
            cg = s["cgroup_available_bytes"]
            lines.append(f"host: {format_bytes(s['mem_available_bytes'])} available of {format_bytes(s['mem_total_bytes'])}"
                         f"; cgroup {'no limit' if cg is None else format_bytes(cg) + ' left'}; a run may use "
                         f"{format_bytes(s['usable_bytes'])} ({s['usable_source']}), pin up to "
                         f"{format_bytes(s['default_pinned_budget_bytes'])} by default")
        elif name == "pinning":
            lines.append(f"pinning: the largest pinned buffer that succeeded: {format_bytes(s['largest_pinned_bytes'])}")
        elif name == "link":
            rates = ", ".join(f"{k.removesuffix('_gbps')} {v:.1f} GB/s" for k, v in s.items()
                              if k.endswith("_gbps") and v is not None)
            lines.append(f"link: host -> device {rates}" + (f" ({s['note']})" if s.get("note") else ""))
        elif name == "drive":
            rates = ", ".join(f"{k.removesuffix('_gbps')} {v:.2f} GB/s" for k, v in s.items()
                              if k.endswith("_gbps") and v is not None and k != "read_gbps")
            what = "the target's store as the streamer reads it" if s.get("store") else "a temporary file"
            lines.append(f"drive ({s['folder']}): cold read of {what}: {rates}; faster: --disk-io {s['disk_io']}"
                         if s.get("read_gbps") else f"drive ({s['folder']}): no read rate ({rates})")
    a = report["advice"]
    if a.get("status") == "ok":
        lines.append(a["plan_text"])
        if "predicted_pass_seconds" in a:
            lines.append(f"PREDICTED pass: {a['predicted_pass_seconds']:.3f} s")
        lines.append(f"tree budget: {a['tree_budget_reasoning']}")
        if a.get("options"):
            lines.append(a["options"])
        lines.append(f"recommended: offspec generate --target {report.get('target')} "
                     + (f"--draft {report.get('draft')} " if report.get("draft") else "") + a["recommended_flags"])
    else:
        lines.append(f"advice: {a.get('status')}: {a.get('why') or a.get('error')}")
    return "\n".join(lines)


@click.command()
@click.option("--target", type=click.Path(), default=None,
              help="Target model folder (or hub id) to plan and advise for. Default: the embedded demo target when "
                   "it is prepared (`offspec models demo`), else none.")
@click.option("--draft", type=click.Path(), default=None,
              help="Draft model folder. Default: the demo draft with the demo target, else none.")
@click.option("--device", default=default_device, show_default="cuda if available, else cpu",
              help="Compute device to check.")
@click.option("--store-dir", default=None,
              help="Folder whose drive is measured. Default: the target's packed store if built, else "
                   "$OFFSPEC_HOME/stores.")
@click.option("--quick", is_flag=True, help="Smaller probes: seconds rather than a minute.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the full report to this JSON file. Default: none.")
def doctor(target, draft, device, store_dir, quick, json_path):
    """Check this machine for offspec: devices and free memory, host memory and its cgroup limit, the largest
    pinned buffer, host-to-device bandwidth (pinned and pageable), the cold read rate of the store's drive, and
    the flags to run a target with (from the memory plan and the measured rates)."""
    from offspec.engine.load import parse_device
    from offspec.formats.demo import DEFAULT_DRAFT, DEFAULT_TARGET, demo_model_dir, is_complete

    if json_path:
        check_writable(json_path)
    dev = parse_device(device)
    if target is None and is_complete(demo_model_dir(DEFAULT_TARGET)):
        target = str(demo_model_dir(DEFAULT_TARGET))
        if draft is None and is_complete(demo_model_dir(DEFAULT_DRAFT)):
            draft = str(demo_model_dir(DEFAULT_DRAFT))
    try:                           # a hub id: planned from its headers, no weights fetched
        checkpoints, unreadable = [headers_checkpoint(m) if m else None for m in (target, draft)], None
    except OffspecError as err:    # the machine's checks still run; the advice says why there is none
        checkpoints, unreadable = [None, None], str(err)
    report = check(*checkpoints, dev, store_dir, quick, progress=lambda line: click.echo(line, err=True))
    if unreadable:
        report["advice"] = {"status": "failed", "error": unreadable}
    report.update(target=target, draft=draft)
    save_rates(report)                  # `models info` predicts with this machine's measured link and drive
    click.echo(summary(report))
    if json_path:
        write_report(json_path, report, target, draft)
    failed = [name for name, section in report.items()
              if isinstance(section, dict) and section.get("status") == "failed"]
    if failed:
        click.echo(f"offspec: doctor: {', '.join(failed)} failed (details in the report)", err=True)
        sys.exit(1)
