"""Checks and figures from `titan train` logs and titan_gpu_tests' XML, for scripts/test_gpu.sh (stdlib only).

Every subcommand prints "PASS <name>: <detail>" or "FAIL <name>: <detail>" lines and "[figure] <name> = <value>"
lines, and exits 1 when a check failed. Speeds are printed as figures, never checked.
"""
import argparse
import math
import re
import statistics
import sys
import xml.etree.ElementTree as ElementTree

STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<mem_gib>[\d.]+)GiB\((?P<mem_pct>[\d.]+)%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+)%")
ESTIMATE = re.compile(r"Memory estimate for this rank: .*: (?P<value>[\d.]+) (?P<unit>GiB|MiB) of [\d.]+ GiB available")
CAPACITY = re.compile(r"(?:CUDA capacity: (?P<name>.*) with|CPU memory:) (?P<gib>[\d.]+)GiB")
START = re.compile(r"Training starts at step (\d+)")

failed = False


def result(ok, name, detail):
    global failed
    failed |= not ok
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")


def figure(name, value):
    if isinstance(value, float):
        value = f"{value:.6g}"
    print(f"[figure] {name} = {value}")


def steps_of(path):
    """The step lines of a log, in order, as dicts of numbers."""
    out = []
    with open(path, errors="replace") as log:
        for line in log:
            m = STEP.search(line)
            if m:
                d = {k: float(v.replace(",", "")) for k, v in m.groupdict().items()}
                d["step"] = int(d["step"])
                out.append(d)
    return out


def text_of(path):
    with open(path, errors="replace") as log:
        return log.read()


def check_device(args):
    text = text_of(args.log)
    want = "CPU memory:" if args.cpu else "CUDA capacity:"
    m = CAPACITY.search(text)
    ok = want in text and m is not None
    result(ok, args.name, f"start-up line says {m.group(0) if m else 'nothing about the device'!r}")
    if m and m.group("name"):
        figure("gpu.name_in_log", m.group("name"))


def check_loss_falls(args):
    steps = steps_of(args.log)
    if len(steps) < 2:
        return result(False, args.name, f"{len(steps)} step lines in {args.log}")
    losses = [s["loss"] for s in steps]
    finite = all(math.isfinite(v) for v in losses)
    drop = losses[0] - losses[-1]
    result(finite and drop >= args.min_drop, args.name,
           f"loss {losses[0]:.4f} at step {steps[0]['step']} -> {losses[-1]:.4f} at step {steps[-1]['step']} "
           f"(drop {drop:.3f}, required >= {args.min_drop}; all finite: {finite})")
    figure(f"{args.name}.loss_first", losses[0])
    figure(f"{args.name}.loss_last", losses[-1])


def check_memory(args):
    steps = steps_of(args.log)
    m = CAPACITY.search(text_of(args.log))
    if not steps or not m:
        return result(False, args.name, f"{len(steps)} step lines, capacity line {'found' if m else 'missing'}")
    capacity = float(m.group("gib"))
    bad = [s for s in steps if not (0 < s["mem_gib"] < capacity and 0 < s["mem_pct"] < 100)]
    peak = max(s["mem_gib"] for s in steps)
    result(not bad, args.name,
           f"memory field of {len(steps)} step lines in (0, {capacity:.2f}) GiB and (0, 100)%; peak {peak:.2f} GiB"
           + (f"; out of range at steps {[s['step'] for s in bad]}" if bad else ""))
    figure(f"{args.name}.peak_gib", peak)
    figure(f"{args.name}.capacity_gib", capacity)
    # The trainer's start-up estimate against the allocator's reserved peak (docs/plan.md, "Validation against titan
    # itself"): a figure, not a check.
    estimate = ESTIMATE.search(text_of(args.log))
    if estimate:
        gib = float(estimate.group("value")) / (1024 if estimate.group("unit") == "MiB" else 1)
        figure(f"{args.name}.startup_estimate_gib", f"{gib:.2f} ({gib / peak:.2f}x the peak)")


