#!/usr/bin/env bash
# Compiles, syntax only, the translation units that use LibTorch's internal or version-dependent APIs (autograd
# nodes, CUDA streams and allocator, private ATen ops, c10d's TCP store) against the oldest LibTorch titan supports:
# 2.11, what the GPU machines carry. Uses the headers of PyPI's torch==2.11.0 wheel, fetched once into $TITAN_CACHE
# (a 530 MB download, 62 MB kept), and the compile commands of $TITAN_BUILD (scripts/build.sh first).
# Settings: TITAN_OLDEST_TORCH (2.11.0). scripts/test.sh runs it; a full build against 2.11 is in docs/gpu.md.
# A unit that passed with the same text, titan headers, command and compiler is not checked again (stamps in
# $TITAN_CACHE/oldest-libtorch-passed; delete them to check everything): 5 s instead of about 160 s when nothing under
# the 20 units changed, 71 s after an edit to a header two of them include (2-core EPYC, 2026-11-29).
# As the build does, the units include titan's precompiled header (src/titan/pch.h), here compiled once against the
# oldest headers into a temporary folder (with the flags most units share; the others differ only in macros the
# header does not use): parsing LibTorch is most of a unit's time (2-core EPYC: 223 s without it, about 130 with).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
version="${TITAN_OLDEST_TORCH:-2.11.0}"
headers="$TITAN_CACHE/libtorch-headers-$version"
commands="$TITAN_BUILD/compile_commands.json"
[[ -f "$commands" ]] || { echo "check_oldest_libtorch: no $commands (run scripts/build.sh first)" >&2; exit 2; }
start=$(date +%s)
if [[ ! -f "$headers/.complete" ]]; then
  echo "[oldest-libtorch] fetching the headers of torch==$version (PyPI wheel, once)"
  download=$(mktemp -d)
  trap 'rm -rf "$download"' EXIT
  "$TITAN_PYTHON" -m pip download -q --no-deps --only-binary=:all: "torch==$version" -d "$download"
  rm -rf "$headers"
  "$TITAN_PYTHON" - "$download" "$headers" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("torch-*.whl"))
with zipfile.ZipFile(wheel) as archive:
    members = [m for m in archive.namelist() if m.startswith("torch/include/")]
    archive.extractall(sys.argv[2], members)
print(f"[oldest-libtorch] {len(members)} header files from {wheel.name}")
PY
  touch "$headers/.complete"
