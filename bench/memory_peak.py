"""What is allocated at a training step's peak of GPU memory, by the line of code that allocated it.

`torch.cuda.max_memory_allocated` says how high a step goes, not what takes the room. This records every allocation
of one step (PyTorch's allocator history, with the Python stack of each), replays them in order to find the moment
the step held the most, and sums what was alive then by the first frame in the code under study (the project's
trainer, or SpecForge's model), so that a table says which tensors to keep less of:

    with recorded_allocations(device) as recording:
        step()
    breakdown = peak_breakdown(recording.trace, origins=("services/trainer/",))

Memory allocated before the recording started (weights, gradients and optimizer state between steps) is not in the
trace: the breakdown is of what the step itself adds at its peak, `resident` of what it found.
"""

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

HISTORY_ENTRIES = 1_000_000  # a TTT step at 8B dims makes tens of thousands of allocations
TOP_ORIGINS = 12


@dataclass
class Recording:
    resident_bytes: int = 0
    trace: list[dict[str, Any]] = field(default_factory=list)


@contextmanager
def recorded_allocations(device: torch.device) -> Iterator[Recording]:
    """The allocator's events (alloc / free, with Python stacks) of the block, for `peak_breakdown`."""
    recording = Recording()
    torch.cuda.synchronize(device)
    recording.resident_bytes = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=HISTORY_ENTRIES)
    try:
        yield recording
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot.get("device_traces", [])
    index = device.index if device.index is not None else torch.cuda.current_device()
    recording.trace = list(traces[index]) if index < len(traces) else []


def peak_breakdown(trace: Sequence[dict[str, Any]], *, origins: Sequence[str], top: int = TOP_ORIGINS) -> dict:
    """Replay `trace` (alloc and free_completed events, in order) to the moment the most bytes were alive, and group
    what was alive then by its origin: the first stack frame whose file contains one of `origins` (else the first
    frame outside torch), as "file:line function"."""
    alive: dict[int, tuple[int, str]] = {}  # address -> (bytes, origin)
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, address, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            alive[address] = (size, _origin(event.get("frames", []), origins))
            total += size
            if total > peak:
                peak, at_peak = total, dict(alive)
        elif action == "free_completed" and address in alive:
            total -= alive.pop(address)[0]
    by_origin: dict[str, int] = defaultdict(int)
    for size, origin in at_peak.values():
        by_origin[origin] += size
    ranked = sorted(by_origin.items(), key=lambda item: -item[1])
    return {
        "peak_bytes": peak,
        "tensors_at_peak": len(at_peak),
        "by_origin": [{"origin": origin, "bytes": size} for origin, size in ranked[:top]],
        "other_bytes": sum(size for _, size in ranked[top:]),
    }


def _origin(frames: Sequence[dict[str, Any]], origins: Sequence[str]) -> str:
    def name(frame: dict[str, Any]) -> str:
        path = str(frame.get("filename", "?"))
        short = path.split("site-packages/")[-1] if "site-packages/" in path else path
        for origin in origins:
            if origin in path:
                short = origin + path.split(origin, 1)[1]
        return f"{short}:{frame.get('line', '?')} {frame.get('name', '?')}"

    for frame in frames:
        if any(origin in str(frame.get("filename", "")) for origin in origins):
            return name(frame)
    for frame in frames:
        if "/torch/" not in str(frame.get("filename", "/torch/")):
            return name(frame)
    return "(no Python frame)"


def format_breakdown(title: str, resident_bytes: int, breakdown: dict) -> str:
    gib = 2**30
    lines = [
        f"{title}: {resident_bytes / gib:.2f} GiB resident before the step, {breakdown['peak_bytes'] / gib:.2f} GiB "
        f"more at its peak ({breakdown['tensors_at_peak']} tensors), by where they were allocated:"
    ]
    lines += [f"  {row['bytes'] / gib:7.3f} GiB  {row['origin']}" for row in breakdown["by_origin"]]
    lines.append(f"  {breakdown['other_bytes'] / gib:7.3f} GiB  everything else")
    return "\n".join(lines)
