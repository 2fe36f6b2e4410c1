#!/usr/bin/env python3
"""Where a CUDA memory snapshot's peak came from: titan's rank{R}_memory_snapshot.pickle (profiling.
enable_memory_snapshot; the format of torch.cuda.memory._dump_snapshot), read with the standard library.

Replays the allocator's recorded history (allocations and completed frees) from what was already allocated when the
history began (the blocks active at the snapshot, less the history's net change), and prints the peak of allocated
bytes, when it came, and the blocks live at that moment grouped by the innermost titan frame of their stack (or by
the first frame, or by size where the history has no stacks), largest first.

Usage: bench/memory_snapshot_peak.py SNAPSHOT.pickle [--top N]
"""
import argparse
import collections
import pickle
import sys

GIB = 1024.0 ** 3


def frame_label(frames):
    """The innermost frame of titan's own code, else the first named frame, else an empty string."""
    names = [f"{f.get('name', '?')} ({f.get('filename', '?')}:{f.get('line', '?')})" for f in frames or []]
    for f, label in zip(frames or [], names):
        if "titan" in str(f.get("name", "")) or "titan" in str(f.get("filename", "")):
            return label[:150]
    return names[0][:150] if names else ""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    try:
        with open(args.snapshot, "rb") as f:
            snapshot = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as error:
        sys.exit(f"memory_snapshot_peak: cannot read {args.snapshot}: {error}")
    segments = snapshot.get("segments", [])
    traces = snapshot.get("device_traces", [])
    trace = max(traces, key=len) if traces else []
    if not trace:
        sys.exit(f"memory_snapshot_peak: {args.snapshot} holds no allocator history (device_traces is empty)")
    active_now = sum(b.get("size", 0) for s in segments for b in s.get("blocks", []) if str(b.get("state", "")).startswith("active"))
    reserved_now = sum(s.get("total_size", 0) for s in segments)
    live = {}  # address -> (size, label)
    net = 0
    for event in trace:
        action, addr, size = event.get("action"), event.get("addr"), event.get("size", 0)
        if action == "alloc":
            net += size
        elif action == "free_completed":
            net -= size
    baseline = active_now - net
    total = peak = baseline
    peak_index, peak_live = -1, {}
    for index, event in enumerate(trace):
        action, addr, size = event.get("action"), event.get("addr"), event.get("size", 0)
        if action == "alloc":
            live[addr] = (size, frame_label(event.get("frames")) or f"{size / 2**20:.1f} MiB blocks")
            total += size
            if total > peak:
                peak, peak_index, peak_live = total, index, dict(live)
        elif action == "free_completed":
            total -= size
            live.pop(addr, None)
    groups = collections.defaultdict(lambda: [0, 0])
    for size, label in peak_live.values():
        groups[label][0] += 1
        groups[label][1] += size
    print(f"{len(trace)} history events; at the snapshot {active_now / GIB:.2f} GiB allocated, {reserved_now / GIB:.2f} GiB "
          f"reserved; peak {peak / GIB:.2f} GiB allocated at event {peak_index} "
          f"({baseline / GIB:.2f} GiB from before the history began)")
    for label, (count, size) in sorted(groups.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {size / GIB:8.3f} GiB  x{count:<6d} {label}")


if __name__ == "__main__":
    main()