fi
current=$("$TITAN_PYTHON" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
"$TITAN_PYTHON" - "$commands" "$current" "$headers/torch/include" "$TITAN_ROOT" <<'PY'
import collections, concurrent.futures, json, os, re, shlex, subprocess, sys, tempfile
commands_file, current, oldest, root = sys.argv[1:]
# What moved between LibTorch versions lives behind these includes.
version_dependent = re.compile(r'#include [<"](torch/csrc/|c10/cuda/|ATen/cuda/|ATen/ops/_|c10/core/impl/|titan/nn/torch_compat\.h)')
entries = [e for e in json.load(open(commands_file)) if e["file"].endswith(".cpp") and "/src/titan/" in e["file"]]
chosen = [e for e in entries if version_dependent.search(open(e["file"], encoding="utf-8").read())]
if not chosen:
    sys.exit("check_oldest_libtorch: no translation unit selected; is compile_commands.json from this tree?")

def command_for(entry):
    args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a == "-include" and i + 1 < len(args) and "cmake_pch" in args[i + 1]:
            skip = True  # the precompiled header was built against the current LibTorch
            continue
        if a in ("-MD", "-MMD", "-Winvalid-pch", "-c"):
            continue
        out.append(a.replace(current, oldest))
    return out + ["-fsyntax-only"], entry["directory"]

# The precompiled header: the flags most units share. GCC parses the headers itself for a unit that cannot use it
# (-Winvalid-pch says so), and every unit does if it did not build.
scratch = tempfile.TemporaryDirectory(prefix="titan-oldest-pch-")
header = os.path.join(scratch.name, "pch.hxx")
with open(header, "w") as f:
    f.write(f'#include "{os.path.join(root, "src", "titan", "pch.h")}"\n')
shared = collections.Counter()
for entry in chosen:
    cmd, cwd = command_for(entry)
    shared[(tuple(a for a in cmd if a not in (entry["file"], "-fsyntax-only")), cwd)] += 1
(flags, cwd), _ = shared.most_common(1)[0]

def build():
    return subprocess.run(list(flags) + ["-x", "c++-header", header, "-o", header + ".gch"], cwd=cwd, capture_output=True, text=True)

def check(entry, with_header=True):
    cmd, cwd = command_for(entry)
    if with_header:
        cmd = cmd[:-1] + ["-Winvalid-pch", "-include", header, cmd[-1]]
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return entry["file"], result.returncode, result.stderr

# A unit that passed before with the same text, the same titan headers under it, the same command and compiler is
# not checked again: its verdict is kept in $TITAN_CACHE/oldest-libtorch-passed, keyed by all of those. The headers
# under a unit are the ones the main build recorded for its object (ninja's dependency log), with pch.h and
# torch_compat.h always counted; LibTorch's own headers are fixed by the version.
import hashlib
stamps = os.path.join(os.environ["TITAN_CACHE"], "oldest-libtorch-passed")
build_dir = os.path.dirname(os.path.abspath(commands_file))
def deps_of(entries):
    def output_of(entry):  # the object file: compile_commands.json's "output", or the command's -o
        if entry.get("output"):
            return entry["output"]
        args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
        return args[args.index("-o") + 1] if "-o" in args[:-1] else None
    outputs = {e["file"]: output_of(e) for e in entries}
    if not all(outputs.values()):
        return {}
    listing = subprocess.run(["ninja", "-C", build_dir, "-t", "deps", *outputs.values()], capture_output=True, text=True)
    if listing.returncode:
        return {}
    by_output, current_output = {}, None
    for line in listing.stdout.splitlines():
        if line and not line[0].isspace():
            current_output = line.split(":")[0].strip()
            by_output[current_output] = []
        elif line.strip() and current_output is not None:
            by_output[current_output].append(line.strip())
    found = {}
    for source, output in outputs.items():
        listed = by_output.get(output)
        if listed is not None:
            found[source] = [os.path.normpath(os.path.join(build_dir, d)) for d in listed]
    return found
compiler_version = subprocess.run([command_for(chosen[0])[0][0], "--version"], capture_output=True, text=True).stdout
always = [os.path.join(root, "src", "titan", "pch.h"), os.path.join(root, "src", "titan", "nn", "torch_compat.h")]
def stamp_of(entry, deps):
    if entry["file"] not in deps:
        return None
    digest = hashlib.sha256()
    cmd, _ = command_for(entry)
    digest.update(oldest.replace(os.environ["TITAN_CACHE"], "").encode() + compiler_version.encode())
    digest.update(" ".join(cmd).replace(root, "<root>").replace(build_dir, "<build>").encode())
    for path in sorted(set([entry["file"], *always, *(d for d in deps[entry["file"]] if d.startswith(root + os.sep))])):
        digest.update(os.path.relpath(path, root).encode())
        digest.update(open(path, "rb").read() if os.path.exists(path) else b"<missing>")
    return os.path.join(stamps, digest.hexdigest())
deps = deps_of(chosen)
stamp = {e["file"]: stamp_of(e, deps) for e in chosen}
unchanged = [e for e in chosen if stamp[e["file"]] and os.path.exists(stamp[e["file"]])]
for entry in unchanged:
    print(f"[oldest-libtorch] ok   {os.path.relpath(entry['file'], root)} (unchanged since it passed)")
to_check = [e for e in chosen if e not in unchanged]

failed = 0
with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
    # While the header builds, this thread checks units the slow way.
    building = pool.submit(build) if to_check else None
    queue, results = list(to_check), []
    while queue and not building.done():
        results.append(check(queue.pop(), with_header=False))
    if building:
        built = building.result()
        print(f"[oldest-libtorch] precompiled header {'built' if built.returncode == 0 else 'failed, parsing per unit: ' + built.stderr[-2000:]}")
        results += pool.map(lambda e: check(e, with_header=built.returncode == 0), queue)
    for path, code, errors in results:
        name = os.path.relpath(path, root)
        if code:
            failed += 1
            print(f"[oldest-libtorch] FAIL {name}\n{errors[-4000:]}")
        else:
            print(f"[oldest-libtorch] ok   {name}")
            if stamp[path]:
                os.makedirs(stamps, exist_ok=True)
                open(stamp[path], "w").close()
print(f"[oldest-libtorch] {len(chosen) - failed} of {len(chosen)} translation units compile against {oldest}")
sys.exit(1 if failed else 0)
PY
echo "[oldest-libtorch] done in $(( $(date +%s) - start ))s"
