#!/usr/bin/env bash
# Checks titan.cpp's CUDA path on one NVIDIA GPU: builds against this machine's CUDA PyTorch, runs titan_gpu_tests
# and `titan train` on the GPU, and prints a verdict with figures (also written under $OUT when OUT is set).
#
# Usage, from the repository root:
#   scripts/test_gpu.sh                build into build-gpu/ (TITAN_GPU_BUILD), run every check, print the summary
#   scripts/test_gpu.sh --build-only   stage 1: configure and build only (about 5 minutes on 16 cores); needs no GPU,
#                                      so it also builds the binaries --prebuilt carries (see below)
#   scripts/test_gpu.sh --skip-build   stage 2: run every check from build-gpu/ as it is (the next call on a machine
#                                      that is still warm); each stage fits one 10-minute command
#   scripts/test_gpu.sh --prebuilt     every check from binaries built on another machine against the same LibTorch
#                                      (build-gpu/bin carried there; see "Prebuilt binaries" below); builds here
#                                      only when they do not load
#   scripts/test_gpu.sh --sanitize-only   only titan's CUDA kernel tests under compute-sanitizer (memcheck), from
#                                      build-gpu/; stage 2 runs them last when its time budget allows
#   scripts/test_gpu.sh --fetch-debs   on a Debian bookworm machine with network: download the Debian packages a GPU
#                                      machine may lack into .debs/ (see below); needs no GPU
# Exit codes: 0 every check passed; 1 a check failed or was not reached (each named in the summary); 2 something
# needed to build or run is missing (named); 77 no NVIDIA GPU here, so nothing was run (the "skipped" convention).
#
# Needs on the GPU machine: the NVIDIA driver (nvidia-smi), python3 with a CUDA PyTorch (LibTorch is found from
# torch.utils.cmake_prefix_path, NCCL from the wheel's nvidia/nccl), the CUDA toolkit's nvcc (Torch's CMake
# package looks for it), a C++20 compiler, CMake >= 3.25, ninja, and the libraries scripts/setup.sh installs as
# Debian packages: OpenMPI, toml++, nlohmann-json, PCRE2, zstd, zlib, sentencepiece, GoogleTest, pkg-config.
#
# Machines that reach no package registry (this workplace's GPU machines) get those as .deb files:
#   1. On a Debian bookworm machine with network: scripts/test_gpu.sh --fetch-debs  (apt-get download, 22
#      packages, about 17 MB, into .debs/, which it lists in .git/info/exclude).
#   2. Carry the folder to the GPU machine: the device tool sends ignored folders only when named in `carry`
#      (/work/.library/device/README.md), e.g. run with
#        command: set -o pipefail; scripts/test_gpu.sh 2>&1 | tee $OUT/test_gpu.log
#        carry: [".debs"]   timeout_s: 600
#   The script unpacks only the packages of the dependencies it finds missing, with dpkg-deb -x (or ar and tar),
#   into build-gpu/deps/ -- never into / -- and points CMake, pkg-config and the linker there (titan gets an rpath
#   to it, so nothing else on the machine sees those libraries).
#
# Prebuilt binaries: a lease is short, and the build takes minutes of it. On a machine with the CUDA toolkit and no
# GPU, build with TITAN_GPU_PYTHON naming a python3 that holds the PyPI torch wheel of the GPU machine's version
# (--build-only; docs/gpu.md gives the commands) and carry build-gpu/bin with .debs. --prebuilt then finds
# LibTorch and the CUDA libraries in this machine's wheel, unpacks the carried Debian packages of libraries the
# loader lacks into build-gpu/deps/, and checks that every binary loads; if one does not, it builds here as usual.
#
# Checks: titan_gpu_tests (tests/gpu: the model on CUDA against the CPU in float32, titan's CUDA kernels against
# ATen in float64, NCCL collectives on one rank,
# the trainer on the GPU, checkpoint round trips, GPU memory and peak-FLOPs metrics), then `titan train` on the
# GPU: bf16-autocast, bf16-parameter and float8 runs whose loss must fall, a resume from a checkpoint that must continue
# the uninterrupted run, the step line's memory field, tokens/s and MFU of the 1B flavor, and titan_bench_kernels
# --device cuda (titan's CUDA kernels against ATen at Llama 3 8B's shapes) (figures only: speed
# never passes or fails). The CLI corpus is the Python standard library's source (present wherever python3 is),
# the tokenizer is learned from it by `titan tokenizer train`. Two-rank NCCL runs need two GPUs and are not made.
# Settings: TITAN_GPU_BUILD, TITAN_GPU_PYTHON (python3), TITAN_GPU_DEBS (.debs), TITAN_GPU_JOBS (all cores),
# TITAN_GPU_GTEST_FILTER (a GoogleTest filter for titan_gpu_tests, '*'; '-*' runs none), TITAN_GPU_SKIP_CLI=1,
# TITAN_GPU_PROFILE (1: one profiled step of the 8B 4-layer benchmark in bf16 and float8, GPU time per kernel in
# profile_bf16.txt and profile_float8.txt, and a memory snapshot of the bf16 one summarised in memory_peak.txt; 0: none),
# TITAN_GPU_BENCH_FLAVOR (1B), _BENCH_BATCH (4), _BENCH_SEQ (2048), _BENCH_STEPS (20) for the first benchmark (the
# second is always 4 layers of 8B at 8,192 tokens), TITAN_GPU_SANITIZE_FILTER (GpuKernels.*), TITAN_GPU_TIME_BUDGET
# (seconds; a phase that would end later is reported as not run; 580 when OUT is set, else none).
# TITAN_GPU_DRY_RUN=1 checks the script itself on a machine without a GPU: no GPU check and no build (it uses
# the binaries in TITAN_GPU_BUILD), small CPU runs, CPU expectations.
set -uo pipefail  # not -e: one failed check must not hide the others

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${TITAN_GPU_BUILD:-$ROOT/build-gpu}"
PYTHON="${TITAN_GPU_PYTHON:-python3}"
DEBS="${TITAN_GPU_DEBS:-$ROOT/.debs}"
JOBS="${TITAN_GPU_JOBS:-$(nproc)}"
DRY_RUN="${TITAN_GPU_DRY_RUN:-0}"
GTEST_FILTER="${TITAN_GPU_GTEST_FILTER:-*}"
BENCH_FLAVOR="${TITAN_GPU_BENCH_FLAVOR:-1B}"
BENCH_BATCH="${TITAN_GPU_BENCH_BATCH:-4}"
BENCH_SEQ="${TITAN_GPU_BENCH_SEQ:-2048}"
BENCH_STEPS="${TITAN_GPU_BENCH_STEPS:-20}"
TIME_BUDGET="${TITAN_GPU_TIME_BUDGET:-$([[ -n "${OUT:-}" ]] && echo 580 || echo 0)}"
CHECK="$ROOT/tests/gpu/check_train_log.py"
DEPS="$BUILD/deps"
LIBDIR="$DEPS/usr/lib/x86_64-linux-gnu"
LIBPATH="$LIBDIR:$DEPS/lib/x86_64-linux-gnu"  # bookworm puts a few runtime libraries (zlib) under /lib
RUN_ENV=()  # the environment titan's processes need when libraries were unpacked into $DEPS (set after the build)
EXTRA_LIBPATH=""  # for prebuilt binaries: this machine's LibTorch and CUDA wheel libraries
START=$(date +%s)

