#!/usr/bin/env bash
# Nsight Systems timeline of graphcp prefills.
#
#   profiles/nsys.sh                                  # default workload: python -m graphcp demo --no-compare
#   profiles/nsys.sh python -m graphcp demo --batches 4 --cuda-graph-buckets 64 128 256
#   profiles/nsys.sh python capture/warmup.py ...     # any command; its arguments pass through unchanged
#
# Collection starts at the first `prefill` NVTX range of the `graphcp` domain (model loading and graph
# capture are skipped) and, by default, stops when that range ends. Rank processes started by the engine
# are followed. Kernels inside CUDA graphs are traced one by one (--cuda-graph-trace=node).
#
# Environment:
#   OUT_DIR          report directory                       (default: profiles/out)
#   NAME             report name                            (default: nsys_<date>_<time>)
#   NVTX_CAPTURE     range@domain that starts collection    (default: prefill@graphcp; "none" = whole run)
#   CAPTURE_END      --capture-range-end value              (default: stop; e.g. repeat:3 for 3 prefills,
#                                                             one report each)
#   NSYS_EXTRA       extra nsys flags, word-split           (default: empty)
#   PYTHON           interpreter of the default workload    (default: python)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
out_dir="${OUT_DIR:-$root/profiles/out}"
name="${NAME:-nsys_$(date +%Y%m%d_%H%M%S)}"
capture="${NVTX_CAPTURE:-prefill@graphcp}"
capture_end="${CAPTURE_END:-stop}"

if ! command -v nsys >/dev/null 2>&1; then
    echo "nsys.sh: 'nsys' (Nsight Systems CLI) is not on PATH." >&2
    echo "  Install Nsight Systems (CUDA toolkit, or https://developer.nvidia.com/nsight-systems) and add its" >&2
    echo "  bin directory to PATH, e.g. export PATH=/opt/nvidia/nsight-systems/<version>/bin:\$PATH" >&2
    echo "  Without a GPU profiler: python -m graphcp profile (torch profiler; see profiles/README.md)." >&2
    exit 127
fi

if [ "$#" -eq 0 ]; then
    set -- "${PYTHON:-python}" -m graphcp demo --no-compare
fi

mkdir -p "$out_dir"
range_flags=()
if [ "$capture" != "none" ]; then
    range_flags=(--capture-range=nvtx "--nvtx-capture=$capture" "--capture-range-end=$capture_end")
fi
# shellcheck disable=SC2206
extra=(${NSYS_EXTRA:-})

echo "nsys.sh: profiling: $*" >&2
echo "nsys.sh: capture range: $capture; report: $out_dir/$name.nsys-rep" >&2
cd "$root"
nsys profile \
    --trace=cuda,nvtx,osrt \
    --cuda-graph-trace=node \
    --sample=none \
    --env-var=NSYS_NVTX_PROFILER_REGISTER_ONLY=0 \
    ${range_flags[@]+"${range_flags[@]}"} \
    --force-overwrite=true \
    --output="$out_dir/$name" \
    ${extra[@]+"${extra[@]}"} \
    "$@"

report="$out_dir/$name.nsys-rep"
if [ -f "$report" ]; then
    # Summaries next to the report: NVTX ranges and GPU kernels (report names of nsys >= 2023.x).
    if nsys stats --report nvtx_sum --report cuda_gpu_kern_sum --format csv \
            --output "$out_dir/$name" --force-export=true "$report" >/dev/null 2>&1; then
        echo "nsys.sh: summaries: $out_dir/${name}_nvtx_sum.csv, $out_dir/${name}_cuda_gpu_kern_sum.csv" >&2
    else
        echo "nsys.sh: 'nsys stats' failed (older nsys?); open the report in the Nsight Systems GUI" >&2
    fi
    echo "nsys.sh: wrote $report" >&2
else
    echo "nsys.sh: no report at $report (did the workload reach a '$capture' range?)" >&2
    ls "$out_dir" | grep "^$name" >&2 || true
fi