def check_resume(args):
    full, resumed = steps_of(args.full), steps_of(args.resumed)
    starts = START.findall(text_of(args.resumed))
    if not starts or int(starts[0]) != args.first:
        return result(False, args.name, f"the resumed run starts at step {starts[0] if starts else '?'}, expected {args.first}")
    reference = {s["step"]: s["loss"] for s in full}
    pairs = [(s["step"], s["loss"], reference.get(s["step"])) for s in resumed]
    missing = [step for step, _, ref in pairs if ref is None]
    if missing or not pairs:
        return result(False, args.name, f"steps {missing} of the resumed run are not in the uninterrupted log")
    worst = max(abs(loss - ref) / abs(ref) for _, loss, ref in pairs)
    bitwise = all(loss == ref for _, loss, ref in pairs)
    result(worst <= args.rtol, args.name,
           f"steps {pairs[0][0]}-{pairs[-1][0]} after resuming from step {args.first - 1}: losses within {worst:.2e} "
           f"(relative, allowed {args.rtol:g}) of the uninterrupted run; printed losses identical: {bitwise}")
    figure(f"{args.name}.loss_max_rel_diff", worst)
    figure(f"{args.name}.printed_losses_identical", "yes" if bitwise else "no")


def figures_throughput(args):
    steps = [s for s in steps_of(args.log) if s["step"] > args.skip]
    if not steps:
        return result(False, args.name, f"no step lines after step {args.skip} in {args.log}")
    for key in ("tps", "tflops", "mfu", "mem_gib"):
        figure(f"{args.name}.{key}_median", statistics.median(s[key] for s in steps))
    figure(f"{args.name}.last_windows", ", ".join(
        f"step {s['step']}: {s['tps']:,.0f} tok/s, {s['mfu']:.2f}% MFU" for s in steps[-6:]))
    result(all(math.isfinite(s["loss"]) for s in steps), args.name,
           f"{len(steps)} logging windows after step {args.skip} (figures only; speed is never checked)")


def gtest_results(args):
    """One line per test case of a GoogleTest XML report: PASS, FAIL (with the first message) or SKIP."""
    try:
        root = ElementTree.parse(args.xml).getroot()
    except (OSError, ElementTree.ParseError) as error:
        return result(False, args.name, f"no readable XML report ({error})")
    for case in root.iter("testcase"):
        name = f"gtest.{case.get('classname')}.{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped") is not None or case.get("result") == "skipped"
        if failure is not None:
            message = (failure.get("message") or failure.text or "").strip().splitlines()
            result(False, name, " | ".join(message[:3])[:400])
        elif skipped:
            node = case.find("skipped")
            reason = ((node.get("message") or node.text or "") if node is not None else "").strip().splitlines()
            reason = reason[-1] if reason else ""
            if "compute capability" in reason:
                # The binary saw the GPU and found a feature it lacks (MXFP8 before Blackwell): not applicable here.
                print(f"N/A {name}: {reason[:300]}")
            elif args.skip_is_failure:
                result(False, name, "skipped on a machine with a GPU: the binary does not see it (see the log)")
            else:
                print(f"SKIP {name}: skipped (see the log for the reason)")
        else:
            print(f"PASS {name}: {float(case.get('time', 0)):.1f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("device"); p.add_argument("log"); p.add_argument("--name", required=True)
    p.add_argument("--cpu", action="store_true", help="expect the CPU (dry run)"); p.set_defaults(run=check_device)
    p = sub.add_parser("loss-falls"); p.add_argument("log"); p.add_argument("--name", required=True)
    p.add_argument("--min-drop", type=float, required=True); p.set_defaults(run=check_loss_falls)
    p = sub.add_parser("memory"); p.add_argument("log"); p.add_argument("--name", required=True)
    p.set_defaults(run=check_memory)
    p = sub.add_parser("resume"); p.add_argument("full"); p.add_argument("resumed"); p.add_argument("--name", required=True)
    p.add_argument("--first", type=int, required=True, help="the first step the resumed run trains")
    p.add_argument("--rtol", type=float, required=True); p.set_defaults(run=check_resume)
    p = sub.add_parser("throughput"); p.add_argument("log"); p.add_argument("--name", required=True)
    p.add_argument("--skip", type=int, default=5, help="ignore windows ending at or before this step (warm-up)")
    p.set_defaults(run=figures_throughput)
    p = sub.add_parser("gtest"); p.add_argument("xml"); p.add_argument("--name", required=True)
    p.add_argument("--skip-is-failure", action="store_true", help="a skipped test fails (there is a GPU)")
    p.set_defaults(run=gtest_results)
    args = parser.parse_args()
    args.run(args)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