# The Debian bookworm packages behind each dependency (-dev packages and the runtime libraries they link).
declare -A GROUP_DEBS=(
  [pkg-config]="pkgconf-bin libpkgconf3"
  [OpenMPI]="libopenmpi-dev libopenmpi3 libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7"
  [toml++]="libtomlplusplus-dev libtomlplusplus3"
  [PCRE2]="libpcre2-dev libpcre2-8-0"
  [zstd]="libzstd-dev libzstd1"
  [zlib]="zlib1g-dev zlib1g"
  [sentencepiece]="libsentencepiece-dev libsentencepiece0"
  [nlohmann-json]="nlohmann-json3-dev"
  [GoogleTest]="libgtest-dev"
  [libudev]="libudev1"
  [ICU]="libicu72"      # run time only, for binaries built elsewhere (--prebuilt); a build here finds ICU or goes without
  [libgomp]="libgomp1"  # likewise
)
GROUPS_IN_ORDER=(pkg-config OpenMPI toml++ PCRE2 zstd zlib sentencepiece nlohmann-json GoogleTest libudev ICU libgomp)

say() { printf '[test_gpu %4ds] %s\n' $(( $(date +%s) - START )) "$*"; }
die() { local code=$1; shift; printf 'test_gpu: %s\n' "$*" >&2; exit "$code"; }

# --- --fetch-debs: runs where apt-get reaches a Debian mirror -----------------------------------------------------
fetch_debs() {
  command -v apt-get >/dev/null || die 2 "--fetch-debs needs apt-get (a Debian bookworm machine with network)"
  local all=() group apt_options=()
  for group in "${GROUPS_IN_ORDER[@]}"; do read -ra packages <<<"${GROUP_DEBS[$group]}"; all+=("${packages[@]}"); done
  if [[ "$(dpkg --print-architecture)" != amd64 ]]; then
    # The GPU machines are x86-64: fetch amd64 packages through separate package lists.
    apt_options=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/titan-amd64-lists)
    mkdir -p /tmp/titan-amd64-lists/partial
    apt-get "${apt_options[@]}" update -qq || die 2 "apt-get update (amd64) failed"
  fi
  mkdir -p "$DEBS"
  (cd "$DEBS" && apt-get "${apt_options[@]}" download "${all[@]}") ||
    die 2 "apt-get download failed for some of: ${all[*]} (run apt-get update first; these are bookworm's names)"
  if [[ "$DEBS" == "$ROOT/.debs" ]]; then
    local exclude
    exclude="$(git -C "$ROOT" rev-parse --git-dir)/info/exclude"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.debs/' "$exclude" 2>/dev/null || echo '/.debs/' >>"$exclude"
  fi
  say "$(find "$DEBS" -name '*.deb' | wc -l) packages, $(du -sh "$DEBS" | cut -f1), in $DEBS"
  say "next, on the GPU machine: scripts/test_gpu.sh, with .debs carried (see this script's header)"
  exit 0
}

skip_build=0
prebuilt=0
build_only=0
sanitize_only=0
for arg in "$@"; do
  case "$arg" in
    --fetch-debs) fetch_debs ;;
    --skip-build) skip_build=1 ;;
    --prebuilt) prebuilt=1 ;;
    --build-only) build_only=1 ;;
    --sanitize-only) sanitize_only=1; skip_build=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die 2 "unknown argument '$arg' (expected --build-only, --skip-build, --sanitize-only, --fetch-debs or --help)" ;;
  esac
done
((build_only && skip_build)) && die 2 "--build-only and --skip-build/--sanitize-only exclude each other"
((prebuilt && (build_only || skip_build))) && die 2 "--prebuilt excludes --build-only, --skip-build and --sanitize-only"
run_checks=1
((build_only || sanitize_only)) && run_checks=0

# --- Is there a GPU? ------------------------------------------------------------------------------------------------
if [[ "$DRY_RUN" != 1 && "$build_only" != 1 ]]; then  # building needs no GPU
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "test_gpu: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no GPU): nothing to check here."
    echo "test_gpu: run it on a machine with an NVIDIA GPU (exit code 77 means skipped)."
    exit 77
  fi
fi

# Where results go: under $OUT when set (the device runner brings those files back, also after a timeout), so
# every check is written as soon as it is decided.
LOGS="$BUILD/logs"
REPORT_DIR="${OUT:-$LOGS}"
rm -rf "$LOGS"
mkdir -p "$LOGS" "$REPORT_DIR" || die 2 "cannot create $LOGS or $REPORT_DIR"
RESULTS="$REPORT_DIR/gpu_results.txt"
FIGURES="$REPORT_DIR/gpu_figures.txt"
: >"$RESULTS"
: >"$FIGURES"

record() {  # record PASS|FAIL|SKIP name detail
  printf '%s %s: %s\n' "$1" "$2" "$3" | tee -a "$RESULTS"
}
figure() { printf '[figure] %s = %s\n' "$1" "$2" | tee -a "$FIGURES"; }
# Runs the log checker; its PASS/FAIL lines and figures go to the report files.
checker() {
  local out
  out=$("$PYTHON" "$CHECK" "$@" 2>&1)
  local rc=$?
  printf '%s\n' "$out"
  grep '^\[figure\]' <<<"$out" >>"$FIGURES"
  grep -E '^(PASS|FAIL|SKIP|N/A) ' <<<"$out" >>"$RESULTS"
  if [[ $rc -gt 1 ]]; then record FAIL "checker $1" "check_train_log.py failed: $(tail -1 <<<"$out")"; fi
  return 0
}
within_budget() {  # within_budget phase seconds: false (the phase recorded as not run) if it would end past the budget
  local spent=$(( $(date +%s) - START ))
  if [[ "$TIME_BUDGET" -gt 0 && $((spent + $2)) -gt "$TIME_BUDGET" ]]; then
    record SKIP "$1" "not run: ${spent}s spent, about $2s more would pass the budget of ${TIME_BUDGET}s (TITAN_GPU_TIME_BUDGET); on a warm machine run again with --skip-build"
    return 1
  fi
}

# --- Python, PyTorch, CUDA ------------------------------------------------------------------------------------------
torch_info=$("$PYTHON" - <<'EOF' 2>&1
import os, torch
def safe(read):
    try:
        return read()
    except Exception as error:  # a query that fails is reported, not fatal
        return f"unknown ({type(error).__name__})"
available = torch.cuda.is_available()
print("version", torch.__version__)
print("cuda", torch.version.cuda or "none")
print("available", int(available))
print("cmake", torch.utils.cmake_prefix_path)
print("site", os.path.dirname(os.path.dirname(torch.__file__)))
print("nccl", safe(lambda: ".".join(map(str, torch.cuda.nccl.version()))) if torch.version.cuda else "none")
print("device", safe(lambda: torch.cuda.get_device_name(0)) if available else "none")
EOF
) || die 2 "$PYTHON cannot import torch (set TITAN_GPU_PYTHON to a python3 with a CUDA PyTorch): $(tail -1 <<<"$torch_info")"
info() { awk -v k="$1" '$1 == k { $1 = ""; sub(/^ /, ""); print }' <<<"$torch_info"; }
TORCH_CMAKE=$(info cmake)
SITE=$(info site)
if [[ "$DRY_RUN" != 1 ]]; then
  [[ "$(info cuda)" != none ]] || die 2 "PyTorch $(info version) in $PYTHON is a CPU-only build; a CUDA build is needed"
  [[ "$(info available)" == 1 || "$build_only" == 1 ]] ||
    die 2 "nvidia-smi lists a GPU but torch.cuda.is_available() is false (driver too old for CUDA $(info cuda)?)"
fi
say "PyTorch $(info version) (CUDA $(info cuda), NCCL $(info nccl)) from $SITE; device: $(info device)"

