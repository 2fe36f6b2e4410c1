#!/usr/bin/env python3
"""Summarises a titan profiler trace (rank{R}_trace.json, Chrome trace format) by GPU kernel.

Prints the traced steps' GPU time (the span from the first kernel's start to the last one's end), the busy time (the
kernels' summed durations), and the kernels grouped by name (largest total first) with their count, total and share.
Kernel names are shortened: namespaces and parameter lists are dropped, template arguments (the functor of an
elementwise kernel) kept.

Usage: bench/trace_kernels.py TRACE.json [--top N] [--label TEXT]
"""
import argparse
import collections
import json
import re
import sys


def short_name(name):
    # The kernel without namespaces, "void" or its parameter list, its template arguments kept (they name the
    # functor of an elementwise kernel): "vectorized_elementwise_kernel<4, AbsFunctor<BFloat16>, ...>".
    text = re.sub(r"\(anonymous namespace\)::", "", name)
    text = re.sub(r"\b\w+::", "", text)
    text = re.sub(r"^void\s+", "", text).strip()
    if text.endswith(")"):
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(text[i], 0)
            if depth == 0:
                text = text[:i].rstrip() or text
                break
    return text[:110]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    try:
        with open(args.trace, encoding="utf-8") as f:
            events = json.load(f).get("traceEvents", [])
    except (OSError, ValueError) as error:
        sys.exit(f"trace_kernels: cannot read {args.trace}: {error}")
    kernels = [e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        sys.exit(f"trace_kernels: {args.trace} holds no GPU kernels (a CPU run, or CUPTI was not available)")
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in kernels)
    busy = sum(float(e.get("dur", 0)) for e in kernels)
    groups = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        key = short_name(e.get("name", "?"))
        groups[key][0] += 1
        groups[key][1] += float(e.get("dur", 0))
    label = f"{args.label}: " if args.label else ""
    print(f"{label}{len(kernels)} GPU operations over {(end - start) / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms "
          f"({100 * busy / max(end - start, 1e-9):.1f}%)")
    for name, (count, total) in sorted(groups.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {total / 1e3:9.3f} ms {100 * total / busy:5.1f}%  x{count:<5d} {name}")


if __name__ == "__main__":
    main()
