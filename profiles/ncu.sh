#!/usr/bin/env bash
# Nsight Compute kernel profiles of graphcp's attention kernels inside prefill.
#
#   profiles/ncu.sh                                   # default workload: python -m graphcp demo --no-compare
#   profiles/ncu.sh python -m graphcp profile --tp 1 --attn-cp-size 1 --tokens 2048
#
# Only kernels launched inside a `prefill` push/pop range of the NVTX domain `graphcp` are profiled
# (--nvtx-include "graphcp@prefill/": domain@range, the trailing slash selects push/pop ranges), and of
# those only kernels whose name matches KERNEL_REGEX, at most LAUNCH_COUNT launches. Graph kernels are
# profiled node by node. Arguments pass through to the workload unchanged.
#
# Environment:
#   OUT_DIR        report directory                         (default: profiles/out)
#   NAME           report name                              (default: ncu_<date>_<time>)
#   KERNEL_REGEX   kernel name filter (ncu regex)           (default: attn|attention|kv_write)
#   NVTX_INCLUDE   ncu --nvtx-include filter                (default: graphcp@prefill/)
#   SECTION_SET    --set value                              (default: full)
#   LAUNCH_COUNT   kernels to profile                       (default: 6)
#   LAUNCH_SKIP    matching kernels to skip first           (default: 0)
#   NCU_EXTRA      extra ncu flags, word-split              (default: empty)
#   PYTHON         interpreter of the default workload      (default: python)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
out_dir="${OUT_DIR:-$root/profiles/out}"
name="${NAME:-ncu_$(date +%Y%m%d_%H%M%S)}"
kernel_regex="${KERNEL_REGEX:-attn|attention|kv_write}"
nvtx_include="${NVTX_INCLUDE:-graphcp@prefill/}"

if ! command -v ncu >/dev/null 2>&1; then
    echo "ncu.sh: 'ncu' (Nsight Compute CLI) is not on PATH." >&2
    echo "  Install Nsight Compute (CUDA toolkit, or https://developer.nvidia.com/nsight-compute) and add its" >&2
    echo "  directory to PATH, e.g. export PATH=/usr/local/cuda/bin:\$PATH" >&2
    echo "  Performance counters may also need root or NVreg_RestrictProfilingToAdminUsers=0." >&2
    exit 127
fi

if [ "$#" -eq 0 ]; then
    set -- "${PYTHON:-python}" -m graphcp demo --no-compare
fi

mkdir -p "$out_dir"
# shellcheck disable=SC2206
extra=(${NCU_EXTRA:-})

echo "ncu.sh: profiling: $*" >&2
echo "ncu.sh: kernels matching '$kernel_regex' inside NVTX '$nvtx_include'; report: $out_dir/$name.ncu-rep" >&2
cd "$root"
ncu \
    --nvtx --nvtx-include "$nvtx_include" \
    --kernel-name "regex:$kernel_regex" \
    --launch-skip "${LAUNCH_SKIP:-0}" --launch-count "${LAUNCH_COUNT:-6}" \
    --set "${SECTION_SET:-full}" \
    --graph-profiling node \
    --target-processes all \
    --force-overwrite \
    --export "$out_dir/$name" \
    ${extra[@]+"${extra[@]}"} \
    "$@"

report="$out_dir/$name.ncu-rep"
if [ -f "$report" ]; then
    ncu --import "$report" --page details --print-summary per-kernel > "$out_dir/$name.txt" 2>/dev/null \
        && echo "ncu.sh: summary: $out_dir/$name.txt" >&2 || true
    echo "ncu.sh: wrote $report" >&2
else
    echo "ncu.sh: no report at $report: no kernel matched '$kernel_regex' inside '$nvtx_include'" >&2
fi