# --- Build ----------------------------------------------------------------------------------------------------------
BIN="$BUILD/bin"
cmake_args=()
probe_groups() {  # prints the dependency groups the configure step would not find
  local probe="$BUILD/probe"
  mkdir -p "$probe/src"
  cat >"$probe/src/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(titan_gpu_probe LANGUAGES C CXX)
# The same look-ups as titan's CMakeLists.txt, none required: one line per dependency group.
function(report group found)
  if(found)
    message(STATUS "TITAN_PROBE ${group} FOUND")
  else()
    message(STATUS "TITAN_PROBE ${group} MISSING")
  endif()
endfunction()
find_package(PkgConfig QUIET)
report(pkg-config "${PKG_CONFIG_FOUND}")
if(PKG_CONFIG_FOUND)
  pkg_check_modules(P_TOML QUIET tomlplusplus)
  pkg_check_modules(P_PCRE2 QUIET libpcre2-8)
  pkg_check_modules(P_ZSTD QUIET libzstd)
endif()
report(toml++ "${P_TOML_FOUND}")
report(PCRE2 "${P_PCRE2_FOUND}")
report(zstd "${P_ZSTD_FOUND}")
find_package(ZLIB QUIET)
report(zlib "${ZLIB_FOUND}")
find_library(P_SP_LIBRARY sentencepiece)
find_path(P_SP_INCLUDE sentencepiece_processor.h)
if(P_SP_LIBRARY AND P_SP_INCLUDE)
  report(sentencepiece TRUE)
else()
  report(sentencepiece FALSE)
endif()
find_package(nlohmann_json QUIET)
report(nlohmann-json "${nlohmann_json_FOUND}")
find_package(MPI QUIET COMPONENTS C)
report(OpenMPI "${MPI_C_FOUND}")
find_package(GTest QUIET)
report(GoogleTest "${GTest_FOUND}")
EOF
  rm -rf "$probe/build"
  cmake -S "$probe/src" -B "$probe/build" -G Ninja -DCMAKE_PREFIX_PATH="$DEPS/usr" "${cmake_args[@]}" >"$LOGS/probe.log" 2>&1
  sed -n 's/.*TITAN_PROBE \(.*\) MISSING.*/\1/p' "$LOGS/probe.log"
  grep -q 'TITAN_PROBE' "$LOGS/probe.log" || echo "probe-failed"
}

extract_deb() {  # extract_deb file.deb directory: dpkg-deb where it exists, else ar and tar
  if command -v dpkg-deb >/dev/null; then dpkg-deb -x "$1" "$2"; return; fi
  local member
  member=$(ar t "$1" | grep '^data\.tar') || return 1
  case "$member" in
    *.xz) ar p "$1" "$member" | tar -xJ -C "$2" ;;
    *.zst) ar p "$1" "$member" | zstd -dc | tar -x -C "$2" ;;
    *.gz) ar p "$1" "$member" | tar -xz -C "$2" ;;
    *) ar p "$1" "$member" | tar -x -C "$2" ;;
  esac
}

unpack_groups() {  # unpack_groups group...: their carried .debs into $DEPS; prints packages it could not find
  local group package file
  mkdir -p "$DEPS"
  for group in "$@"; do
    for package in ${GROUP_DEBS[$group]:-}; do
      file=$(find "$DEBS" -maxdepth 1 -name "${package}_*.deb" 2>/dev/null | sort | tail -1)
      if [[ -z "$file" ]]; then echo "$package"; continue; fi
      extract_deb "$file" "$DEPS" || echo "$package (could not be unpacked)"
    done
  done
  # Absolute symbolic links (libz.so -> /lib/...) must point into the prefix.
  local link target
  while IFS= read -r link; do
    target=$(readlink "$link")
    [[ -e "$DEPS$target" ]] && ln -sfn "$DEPS$target" "$link"
  done < <(find "$DEPS" -type l -lname '/*')
  # Debian's .pc files name /usr; inside the prefix they must name the prefix.
  # Some (libzstd) say libdir=${prefix}/lib and rely on the multiarch default; the prefix has only the latter.
  find "$DEPS" -name '*.pc' -exec sed -E -i \
    -e "s#^([A-Za-z_]+=)/usr#\\1$DEPS/usr#" -e "s#([ =])-([IL])/usr#\\1-\\2$DEPS/usr#g" \
    -e "s#^libdir=\\\$\\{(exec_)?prefix\\}/lib\$#libdir=$LIBDIR#" {} + 2>/dev/null
  if [[ -x "$DEPS/usr/bin/pkgconf" ]]; then
    # pkgconf's own library sits in the prefix; the wrapper gives it that, and nothing else sees it.
    mkdir -p "$DEPS/bin"
    # shellcheck disable=SC2016  # the wrapper expands LD_LIBRARY_PATH and "$@" itself, when it runs
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
      "$LIBPATH" "$DEPS/usr/bin/pkgconf" >"$DEPS/bin/pkg-config"
    chmod +x "$DEPS/bin/pkg-config"
  fi
}

