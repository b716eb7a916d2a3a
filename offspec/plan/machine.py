"""The machine a plan is made for: its device and host memory, read from this one (cgroups included) or given."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
import torch

GB = 10**9
GIB = 2**30
PINNED_FRACTION = 0.8           # default pinned budget: this share of the host memory the run may use
CUDA_RESERVE_MIN = 512 << 20    # allocator fragmentation, cuBLAS / attention workspaces, CUDA graphs: at least
CUDA_RESERVE_FRACTION = 0.04    # ... or this share of the device, whichever is larger
RUNTIME_HOST_BYTES = 1 << 30    # the process itself: Python, torch, tokenizer, page tables


@dataclass(frozen=True)
class Machine:
    kind: str                  # "cuda" | "cpu": a CPU device shares one pool with the host
    device_bytes: int          # device memory the run may use (free memory now, or as given)
    host_bytes: int            # host memory the run may use: min(MemAvailable, cgroup limit - usage), or as given
    host_source: str           # where host_bytes comes from, for messages
    name: str = ""             # the device, for reports

    @staticmethod
    def measure(device: torch.device) -> "Machine":
        """This machine now. On CUDA, the device's free memory (call before allocating anything)."""
        host, source = host_memory_limit()
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return Machine("cuda", int(free), host, source, torch.cuda.get_device_name(device))
        return Machine("cpu", host, host, source, "cpu")

    @staticmethod
    def given(device_bytes: Optional[int], host_bytes: Optional[int]) -> "Machine":
        """A machine described by the user (`models info --device-memory 24GB --host-memory 64GB`); a size
        not given is this machine's. A device size means a GPU of that size."""
        host, source = (host_bytes, "given") if host_bytes is not None else host_memory_limit()
        if device_bytes is None:
            return Machine("cpu", host, host, source, "cpu (this machine)")
        return Machine("cuda", device_bytes, host, source, f"a {device_bytes / GB:.0f} GB GPU")


def host_memory_limit() -> tuple[int, str]:
    """-> (bytes of host memory a run may use, what bounds it): MemAvailable, or less when this process's
    cgroup (v2 memory.max, v1 memory.limit_in_bytes) leaves less. MemAvailable is host-wide: in a container
    only the cgroup knows that the process would be killed long before."""
    available = psutil.virtual_memory().available
    cgroup = _cgroup_available()
    if cgroup is not None and cgroup < available:
        return cgroup, "cgroup memory limit"
    return available, "MemAvailable"


def _cgroup_available() -> Optional[int]:
    """limit - (usage - inactive file pages) of this process's memory cgroup, None when unlimited/unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":                                   # v2: 0::/path
            base, names = Path("/sys/fs/cgroup"), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):                # v1: N:memory:/path
            base, names = Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                               "total_inactive_file")
        else:
            continue
        # Inside a container the cgroup's own folder is usually mounted as the root: try it, then the root.
        for folder in (base / path.lstrip("/"), base):
            limit_file = folder / names[0]
            if not limit_file.is_file():
                continue
            try:
                text = limit_file.read_text().strip()
                if text == "max" or int(text) >= 1 << 60:
                    return None
                usage = int((folder / names[1]).read_text())
                stat = dict(l.split() for l in (folder / "memory.stat").read_text().splitlines() if " " in l)
                reclaimable = int(stat.get(names[2], 0))
                return max(0, int(text) - (usage - reclaimable))
            except (OSError, ValueError):
                return None
    return None