deps_cmake_args() {  # the CMake settings that point at the unpacked prefix
  cmake_args=()
  [[ -d "$DEPS/usr" ]] || return 0
  export PKG_CONFIG_PATH="$LIBDIR/pkgconfig:$DEPS/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  [[ -x "$DEPS/bin/pkg-config" ]] && cmake_args+=(-DPKG_CONFIG_EXECUTABLE="$DEPS/bin/pkg-config")
  if [[ -f "$LIBDIR/openmpi/include/mpi.h" ]]; then
    cmake_args+=(-DMPI_SKIP_COMPILER_WRAPPER=ON -DMPI_C_HEADER_DIR="$LIBDIR/openmpi/include" -DMPI_C_LIB_NAMES=mpi
                 -DMPI_mpi_LIBRARY="$LIBDIR/openmpi/lib/libmpi.so")
  fi
  # Where the linker finds the libraries' own dependencies (libmpi -> libopen-pal ...). At run time Debian's
  # libmpi carries a RUNPATH of its own, which hides the executable's rpath from its dependencies: titan's
  # processes get LD_LIBRARY_PATH instead (RUN_ENV; python3 and the rest of the machine never see it).
  cmake_args+=(-DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$LIBDIR -Wl,-rpath-link,$DEPS/lib/x86_64-linux-gnu")
}

check_tools() {
  local missing=() cmake_version compiler
  command -v cmake >/dev/null || missing+=("cmake (>= 3.25)")
  command -v ninja >/dev/null || missing+=("ninja")
  compiler=$(command -v c++ || command -v g++ || command -v clang++) || missing+=("a C++20 compiler (g++ >= 11)")
  NVCC=$(command -v nvcc)
  local candidate
  for candidate in "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
    [[ -z "$NVCC" && -x "$candidate" ]] && NVCC=$candidate
  done
  [[ -n "$NVCC" ]] || missing+=("nvcc (the CUDA toolkit; set CUDA_HOME)")
  if ((${#missing[@]})); then die 2 "missing tools: ${missing[*]}"; fi
  cmake_version=$(cmake --version | head -1)
  say "tools: $cmake_version; ninja $(ninja --version); $($compiler --version | head -1); $("$NVCC" --version | tail -1)"
  local nccl=("$SITE"/nvidia/nccl/include/nccl.h "$(dirname "$(dirname "$NVCC")")"/include/nccl.h /usr/include/nccl.h)
  local found=0 h
  for h in "${nccl[@]}"; do [[ -f "$h" ]] && found=1; done
  ((found)) || die 2 "NCCL headers not found (looked for ${nccl[*]}); install the nvidia-nccl wheel that matches torch"
}

set_run_env() {
  RUN_ENV=()
  local path=""
  [[ -d "$DEPS/usr" ]] && path=$LIBPATH
  [[ -n "$EXTRA_LIBPATH" ]] && path="${path:+$path:}$EXTRA_LIBPATH"
  if [[ -n "$path" ]]; then RUN_ENV=(env "LD_LIBRARY_PATH=$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"); fi
}

unresolved_libraries() {  # unresolved_libraries binary...: the sonames (or symbol versions) the loader lacks, one per line
  "${RUN_ENV[@]}" ldd "$@" 2>&1 |
    sed -n -E 's/^[[:space:]]*([^[:space:]]+) => not found.*/\1/p; s/.*version .([^ ]+). not found.*/version:\1/p' | sort -u
}

use_prebuilt() {  # true when titan, titan_gpu_tests and titan_bench_kernels in $BIN load here (after help)
  local binaries=("$BIN/titan" "$BIN/titan_gpu_tests" "$BIN/titan_bench_kernels") missing groups=() soname group
  local b
  for b in "${binaries[@]}"; do [[ -x "$b" ]] || { say "prebuilt: no $b; building here"; return 1; }; done
  set_run_env
  missing=$(unresolved_libraries "${binaries[@]}")
  if [[ -n "$missing" ]]; then
    # The rpath names the build machine's wheel: point the loader at this machine's LibTorch and CUDA libraries.
    EXTRA_LIBPATH="$SITE/torch/lib"
    for b in "$SITE"/nvidia/*/lib; do [[ -d "$b" ]] && EXTRA_LIBPATH+=":$b"; done
    set_run_env
    missing=$(unresolved_libraries "${binaries[@]}")
  fi
  if [[ -n "$missing" ]]; then
    for soname in $missing; do
      case "$soname" in
        libmpi*|libopen-*|libhwloc*|libevent*) group=OpenMPI ;;
        libudev*) group=libudev ;;
        libtomlplusplus*) group=toml++ ;;
        libpcre2*) group=PCRE2 ;;
        libzstd*) group=zstd ;;
        libz.*) group=zlib ;;
        libsentencepiece*) group=sentencepiece ;;
        libicu*) group=ICU ;;
        libgomp*) group=libgomp ;;
        *) group="" ;;
      esac
      [[ -n "$group" && " ${groups[*]} " != *" $group "* ]] && groups+=("$group")
    done
    [[ " ${groups[*]} " == *" OpenMPI "* ]] && ! grep -q 'libudev.so.1 ' < <(ldconfig -p 2>/dev/null) && groups+=(libudev)
    if ((${#groups[@]})); then
      say "prebuilt: the loader lacks $(echo $missing); unpacking ${groups[*]} from $DEBS"
      unpack_groups "${groups[@]}" >/dev/null
      set_run_env
      missing=$(unresolved_libraries "${binaries[@]}")
    fi
  fi
  if [[ -n "$missing" ]]; then
    say "prebuilt: still not found: $(echo $missing); building here"
    return 1
  fi
  # Loads, and runs: the command line answers.
  if ! "${RUN_ENV[@]}" "$BIN/titan" --help >"$LOGS/prebuilt.log" 2>&1; then
    say "prebuilt: titan --help failed ($(tail -1 "$LOGS/prebuilt.log")); building here"
    return 1
  fi
  record PASS build.prebuilt "binaries built elsewhere load and run here${EXTRA_LIBPATH:+ (LibTorch from $SITE/torch/lib)}"
}

build() {
  check_tools
  local missing
  deps_cmake_args
  mapfile -t missing < <(probe_groups)
  [[ " ${missing[*]} " == *" probe-failed "* ]] && die 2 "the dependency probe did not run; see $LOGS/probe.log"
  if ((${#missing[@]})); then
    say "missing here: ${missing[*]}; unpacking the carried packages from $DEBS"
    [[ " ${missing[*]} " == *" OpenMPI "* ]] && ! grep -q 'libudev.so.1 ' < <(ldconfig -p 2>/dev/null) && missing+=(libudev)
    local absent
    absent=$(unpack_groups "${missing[@]}")
    deps_cmake_args
    mapfile -t missing < <(probe_groups)
    if ((${#missing[@]})); then
      local wanted=() group
      for group in "${missing[@]}"; do wanted+=("$group (Debian: ${GROUP_DEBS[$group]:-?})"); done
      die 2 "missing dependencies: ${wanted[*]}.${absent:+ Packages not in $DEBS: $(echo "$absent" | tr '\n' ' ')}
Bring them as .deb files: 'scripts/test_gpu.sh --fetch-debs' on a Debian bookworm machine with network, then carry
.debs to this machine (see the header of scripts/test_gpu.sh). Details: $LOGS/probe.log"
    fi
  fi
  say "configuring $BUILD"
  local t0=$SECONDS
  if ! cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$TORCH_CMAKE;$DEPS/usr" -DCUDAToolkit_ROOT="$(dirname "$(dirname "$NVCC")")" \
      -DCMAKE_CUDA_COMPILER="$NVCC" "${cmake_args[@]}" >"$LOGS/configure.log" 2>&1; then
    tail -30 "$LOGS/configure.log"
    record FAIL build.configure "cmake failed: $(grep -m1 -E 'Error|error' "$LOGS/configure.log")"
    return 1
  fi
  if ! grep -q 'TITAN_WITH_CUDA' "$BUILD/build.ninja"; then
    record FAIL build.configure "configured without CUDA: Torch's CMake package reports no CUDA (see configure.log)"
    return 1
  fi
  record PASS build.configure "$(grep -m1 'NCCL:' "$LOGS/configure.log" | sed 's/^-- //')"
  # One target after the other: the CLI checks can still run when only the test binary fails to compile.
  set_run_env
  local target unresolved
  for target in titan titan_gpu_tests titan_bench_kernels; do
    say "building $target on $JOBS cores"
    if ! cmake --build "$BUILD" -j "$JOBS" --target "$target" >"$LOGS/build-$target.log" 2>&1; then
      grep -E -m5 -B2 -A8 'error' "$LOGS/build-$target.log" | head -60
      record FAIL "build.$target" "compile or link failed: $(grep -m1 -E 'error' "$LOGS/build-$target.log")"
      continue
    fi
    unresolved=$("${RUN_ENV[@]}" ldd "$BIN/$target" 2>&1 | grep 'not found' | sort -u | tr -s ' \t\n' ' ')
    if [[ -n "$unresolved" ]]; then record FAIL "build.$target" "libraries the loader does not find: $unresolved"; continue; fi
    record PASS "build.$target" "built and loadable ($((SECONDS - t0))s since configuring)"
  done
  figure time.build_s "$((SECONDS - t0))"
}

if [[ ("$DRY_RUN" == 1 && "$prebuilt" == 0) || "$skip_build" == 1 ]]; then
  [[ -x "$BIN/titan" && -x "$BIN/titan_gpu_tests" ]] || die 2 "no binaries in $BIN to reuse (build first, or set TITAN_GPU_BUILD)"
  say "reusing the binaries in $BIN"
  set_run_env
elif ((prebuilt)) && use_prebuilt; then
  say "using the prebuilt binaries in $BIN"
else
  if ((prebuilt)); then
    figure build.prebuilt "not usable here (see the lines above); built here instead"
    EXTRA_LIBPATH=""
    # Kept aside too (the build replaces what it builds; a target that fails is recorded, and nothing runs it).
    rm -rf "$BUILD/bin.prebuilt" && cp -a "$BIN" "$BUILD/bin.prebuilt" 2>/dev/null
  fi
  build || say "the build failed; logs in $LOGS"
fi

# --- titan_gpu_tests: one process per test suite, and per test where a suite crashes -------------------------------
run_gtest() {  # run_gtest filter name: one process; its figures and per-test results recorded
  local filter=$1 name=$2 rc
  local log="$LOGS/gtest-$name.log" xml="$LOGS/gtest-$name.xml"
  # A hung NCCL call must not eat the whole session: a suite gets 4 minutes.
  TITAN_GPU_TESTS_DRY_RUN="$DRY_RUN" NCCL_DEBUG="${NCCL_DEBUG:-WARN}" timeout 240 "${RUN_ENV[@]}" "$BIN/titan_gpu_tests" --gtest_filter="$filter" \
    --gtest_output="xml:$xml" >"$log" 2>&1
  rc=$?
  grep '^\[figure\]' "$log" >>"$FIGURES"
  grep -E '^\[ *(OK|FAILED|SKIPPED) *\] .*\([0-9]+ ms\)$|^\[figure\]' "$log" | sed 's/^/    /'
  if [[ $rc -le 1 && -f "$xml" ]]; then
    local strict=(--skip-is-failure)
    [[ "$DRY_RUN" == 1 ]] && strict=()
    checker gtest "$xml" --name "gtest.$name" "${strict[@]}"
    return 0
  fi
  return "$rc"
}

run_gtests() {
  local t0=$SECONDS listing suite test rc filter tests
  listing=$("${RUN_ENV[@]}" "$BIN/titan_gpu_tests" --gtest_list_tests --gtest_filter="$GTEST_FILTER" 2>&1) ||
    { record FAIL gtest "titan_gpu_tests cannot list its tests: $listing"; return; }
  for suite in $(grep -E '^[A-Za-z_][A-Za-z0-9_]*\.$' <<<"$listing" | tr -d '.'); do
    mapfile -t tests < <(awk -v s="$suite." '/^[A-Za-z_]/ { in_suite = ($0 == s) } in_suite && /^  / { print $1 }' <<<"$listing")
    ((${#tests[@]})) || continue
    within_budget "gtest.$suite" 90 || continue
    say "titan_gpu_tests: $suite"
    filter=$(printf "$suite.%s:" "${tests[@]}")
    run_gtest "${filter%:}" "$suite"
    rc=$?
    ((rc == 0)) && continue
    # A crash or timeout loses the suite's report: run its tests one by one to name the culprit.
    record FAIL "gtest.$suite" "the process ended with exit code $rc ($( ((rc == 124)) && echo timeout || echo crash)); rerunning its tests one by one"
    for test in "${tests[@]}"; do
      run_gtest "$suite.$test" "$suite.$test"
      rc=$?
      ((rc == 0)) || record FAIL "gtest.$suite.$test" "exit code $rc ($( ((rc == 124)) && echo timeout || echo crash)): $(grep -v '^\[' "$LOGS/gtest-$suite.$test.log" | tail -2 | tr '\n' ' ')"
    done
  done
  figure time.gtest_s "$((SECONDS - t0))"
}

if ((run_checks)) && [[ -x "$BIN/titan_gpu_tests" ]] && ! grep -qE '^FAIL build\.(configure|titan_gpu_tests)' "$RESULTS"; then
  run_gtests
fi

# --- titan train on the GPU ----------------------------------------------------------------------------------------
DATA="$BUILD/data"
RUNS="$BUILD/runs"
make_corpus() {  # the Python standard library's sources as text documents, and a BPE tokenizer learned from them
  rm -rf "$DATA" && mkdir -p "$DATA/corpus"
  "$PYTHON" - "$DATA/corpus" <<'EOF' || return 1
import pathlib, sys, sysconfig
out = pathlib.Path(sys.argv[1])
stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
total = count = 0
for path in sorted(stdlib.rglob("*.py")):
    if "test" in path.parts or "site-packages" in path.parts:
        continue
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        continue
    if len(text) < 200:
        continue
    (out / f"{count:05d}.txt").write_text(text, encoding="utf-8")
    count += 1
    total += len(text.encode())
    if total > 16_000_000:
        break
print(f"{count} files, {total:,} bytes from {stdlib}")
EOF
  "${RUN_ENV[@]}" "$BIN/titan" tokenizer train --input "$DATA/corpus" --vocab-size 2048 --output "$DATA/stdlib.tiktoken" >"$LOGS/tokenizer.log" 2>&1
}

RECORD_TRAIN_FAILURE=1  # 0 while a failure is handled by the caller (the benchmark's retry with a smaller batch)
train() {  # train name args...: one `titan train` run, its log in $LOGS/train-name.log; false if it did not finish
  local name=$1 rc t0=$SECONDS
  shift
  say "titan train: $name"
  (cd "$RUNS" && timeout "${TRAIN_TIMEOUT:-300}" "${RUN_ENV[@]}" "$BIN/titan" train "$@" --job.dump_folder "$RUNS/$name") >"$LOGS/train-$name.log" 2>&1
  rc=$?
  grep -E 'step: *[0-9]+ ' "$LOGS/train-$name.log" | tail -3 | sed 's/^.* - INFO - /    /'
  figure "time.train_${name}_s" "$((SECONDS - t0))"
  if ((rc != 0)); then
    local why
    why="titan train exited with $rc$( ((rc == 124)) && echo ' (timeout)'): $(grep -E 'error|Error|what\(\)' "$LOGS/train-$name.log" | head -2 | tr '\n' ' ')"
    if ((RECORD_TRAIN_FAILURE)); then record FAIL "cli.$name" "$why"; else say "$name: $why"; fi
    tail -15 "$LOGS/train-$name.log" | sed 's/^/    /'
    return 1
  fi
}

run_cli() {
  rm -rf "$RUNS" && mkdir -p "$RUNS"  # a run folder left by an earlier call would be resumed from
  if ! make_corpus; then record FAIL cli.corpus "could not build the corpus or tokenizer: $(tail -2 "$LOGS/tokenizer.log" 2>/dev/null)"; return; fi
  local device_flag=() small=()
  [[ "$DRY_RUN" == 1 ]] && device_flag=(--cpu) && small=(--training.seq_len 128 --training.local_batch_size 4)
  local data=(--model.hf_assets_path "$DATA/stdlib.tiktoken" --training.dataset_path "$DATA/corpus" --debug.seed 7)
  local debug=(--job.config_file "$ROOT/configs/debug_model.toml" "${data[@]}" --metrics.log_freq 1 "${small[@]}")

  # The built-in debug job (bf16 autocast, float32 parameters): the loss falls, the step line shows GPU memory.
  if within_budget cli.bf16_autocast 40 && train bf16_autocast "${debug[@]}" --training.steps 40; then
    checker device "$LOGS/train-bf16_autocast.log" --name cli.bf16_autocast.device "${device_flag[@]}"
    checker loss-falls "$LOGS/train-bf16_autocast.log" --name cli.bf16_autocast.loss_falls --min-drop 1.0
    checker memory "$LOGS/train-bf16_autocast.log" --name cli.bf16_autocast.memory_field
    checker throughput "$LOGS/train-bf16_autocast.log" --name cli.bf16_autocast.speed --skip 10
  fi
  # bf16 parameters (fused AdamW on bf16 tensors).
  if within_budget cli.bf16_params 30 && train bf16_params "${debug[@]}" --training.steps 30 --training.dtype bfloat16; then
    checker loss-falls "$LOGS/train-bf16_params.log" --name cli.bf16_params.loss_falls --min-drop 0.5
  fi
  # Mixture-of-Experts families (bf16 autocast): Qwen3-MoE (64 experts, top 8) and DeepSeek-V3 (MLA attention,
  # shared expert); the experts' grouped products go through at::_grouped_mm on compute capability 9.0+.
  local family name flavor
  for family in "qwen3 debugmodel_moe" "deepseek_v3 debugmodel"; do
    read -r name flavor <<<"$family"
    if within_budget "cli.$name" 40 && train "$name" "${debug[@]}" --model.name "$name" --model.flavor "$flavor" --training.steps 30; then
      checker loss-falls "$LOGS/train-$name.log" --name "cli.$name.loss_falls" --min-drop 0.3
    fi
  done
  # comm.mode = "fake_backend", torchtitan's dry run: rank 13 of Llama 3 8B on 64 GPUs (FSDP 8 x TP 8, 8,192 tokens)
  # alone on this GPU, with that rank's shards and memory and no communication (docs/distributed.md). The dry run of
  # this script plays rank 5 of the debug model on FSDP 4 x TP 2.
  local fake=(--model.flavor 8B --parallelism.data_parallel_shard_degree 8 --parallelism.tensor_parallel_degree 8
              --training.seq_len 8192 --training.local_batch_size 1) fake_env=(NGPU=64 RANK=13)
  [[ "$DRY_RUN" == 1 ]] && fake=(--parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 2) && fake_env=(NGPU=8 RANK=5)
  if within_budget cli.fake_backend 60 && (export "${fake_env[@]}"; train fake_backend "${debug[@]}" --comm.mode fake_backend \
       --training.steps 3 "${fake[@]}"); then
    checker memory "$LOGS/train-fake_backend.log" --name cli.fake_backend.memory_field
    figure cli.fake_backend.rank "$(grep -m1 -o 'this process plays rank [0-9]* of [0-9]*' "$LOGS/train-fake_backend.log")"
    figure cli.fake_backend.estimate "$(grep -m1 -o 'Memory estimate for this rank: .*' "$LOGS/train-fake_backend.log" | cut -c1-400)"
    figure cli.fake_backend.last_step "$(grep -E 'step: *3 ' "$LOGS/train-fake_backend.log" | sed 's/^.* - INFO - //')"
  fi
  # A pipeline rank of the same 64 GPUs: rank 0 of PP 4 x FSDP 2 x TP 8 (Interleaved1F1B, stages 0 and 4, 4 micro-batches
  # of 8,192 tokens), its neighbours' activations stand-ins: the per-rank pipeline memory the plan predicts
  # (docs/plan.md), measured. The dry run of this script plays rank 0 of the debug model on PP 2 x FSDP 2 (Interleaved1F1B:
  # stages 0 and 2, the second receiving).
  local fake_pp=(--model.flavor 8B --parallelism.pipeline_parallel_degree 4 --parallelism.data_parallel_shard_degree 2
                 --parallelism.tensor_parallel_degree 8 --parallelism.pipeline_parallel_schedule Interleaved1F1B
                 --training.seq_len 8192 --training.local_batch_size 4) fake_pp_env=(NGPU=64 RANK=0)
  [[ "$DRY_RUN" == 1 ]] && fake_pp=(--parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 2
                                     --parallelism.pipeline_parallel_schedule Interleaved1F1B) && fake_pp_env=(NGPU=4 RANK=0)
  if within_budget cli.fake_backend_pp 60 && (export "${fake_pp_env[@]}"; train fake_backend_pp "${debug[@]}" --comm.mode fake_backend \
       --training.steps 3 "${fake_pp[@]}"); then
    checker memory "$LOGS/train-fake_backend_pp.log" --name cli.fake_backend_pp.memory_field
    figure cli.fake_backend_pp.estimate "$(grep -m1 -o 'Memory estimate for this rank: .*' "$LOGS/train-fake_backend_pp.log" | cut -c1-400)"
    figure cli.fake_backend_pp.last_step "$(grep -E 'step: *3 ' "$LOGS/train-fake_backend_pp.log" | sed 's/^.* - INFO - //')"
  fi
  # Float8 linears (torchao's tensorwise recipe, the output projection in bf16): the loss falls. at::_scaled_mm needs
  # compute capability 8.9 or newer; older GPUs and the dry run emulate.
  local float8=(--model.converters float8 --quantize.linear.float8.filter_fqns output)
  local capability
  capability=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
  if [[ "$DRY_RUN" == 1 || -z "$capability" || "$capability" -lt 89 ]]; then float8+=(--quantize.linear.float8.emulate); fi
  if within_budget cli.float8 40 && train float8 "${debug[@]}" --training.steps 40 "${float8[@]}"; then
    checker loss-falls "$LOGS/train-float8.log" --name cli.float8.loss_falls --min-drop 1.0
    figure cli.float8.layers "$(grep -m1 -o 'Float8 linears.*' "$LOGS/train-float8.log")"
  fi
  # MXFP8 linears: LibTorch's blockwise-scaled matmul needs compute capability 10.0 or newer; older GPUs and the dry
  # run emulate.
  local mx=(--model.converters mx)
  if [[ "$DRY_RUN" == 1 || -z "$capability" || "$capability" -lt 100 ]]; then mx+=(--quantize.linear.mx.emulate); fi
  if within_budget cli.mx 40 && train mx "${debug[@]}" --training.steps 40 "${mx[@]}"; then
    checker loss-falls "$LOGS/train-mx.log" --name cli.mx.loss_falls --min-drop 1.0
    figure cli.mx.layers "$(grep -m1 -o 'MXFP8 linears.*' "$LOGS/train-mx.log")"
  fi
  # Resume: 10 steps in one go against 5 steps' checkpoint (copied from that run) resumed to 10.
  local resume=("${debug[@]}" --training.steps 10 --checkpoint.enable --checkpoint.interval 5 --checkpoint.keep_latest_k 0
                --checkpoint.no_last_save_model_only --debug.deterministic --debug.deterministic_warn_only)
  if within_budget cli.resume 60 && train resume_full "${resume[@]}"; then
    mkdir -p "$RUNS/resume_part/checkpoint"
    cp -r "$RUNS/resume_full/checkpoint/step-5" "$RUNS/resume_part/checkpoint/"
    if train resume_part "${resume[@]}"; then
      checker resume "$LOGS/train-resume_full.log" "$LOGS/train-resume_part.log" --name cli.resume --first 6 --rtol 2e-3
      local same=no
      cmp -s "$RUNS/resume_full/checkpoint/step-10/rank-00000.bin" "$RUNS/resume_part/checkpoint/step-10/rank-00000.bin" && same=yes
      figure cli.resume.step10_state_bitwise_equal "$same"
    fi
  fi
  # Sampling on the GPU (titan generate, KV cache, float32): the step-10 checkpoint above continues two prompts with
  # the CPU's greedy tokens and log-probabilities; bf16 autocast on the GPU as a figure.
  if [[ -d "$RUNS/resume_full/checkpoint/step-10" ]] && within_budget cli.generate 60; then run_generate; fi
  # Throughput on one GPU: the 1B flavor (no FSDP, no activation checkpointing) and four of 8B's layers at torchtitan's
  # published 8B setting (8,192 tokens, selective AC): figures, never a verdict.
  if [[ "$DRY_RUN" == 1 ]]; then
    run_bench bench_dry_run 2 "AC none" --model.flavor debugmodel "${data[@]}" --training.seq_len 128 --training.steps 10 \
      --metrics.log_freq 5 --activation_checkpoint.mode none
    return
  fi
  run_bench "bench_${BENCH_FLAVOR}" "$BENCH_BATCH" "AC none" --model.flavor "$BENCH_FLAVOR" "${data[@]}" --training.seq_len "$BENCH_SEQ" \
    --training.steps "$BENCH_STEPS" --metrics.log_freq 5 --activation_checkpoint.mode none --optimizer.lr 3e-4 --lr_scheduler.warmup_steps 5
  run_bench bench_8B_4_layers 1 "selective AC" --model.flavor 8B --model.n_layers 4 "${data[@]}" --training.seq_len 8192 \
    --training.steps 15 --metrics.log_freq 5 --activation_checkpoint.mode selective --optimizer.lr 3e-4 --lr_scheduler.warmup_steps 5
  # The same with float8 linears (tensorwise), against the bf16 figure above.
  run_bench bench_8B_4_layers_float8 1 "selective AC, float8 tensorwise" --model.flavor 8B --model.n_layers 4 "${data[@]}" \
    --training.seq_len 8192 --training.steps 15 --metrics.log_freq 5 --activation_checkpoint.mode selective --optimizer.lr 3e-4 \
    --lr_scheduler.warmup_steps 5 "${float8[@]}"
  [[ "${TITAN_GPU_PROFILE:-1}" == 1 ]] && run_profiles
}

run_profiles() {  # one profiled step of the 8B 4-layer benchmark in bf16 and in float8: GPU time per kernel, as text
  local variant args trace
  for variant in bf16 float8; do
    within_budget "profile.$variant" 45 || return
    args=(--model.flavor 8B --model.n_layers 4 "${data[@]}" --training.seq_len 8192 --training.local_batch_size 1
          --training.steps 10 --metrics.log_freq 5 --activation_checkpoint.mode selective --optimizer.lr 3e-4
          --lr_scheduler.warmup_steps 5 --profiling.enable_profiling --profiling.profile_freq 10
          --profiling.profiler_warmup 3 --profiling.profiler_active 1)
    [[ "$variant" == float8 ]] && args+=("${float8[@]}")
    RECORD_TRAIN_FAILURE=0
    train "profile_$variant" "${args[@]}" || { RECORD_TRAIN_FAILURE=1; record FAIL "profile.$variant" "the profiled run did not finish"; continue; }
    RECORD_TRAIN_FAILURE=1
    trace=$(find "$RUNS/profile_$variant" -name 'rank0_trace.json' | sort | tail -1)
    if [[ -z "$trace" ]] || ! "$PYTHON" "$ROOT/bench/trace_kernels.py" "$trace" --label "8B x 4 layers, $variant, one step" \
        >"$REPORT_DIR/profile_$variant.txt" 2>&1; then
      record FAIL "profile.$variant" "no kernel summary: $(tail -1 "$REPORT_DIR/profile_$variant.txt" 2>/dev/null)"
      continue
    fi
    figure "profile.$variant" "$(head -1 "$REPORT_DIR/profile_$variant.txt")"
  done
  # The bf16 step's memory, for the start-up estimate (docs/plan.md): the caching allocator's history over 5 steps
  # (profiling.enable_memory_snapshot), its peak and the blocks live then (memory_peak.txt); the snapshot itself,
  # compressed, travels in gpu_logs.tar.gz.
  within_budget profile.memory 60 || return
  args=(--model.flavor 8B --model.n_layers 4 "${data[@]}" --training.seq_len 8192 --training.local_batch_size 1
        --training.steps 5 --metrics.log_freq 1 --activation_checkpoint.mode selective --optimizer.lr 3e-4
        --lr_scheduler.warmup_steps 5 --profiling.enable_memory_snapshot --profiling.profile_freq 5)
  # At most 2 minutes: the snapshot's C++ stacks are symbolised when it is written, which can be slow.
  RECORD_TRAIN_FAILURE=0
  if ! TRAIN_TIMEOUT=120 train profile_memory "${args[@]}"; then
    RECORD_TRAIN_FAILURE=1
    record FAIL profile.memory "the run with a memory snapshot did not finish within 120 s (see train-profile_memory.log)"
    return
  fi
  RECORD_TRAIN_FAILURE=1
  local snapshot
  snapshot=$(find "$RUNS/profile_memory" -name 'rank0_memory_snapshot.pickle' | sort | tail -1)
  if [[ -z "$snapshot" ]]; then record FAIL profile.memory "no memory snapshot written"; return; fi
  record PASS profile.memory "a memory snapshot written ($(du -h "$snapshot" | cut -f1))"
  gzip -c "$snapshot" >"$LOGS/memory_snapshot_8B_4_layers_bf16.pickle.gz"
  if "$PYTHON" "$ROOT/bench/memory_snapshot_peak.py" "$snapshot" >"$REPORT_DIR/memory_peak.txt" 2>&1; then
    figure profile.memory "$(head -1 "$REPORT_DIR/memory_peak.txt")"
  else
    figure profile.memory "not summarised: $(tail -1 "$REPORT_DIR/memory_peak.txt")"
  fi
}

run_generate() {
  local gen=(--checkpoint "$RUNS/resume_full/checkpoint/step-10" --max-new-tokens 24 --temperature 0 --ignore-eos --json
             --prompt "def main(" --prompt "import os")
  local gpu=cuda
  [[ "$DRY_RUN" == 1 ]] && gpu=cpu
  say "titan generate on $gpu and on the CPU"
  local dtype ok=1
  for run in "$gpu float32" "cpu float32" "$gpu bfloat16"; do
    read -r device dtype <<<"$run"
    if ! (cd "$RUNS" && timeout 120 "${RUN_ENV[@]}" "$BIN/titan" generate "${gen[@]}" --device "$device" --dtype "$dtype") \
        >"$LOGS/generate-$device-$dtype.json" 2>"$LOGS/generate-$device-$dtype.log"; then
      record FAIL "cli.generate.$device.$dtype" "titan generate failed: $(grep -E 'error|Error|what\(\)' "$LOGS/generate-$device-$dtype.log" | head -2 | tr '\n' ' ')"
      ok=0
      continue
    fi
    figure "cli.generate.$device.$dtype" "$(grep -m1 -o 'generated .*tokens/s' "$LOGS/generate-$device-$dtype.log")"
  done
  ((ok)) || return
  # Greedy tokens equal where the CPU's two best logits are not near-tied, log-probabilities within 5e-3 (TF32 or
  # reduction order on the GPU).
  local verdict
  verdict=$("$PYTHON" - "$LOGS/generate-$gpu-float32.json" "$LOGS/generate-cpu-float32.json" <<'EOF'
import json, sys
gpu, cpu = ([json.loads(line) for line in open(path)] for path in sys.argv[1:3])
worst, same = 0.0, 0
for g, c in zip(gpu, cpu):
    for a, b, la, lb in zip(g["ids"], c["ids"], g["logprobs"], c["logprobs"]):
        if a != b:
            break
        same += 1
        worst = max(worst, abs(la - lb))
total = sum(len(c["ids"]) for c in cpu)
print(f"{'PASS' if same == total and worst < 5e-3 else 'FAIL'} {same} of {total} tokens equal, log-probabilities within {worst:.2e}")
EOF
)
  record "${verdict%% *}" cli.generate.gpu_equals_cpu "${verdict#* }"
}

run_bench() {  # run_bench name local_batch "AC description" args...: tokens/s, MFU and memory as figures; half the batch on OOM
  local bench_name=$1 batch=$2 ac=$3
  shift 3
  local bench=("$@" --training.local_batch_size "$batch")
  local bench_ok=0
  within_budget "cli.$bench_name" 90 || return
  RECORD_TRAIN_FAILURE=0
  train "$bench_name" "${bench[@]}" && bench_ok=1
  RECORD_TRAIN_FAILURE=1
  if ((!bench_ok)) && grep -qi 'out of memory' "$LOGS/train-$bench_name.log" && ((batch > 1)); then
    # The figure is the point: say that the batch did not fit, and measure half of it.
    figure "cli.$bench_name.out_of_memory_at_local_batch" "$batch"
    bench_name="${bench_name}_half_batch"
    bench+=(--training.local_batch_size "$((batch / 2))")
    within_budget "cli.$bench_name" 90 && train "$bench_name" "${bench[@]}" && bench_ok=1
  elif ((!bench_ok)); then
    record FAIL "cli.$bench_name" "titan train did not finish; see $LOGS/train-$bench_name.log"
  fi
  if ((bench_ok)); then
    checker memory "$LOGS/train-$bench_name.log" --name "cli.$bench_name.memory_field"
    checker throughput "$LOGS/train-$bench_name.log" --name "cli.$bench_name" --skip 5
    figure "cli.$bench_name.setting" "$(grep -m1 -o 'Model llama3 .*' "$LOGS/train-$bench_name.log"); bf16 autocast, $(grep -m1 -o 'local batch [^,]*' "$LOGS/train-$bench_name.log"), $ac, one device"
  fi
}

if ((run_checks)) && [[ -x "$BIN/titan" && "${TITAN_GPU_SKIP_CLI:-0}" != 1 ]] && ! grep -qE '^FAIL build\.(configure|titan):' "$RESULTS"; then
  run_cli
fi

# --- titan's CUDA kernels against their ATen compositions (bench/bench_kernels.cpp): figures only ------------------
run_kernel_bench() {
  if [[ "$DRY_RUN" == 1 ]]; then
    record SKIP bench.kernels "dry run: on a CPU this is titan_bench_kernels without --device (minutes), not run here"
    return
  fi
  if grep -qE '^FAIL build\.(configure|titan_bench_kernels):' "$RESULTS"; then return; fi  # already failed, named
  if [[ ! -x "$BIN/titan_bench_kernels" ]]; then
    record SKIP bench.kernels "no $BIN/titan_bench_kernels (a build folder from before it existed? cmake --build $BUILD --target titan_bench_kernels)"
    return
  fi
  within_budget bench.kernels 60 || return
  local limit=240 spent=$(( $(date +%s) - START ))
  if [[ "$TIME_BUDGET" -gt 0 ]] && ((TIME_BUDGET - spent - 5 < limit)); then limit=$((TIME_BUDGET - spent - 5)); fi
  # The benchmark runs the first-call checks strict: a kernel that disagrees with ATen fails it (no ATen-vs-ATen figures).
  if ! timeout "$limit" "${RUN_ENV[@]}" "$BIN/titan_bench_kernels" --device cuda --repeats 5 >"$LOGS/bench-kernels.log" 2>&1; then
    record FAIL bench.kernels "titan_bench_kernels --device cuda failed or ran past ${limit}s: $(tail -1 "$LOGS/bench-kernels.log")"
    return
  fi
  record PASS bench.kernels "ran (times are figures, never a verdict)"
  local line name
  while IFS= read -r line; do
    name=$(sed -E 's/ +fused .*//' <<<"$line")
    figure "kernels.$name" "$(sed -E 's/^.* +(fused )/\1/; s/ +/ /g' <<<"$line")"
  done < <(grep 'ATen/fused' "$LOGS/bench-kernels.log")
  grep '^first-call check' "$LOGS/bench-kernels.log" || true
}
((run_checks)) && run_kernel_bench

# --- titan's CUDA kernel tests under compute-sanitizer (memcheck): out-of-bounds and misaligned accesses -------------
run_sanitizer() {
  local filter="${TITAN_GPU_SANITIZE_FILTER:-GpuKernels.*}"
  if [[ "$DRY_RUN" == 1 ]]; then
    record SKIP sanitize.memcheck "dry run: compute-sanitizer needs a GPU"
    return
  fi
  local sanitizer
  sanitizer=$(command -v compute-sanitizer || ls "$(dirname "${NVCC:-/usr/local/cuda/bin/nvcc}")/compute-sanitizer" 2>/dev/null ||
              ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [[ -z "$sanitizer" ]]; then
    record SKIP sanitize.memcheck "compute-sanitizer is not on this machine (it ships with the CUDA toolkit)"
    return
  fi
  [[ -x "$BIN/titan_gpu_tests" ]] || { record SKIP sanitize.memcheck "no $BIN/titan_gpu_tests"; return; }
  within_budget sanitize.memcheck 120 || return
  local limit=300 spent=$(( $(date +%s) - START ))
  if [[ "$TIME_BUDGET" -gt 0 ]] && ((TIME_BUDGET - spent - 5 < limit)); then limit=$((TIME_BUDGET - spent - 5)); fi
  say "compute-sanitizer memcheck: titan_gpu_tests --gtest_filter=$filter (at most ${limit}s)"
  local t0=$SECONDS rc
  timeout "$limit" "${RUN_ENV[@]}" "$sanitizer" --tool memcheck --error-exitcode 86 --print-limit 20 \
    "$BIN/titan_gpu_tests" --gtest_filter="$filter" >"$LOGS/sanitize-memcheck.log" 2>&1
  rc=$?
  figure time.sanitize_memcheck_s "$((SECONDS - t0))"
  case $rc in
    0) record PASS sanitize.memcheck "no memory error in $filter ($(grep -c '^\[       OK \]' "$LOGS/sanitize-memcheck.log") tests)" ;;
    86) record FAIL sanitize.memcheck "$(grep -m1 -E 'Invalid|ERROR' "$LOGS/sanitize-memcheck.log") (see $LOGS/sanitize-memcheck.log)" ;;
    124) record SKIP sanitize.memcheck "ran past ${limit}s under memcheck; narrow TITAN_GPU_SANITIZE_FILTER and run --sanitize-only" ;;
    *) record FAIL sanitize.memcheck "exit code $rc: $(grep -v '^\[' "$LOGS/sanitize-memcheck.log" | tail -2 | tr '\n' ' ')" ;;
  esac
}
if ((!build_only)); then run_sanitizer; fi

# --- Summary ----------------------------------------------------------------------------------------------------------
SUMMARY="$REPORT_DIR/gpu_summary.txt"
{
  revision="no git metadata"
  if git -C "$ROOT" rev-parse --short HEAD >/dev/null 2>&1; then
    revision="commit $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- 2>/dev/null || echo ', modified tree')"
  fi
  echo "==== titan.cpp GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $revision ===="
  [[ "$DRY_RUN" == 1 ]] && echo "DRY RUN on the CPU (TITAN_GPU_DRY_RUN=1): checks the script and tests themselves, says nothing of the GPU path"
  if command -v nvidia-smi >/dev/null; then
    echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  fi
  echo "PyTorch $(info version), CUDA $(info cuda), NCCL $(info nccl); $(nproc) cores"
  echo "---- checks ----"
  cat "$RESULTS"
  echo "---- figures ----"
  sed 's/^\[figure\] //' "$FIGURES"
  failed=$(grep -c '^FAIL' "$RESULTS")
  not_run=$(grep -c '^SKIP' "$RESULTS")
  passed=$(grep -c '^PASS' "$RESULTS")
  inapplicable=$(grep -c '^N/A' "$RESULTS")
  counts="$passed passed"
  ((inapplicable)) && counts+=", $inapplicable not applicable to this GPU"
  if ((failed)); then
    echo "VERDICT: FAIL -- $failed failed: $(grep '^FAIL' "$RESULTS" | cut -d: -f1 | cut -c6- | tr '\n' ' ')($counts, $not_run not run)"
  elif ((not_run)); then
    echo "VERDICT: INCOMPLETE -- $not_run not run: $(grep '^SKIP' "$RESULTS" | cut -d: -f1 | cut -c6- | tr '\n' ' ')($counts)"
  elif ((passed == 0)); then
    echo "VERDICT: FAIL -- no check ran"
  else
    echo "VERDICT: PASS -- all $passed checks passed$( ((inapplicable)) && echo " ($inapplicable not applicable to this GPU)")"
  fi
  echo "total time: $(( $(date +%s) - START ))s; logs: $LOGS"
  if ((${#RUN_ENV[@]})); then echo "titan's libraries were unpacked into $DEPS: run its binaries with ${RUN_ENV[*]:1}"; fi
} >"$SUMMARY"
echo
cat "$SUMMARY"
if [[ -n "${OUT:-}" ]]; then
  tar -czf "$OUT/gpu_logs.tar.gz" -C "$BUILD" logs 2>/dev/null
fi
grep -q '^VERDICT: PASS' "$SUMMARY" && exit 0
exit 1
