#!/usr/bin/env bash
# The GPU check: distload's GPU load paths on a ~16 GB synthetic bf16 checkpoint, read from /dev/shm
# and from disk (cold cache), next to plain safetensors; host memory within Run:ai's memory_limit;
# weight sync over NCCL with 2+ GPUs, and between two jobs into device tensors.
#
#   bash benchmarks/gpu_check.sh                          # one H200: 4-6 minutes, disk speed decides (limit 8)
#   bash benchmarks/gpu_check.sh --gpus N                 # and the multi-process matrix on N GPUs (step 6)
#   GPU_CHECK_PLAN=1 bash benchmarks/gpu_check.sh [--gpus N]  # the plan, for 1 GPU and for N; no GPU needed
#   GPU_CHECK_CPU_SMOKE=1 bash benchmarks/gpu_check.sh    # no GPU: the same steps, 8 MiB, --device cpu
#
# Python packages it needs; a GPU machine may lack those marked *. There is no internet there: a
# missing one is installed with pip only from the wheels in $GPU_CHECK_WHEELS (default
# vendor/wheels, not in the checkout: bring it), otherwise the script stops NOT READY (exit 2)
# with the pip download command that fills it. torch must already be a CUDA build (never
# installed here); distload is imported from this checkout (run from anywhere).
#   torch  safetensors>=0.4.3  numpy  psutil  tqdm  humanize *  runai-model-streamer==0.17.1 *  instanttensor==0.2.2 *
#   crc32c-rs==0.0.7 *
# (humanize is Run:ai 0.17.1's own dependency: Requires-Dist in its METADATA.) vLLM's GPU build is
# used where it is installed (GPU_CHECK_VLLM=1: required).
#
# Settings (environment, defaults in brackets): GPU_CHECK_SIZE_MIB [15000], GPU_CHECK_FORMATS
# [safetensors instanttensor auto runai_streamer; safetensors first: the baseline],
# GPU_CHECK_PEERS [fastsafetensors: other loaders timed beside distload's, read straight onto the
# device, their digests checked too; one not installed is reported as such, not failed],
# GPU_CHECK_LOCATIONS [shm disk], GPU_CHECK_SHM_DIR [/dev/shm], GPU_CHECK_DISK_DIR [/var/tmp],
# GPU_CHECK_CASE_TIMEOUT [240 s per load], GPU_CHECK_SYNC_RANKS [the GPU count; 0 skips],
# GPU_CHECK_MEMORY_LIMIT_MIB [1024; Run:ai's memory_limit in the host-memory bound check],
# GPU_CHECK_RSS_OVERHEAD_MIB [512; what that check allows beyond the limit],
# GPU_CHECK_REPORT_DIR [unset: reports deleted], PYTHON [python3].
# Exit status: 0 every path loaded onto the device, every digest agrees and Run:ai's host memory
# stayed within memory_limit plus the stated overhead; 1 otherwise; 2 the machine is not ready (a
# package, CUDA or space missing).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
START=$SECONDS
MATRIX_GPUS=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --gpus) MATRIX_GPUS="${2:-}"; shift 2 ;;
        --gpus=*) MATRIX_GPUS="${1#--gpus=}"; shift ;;
        *) echo "gpu_check.sh: unknown argument '$1' (--gpus N)"; exit 2 ;;
    esac
done
[[ "$MATRIX_GPUS" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: --gpus takes a GPU count, got '$MATRIX_GPUS'"; exit 2; }

# The GPU paths each step runs (design/GPU_REVIEW.md's findings in brackets), for G GPUs.
plan() {
    local g="$1"
    echo "plan for $g GPU(s):"
    echo "  1. ready: packages (wheels in \$GPU_CHECK_WHEELS), CUDA, disk space; a small /dev/shm only skips the shm reads"
    echo "  3. one process onto cuda:0, from /dev/shm and disk: safetensors, instanttensor (alone), auto, runai_streamer (to the device, alone), fastsafetensors"
    echo "  4b. Run:ai's host memory within memory_limit"
    echo "  6a. reload_into and WeightSleeper on cuda:0: sleep gives the memory to the driver, level 1 wakes with the values [13]"
    echo "      auto with a TP place of 1: pread onto the device (step 3's auto is InstantTensor where it is installed) [11]"
    echo "  6b. weight sync between two jobs on the device (the third version a delta, compared on the GPU), then with the trainer SIGKILLed mid-update: SyncError, the receiver lives [1, 2, 16]"
    if [[ "$g" -lt 2 ]]; then
        echo "      both jobs on one GPU: the pairs use gloo (NCCL refuses one GPU twice) [7]"
        echo "  6c. vLLM --load-format distload on the GPU (where vLLM is installed)"
        echo "  (--gpus 2 or more adds: weight sync inside a job, instanttensor-group, runai-distributed, shared reads over NCCL, TP loads, gloo data groups, subgroups)"
        return
    fi
    echo "      trainer on GPU 0, inference on GPU 1: NCCL pairs [1, 2, 7, 15, 16]"
    echo "  5. weight sync inside one job: torchrun --nproc-per-node $g sync-demo (NCCL)"
    echo "  6c. vLLM --load-format distload on the GPU, TP $g (where vLLM is installed)"
    echo "  6d. torchrun --nproc-per-node $g, each case a load over the job's NCCL group, digests against safetensors:"
    echo "      instanttensor (instanttensor-group) [8, 11]; runai_streamer {distributed: true} (runai-distributed) [12];"
    echo "      auto {distributed: job} TP $g (pread-shared: shared reads over NCCL, P2P) and safetensors TP $g, peak GPU memory about 1/$g [9];"
    echo "      gloo data group on CUDA: shared read staged through the host, instanttensor refused [3, 4];"
    echo "      subgroup of the first half: the others go on [5]"
    echo "  6e. ranks started by hand, the last SIGKILLed after its first tensor: shared read over NCCL and instanttensor-group end in GroupError within a minute [8, 14]"
}
if [[ "${GPU_CHECK_PLAN:-0}" == 1 ]]; then
    plan 1
    [[ "$MATRIX_GPUS" -ge 2 ]] && plan "$MATRIX_GPUS" || plan 8
    exit 0
fi
if [[ "${GPU_CHECK_CPU_SMOKE:-0}" == 1 ]]; then
    MODE=cpu-smoke DEVICE=cpu EXPECT_DEVICE=cpu
    SIZE_MIB="${GPU_CHECK_SIZE_MIB:-8}"
    FORMATS="${GPU_CHECK_FORMATS:-safetensors auto runai_streamer}"
    PACKAGES="torch=torch safetensors=safetensors numpy=numpy psutil=psutil tqdm=tqdm runai_model_streamer=runai-model-streamer==0.17.1 crc32c_rs=crc32c-rs==0.0.7"
else
    MODE=gpu DEVICE=cuda EXPECT_DEVICE=cuda:0
    SIZE_MIB="${GPU_CHECK_SIZE_MIB:-15000}"
    FORMATS="${GPU_CHECK_FORMATS:-safetensors instanttensor auto runai_streamer}"
    PACKAGES="torch=torch safetensors=safetensors numpy=numpy psutil=psutil tqdm=tqdm humanize=humanize runai_model_streamer=runai-model-streamer==0.17.1 instanttensor=instanttensor==0.2.2 crc32c_rs=crc32c-rs==0.0.7"
fi
PACKAGES="$PACKAGES ${GPU_CHECK_REQUIRE:-}"
LOCATIONS="${GPU_CHECK_LOCATIONS:-shm disk}"
PEERS="${GPU_CHECK_PEERS-fastsafetensors}"
MEMORY_LIMIT_MIB="${GPU_CHECK_MEMORY_LIMIT_MIB:-1024}" RSS_OVERHEAD_MIB="${GPU_CHECK_RSS_OVERHEAD_MIB:-512}"
CASE_TIMEOUT="${GPU_CHECK_CASE_TIMEOUT:-240}"
WHEELS="${GPU_CHECK_WHEELS:-$REPO/vendor/wheels}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT

say() { printf '[gpu_check %3ds] %s\n' $((SECONDS - START)) "$*"; }
not_ready() { say "NOT READY: $*"; exit 2; }

# -- 1. packages, device, space ---------------------------------------------------------------------
for entry in $PACKAGES; do
    module="${entry%%=*}" requirement="${entry#*=}"
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)" && continue
    [[ "$module" == torch ]] && not_ready "Python package torch is missing: install the CUDA build of torch that matches this driver"
    if [[ -d "$WHEELS" ]] && "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$requirement"; then
        say "installed $requirement from $WHEELS"
    else
        pyver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
        not_ready "Python package '$requirement' (import $module) is missing, and no wheel for it in $WHEELS. Fix (no internet here): on a machine with it, run  pip download --only-binary=:all: --python-version $pyver --platform manylinux2014_x86_64 --dest wheels 'runai-model-streamer==0.17.1' humanize 'instanttensor==0.2.2' 'crc32c-rs==0.0.7'  then copy that folder here and rerun with GPU_CHECK_WHEELS=<that folder> (or put it at $WHEELS)"
    fi
done
if [[ "$MODE" == gpu ]]; then
    GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
    [[ "$GPUS" -ge 1 ]] || not_ready "torch sees no CUDA device (torch.cuda.is_available() is False); GPU_CHECK_CPU_SMOKE=1 runs the CPU smoke test"
    [[ "$GPUS" -ge "$MATRIX_GPUS" ]] || not_ready "--gpus $MATRIX_GPUS, but torch sees $GPUS GPU(s) here: run with --gpus $GPUS (or check CUDA_VISIBLE_DEVICES)"
    "$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}")'
    SYNC_RANKS="${GPU_CHECK_SYNC_RANKS:-$MATRIX_GPUS}"
else
    SYNC_RANKS="${GPU_CHECK_SYNC_RANKS:-2}"
fi
SHM_ROOT="${GPU_CHECK_SHM_DIR:-/dev/shm}" DISK_ROOT="${GPU_CHECK_DISK_DIR:-/var/tmp}"
roomy() { (( $(df -Pk "$1" | awk 'NR == 2 {print $4}') / 1024 > SIZE_MIB * 21 / 20 + 64 )); }
roomy "$DISK_ROOT" || not_ready "$DISK_ROOT has too little free space for a $SIZE_MIB MiB checkpoint (set GPU_CHECK_DISK_DIR, or GPU_CHECK_SIZE_MIB lower)"
failed=0
if [[ " $LOCATIONS " == *" shm "* ]] && ! roomy "$SHM_ROOT"; then
    # A container's /dev/shm is 64 MiB unless it was started with --shm-size: the machine, not distload.
    say "NOTE: $SHM_ROOT has too little free space for $SIZE_MIB MiB (df -h $SHM_ROOT; set GPU_CHECK_SHM_DIR, or docker run --shm-size): reading from disk only"
    LOCATIONS="${LOCATIONS//shm/}"
fi

SHM_WORK="" DISK_WORK=""
cleanup() { rm -rf -- "${SHM_WORK:-}" "${DISK_WORK:-}"; }
trap cleanup EXIT
trap 'exit 130' INT TERM
DISK_WORK="$(mktemp -d "$DISK_ROOT/distload-gpu-check.XXXXXX")"
if [[ " $LOCATIONS " == *" shm "* ]]; then
    SHM_WORK="$(mktemp -d "$SHM_ROOT/distload-gpu-check.XXXXXX")" GEN="$SHM_WORK/ckpt"
else
    GEN="$DISK_WORK/ckpt"
fi
mkdir -p "$DISK_WORK/reports"
: > "$DISK_WORK/status.tsv"

# -- 2. a synthetic Llama-shaped bf16 checkpoint (a cheap arange pattern, not randn) -----------------
say "mode $MODE: writing a ~$SIZE_MIB MiB checkpoint to $GEN"
make_ckpt() {
"$PY" - "$1" "$2" <<'EOF'
import json, math, os, sys
import torch
from distload.cli.demo import llama_shapes

folder, size = sys.argv[1], int(sys.argv[2]) * 2**20
big = size >= 2 * 2**30
hidden, vocab = (4096, 32000) if big else (256, 4096)
per_layer = 21 * hidden * hidden  # bytes of one layer's bf16 weights in llama_shapes
layers = max(2, (size - 4 * vocab * hidden) // per_layer)
shapes = [(name, shape) for name, (shape, _) in llama_shapes(hidden, layers, vocab).items()]
numels = [math.prod(shape) for _, shape in shapes]
base = (torch.arange(max(numels), dtype=torch.int32) & 0x3FFF).to(torch.int16)  # finite bf16 bits
num_files = max(2, math.ceil(sum(numels) * 2 / 4e9))  # ~4 GB files, like a Hugging Face checkpoint
per_file = math.ceil(len(shapes) / num_files)
os.makedirs(folder)
weight_map = {}
for f in range(num_files):
    chunk = list(range(f * per_file, min(len(shapes), (f + 1) * per_file)))
    name = f"model-{f + 1:05d}-of-{num_files:05d}.safetensors"
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for i in chunk:
        header[shapes[i][0]] = {"dtype": "BF16", "shape": list(shapes[i][1]), "data_offsets": [offset, offset + 2 * numels[i]]}
        offset += 2 * numels[i]
        weight_map[shapes[i][0]] = name
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(os.path.join(folder, name), "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for i in chunk:
            out.write(memoryview((base[: numels[i]] + (i % 4096)).numpy()))  # distinct per tensor
json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(folder, "model.safetensors.index.json"), "w"))
json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "num_hidden_layers": layers,
           "vocab_size": vocab, "torch_dtype": "bfloat16"}, open(os.path.join(folder, "config.json"), "w"))
print(f"{sum(numels) * 2 / 1e9:.2f} GB in {len(shapes)} tensors, {num_files} files")
EOF
}
make_ckpt "$GEN" "$SIZE_MIB"
if [[ " $LOCATIONS " == *" disk "* && "$GEN" != "$DISK_WORK/ckpt" ]]; then
    say "copying it to $DISK_WORK/ckpt"
    cp -r "$GEN" "$DISK_WORK/ckpt"
    sync -f "$DISK_WORK/ckpt" 2>/dev/null || sync
fi

# Drop the folder's files from the page cache (no root needed), as benchmarks/bench_load.py does.
evict() {
    "$PY" - "$1" <<'EOF'
import os, sys
for name in os.listdir(sys.argv[1]):
    fd = os.open(os.path.join(sys.argv[1], name), os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
EOF
}

# -- 3. every format, from each location, straight onto the device -----------------------------------
for location in $LOCATIONS; do
    case "$location" in
        shm) ckpt="$SHM_WORK/ckpt" ;;
        disk) ckpt="$DISK_WORK/ckpt" ;;
        *) not_ready "GPU_CHECK_LOCATIONS: unknown location '$location' (shm, disk)" ;;
    esac
    for format in $FORMATS; do
        [[ "$location" == disk ]] && evict "$ckpt"
        report="$DISK_WORK/reports/$location-$format.json"
        log="$DISK_WORK/reports/$location-$format.log"
        say "$location: python -m distload load $ckpt --load-format $format --device $DEVICE"
        if timeout "$CASE_TIMEOUT" "$PY" -m distload load "$ckpt" --load-format "$format" --device "$DEVICE" \
                --report-json "$report" --no-progress > "$log" 2>&1; then
            rc=0
        else
            rc=$?
            why="exit $rc"
            [[ $rc == 124 ]] && why="timed out after $CASE_TIMEOUT s"
            say "FAILED ($why): last lines of its output:"
            tail -n 15 "$log" | sed 's/^/    /'
        fi
        printf '%s\t%s\t%s\t%s\n' "$location" "$format" "$rc" "$report" >> "$DISK_WORK/status.tsv"
    done
    # The peers, as benchmarks/bench_load.py runs them on CPUs: fastsafetensors with nogds=True (no
    # GPUDirect Storage assumed), its default threads and bounce buffer, one loader built before the
    # clock (its first construction imports its framework layer). A report in distload's shape.
    for peer in $PEERS; do
        [[ "$location" == disk ]] && evict "$ckpt"
        report="$DISK_WORK/reports/$location-$peer.json"
        if ! "$PY" -c "import $peer" 2>/dev/null; then
            say "$location: $peer is not installed (pip install it, or vendor its wheel in $WHEELS): not timed"
            printf '%s\t%s\t%s\t%s\n' "$location" "$peer" 3 "$report" >> "$DISK_WORK/status.tsv"
            continue
        fi
        say "$location: $peer onto $DEVICE"
        if timeout "$CASE_TIMEOUT" "$PY" - "$ckpt" "$EXPECT_DEVICE" "$report" > "$DISK_WORK/reports/$location-$peer.log" 2>&1 <<'EOF'; then
import glob, json, os, sys, time, warnings
import psutil, torch
from fastsafetensors import SafeTensorsFileLoader, SingleGroup
from distload.loading.report import state_digest
folder, device, out = sys.argv[1:4]
warnings.filterwarnings("ignore")
SafeTensorsFileLoader(SingleGroup(), device, nogds=True).close()
files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
read0, start = psutil.Process().io_counters().read_bytes, time.perf_counter()
loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=True)
loader.add_filenames({0: files})
buffers = loader.copy_files_to_device()
state = {name: buffers.get_tensor(name) for name in loader.get_keys()}
if device.startswith("cuda"):
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
rank = {"nbytes": sum(t.numel() * t.element_size() for t in state.values()), "seconds": seconds,
        "device": str(next(iter(state.values())).device), "path": "fastsafetensors", "num_tensors": len(state),
        "read_bytes": psutil.Process().io_counters().read_bytes - read0,
        "digest": state_digest({n: t.cpu() for n, t in state.items()})}
json.dump({"ranks": [rank]}, open(out, "w"))
EOF
            rc=0
        else
            rc=$?
            say "FAILED ($peer, exit $rc): last lines of its output:"
            tail -n 15 "$DISK_WORK/reports/$location-$peer.log" | sed 's/^/    /'
        fi
        printf '%s\t%s\t%s\t%s\n' "$location" "$peer" "$rc" "$report" >> "$DISK_WORK/status.tsv"
    done
done

# -- 4. the table: GB/s next to plain safetensors, digests that must all agree ------------------------
"$PY" - "$DISK_WORK/status.tsv" "$EXPECT_DEVICE" "$PEERS" <<'EOF' || failed=1
import json, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
expect_device, loads = sys.argv[2], []
# The peers of bench_load's 'vs best peer': plain safetensors (distload's safetensors format is its
# reader, copied to the device), Run:ai, and the GPU_CHECK_PEERS timed above.
peers = {"safetensors", "runai_streamer", *sys.argv[3].split()}
for location, fmt, rc, path in rows:
    load = {"location": location, "format": fmt, "rc": int(rc)}
    if load["rc"] == 0:
        rank = json.load(open(path))["ranks"][0]
        load.update(rank=rank, gbps=rank["nbytes"] / 1e9 / rank["seconds"])
    loads.append(load)
if not loads:
    print("no load ran (GPU_CHECK_FORMATS or GPU_CHECK_LOCATIONS empty?): nothing was checked")
    sys.exit(1)
digests = [l["rank"]["digest"] for l in loads if "rank" in l]
reference = next((l["rank"]["digest"] for l in loads if l["format"] == "safetensors" and "rank" in l),
                 digests[0] if digests else None)
bad = 0
print(f"\n{'location':8} {'format':16} {'path':16} {'device':7} {'s':>7} {'GB/s':>7} {'vs safetensors':>14} "
      f"{'vs best peer':>12} {'read GB':>8} {'cached GB':>9}  {'digest':16}  check")
for l in loads:
    if l["rc"] == 3 and l["format"] in peers:
        print(f"{l['location']:8} {l['format']:16} {'-':16} {'-':7} {'-':>7} {'-':>7} {'-':>14} {'-':>12} {'-':>8} "
              f"{'-':>9}  {'-':16}  not installed")
        continue
    if "rank" not in l:
        bad += 1
        print(f"{l['location']:8} {l['format']:16} {'-':16} {'-':7} {'-':>7} {'-':>7} {'-':>14} {'-':>12} {'-':>8} "
              f"{'-':>9}  {'-':16}  FAILED (exit {l['rc']})")
        continue
    r = l["rank"]
    base = next((m for m in loads if m["location"] == l["location"] and m["format"] == "safetensors" and "rank" in m), None)
    timed = [m for m in loads if m["location"] == l["location"] and m["format"] in peers and "rank" in m]
    best = max(timed, key=lambda m: m["gbps"]) if timed else None
    # Where the pread reader found the bytes (its residency probe), where it says.
    cached = None if r.get("reader_bytes") is None else r["reader_bytes"].get("pread/page-cache", 0)
    check = "ok"
    if r["device"] != expect_device:
        check = f"WRONG DEVICE (wanted {expect_device})"
    elif r["digest"] != reference:
        check = "DIGEST MISMATCH"
    bad += check != "ok"
    print(f"{l['location']:8} {l['format']:16} {r['path']:16} {r['device']:7} {r['seconds']:7.2f} {l['gbps']:7.2f} "
          f"{(l['gbps'] / base['gbps']) if base else float('nan'):13.2f}x "
          f"{(l['gbps'] / best['gbps']) if best else float('nan'):11.2f}x {(r.get('read_bytes') or 0) / 1e9:8.2f} "
          f"{'-' if cached is None else f'{cached / 1e9:.2f}':>9}  "
          f"{r['digest'][:16]}  {check}")
if loads and "rank" in loads[0]:
    print(f"checkpoint: {loads[0]['rank']['nbytes'] / 1e9:.2f} GB, {loads[0]['rank']['num_tensors']} tensors; "
          f"'read GB' is what the process read from storage (cold disk: about the checkpoint); 'cached GB' "
          f"what the pread reader found in the page cache; 'vs best peer' against the fastest of {sorted(peers)}")
sys.exit(1 if bad else 0)
EOF
# -- 4b. host memory bounded by memory_limit: Run:ai's host buffer, next to a load that reads nothing --
# dummy creates the same tensors on the device without reading (CUDA context, torch, the tensors);
# Run:ai with memory_limit may grow the process's peak RSS beyond that by at most the limit plus
# RSS_OVERHEAD_MIB (its threads, the headers, allocator slack).
read -r BOUND_LOCATION _ <<< "$LOCATIONS"
if [[ " $FORMATS " != *" runai_streamer "* ]]; then
    say "host memory bound: skipped (runai_streamer is not in GPU_CHECK_FORMATS)"
elif [[ -n "$BOUND_LOCATION" ]]; then
    [[ "$BOUND_LOCATION" == shm ]] && ckpt="$SHM_WORK/ckpt" || ckpt="$DISK_WORK/ckpt"
    : > "$DISK_WORK/memory.tsv"
    for format in dummy runai_streamer; do
        extra=()
        [[ "$format" == runai_streamer ]] && extra=(--model-loader-extra-config "{\"memory_limit\": $((MEMORY_LIMIT_MIB * 1024 * 1024))}")
        report="$DISK_WORK/reports/memory-$format.json"
        say "$BOUND_LOCATION: python -m distload load $ckpt --load-format $format --device $DEVICE ${extra[*]:-}"
        if timeout "$CASE_TIMEOUT" "$PY" -m distload load "$ckpt" --load-format "$format" --device "$DEVICE" \
                ${extra[@]+"${extra[@]}"} --report-json "$report" --no-progress --no-digest > "$DISK_WORK/memory-$format.log" 2>&1; then
            printf '%s\t%s\n' "$format" "$report" >> "$DISK_WORK/memory.tsv"
        else
            say "FAILED ($format, for the memory bound): last lines of its output:"
            tail -n 15 "$DISK_WORK/memory-$format.log" | sed 's/^/    /'
        fi
    done
    "$PY" - "$DISK_WORK/memory.tsv" "$MEMORY_LIMIT_MIB" "$RSS_OVERHEAD_MIB" <<'EOF' || failed=1
import json, sys
peak = {fmt: json.load(open(path))["ranks"][0].get("peak_rss_bytes") for fmt, path in
        (line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip())}
limit, overhead, mib = int(sys.argv[2]), int(sys.argv[3]), 2**20
if set(peak) != {"dummy", "runai_streamer"}:
    print("host memory bound: FAILED (a load failed, see above)")
    sys.exit(1)
if None in peak.values():
    print("host memory bound: FAILED (the report has no peak_rss_bytes: this OS gave no peak RSS)")
    sys.exit(1)
growth = (peak["runai_streamer"] - peak["dummy"]) / mib
ok = growth <= limit + overhead
print(f"host memory bound: runai_streamer with memory_limit {limit} MiB peaked at {peak['runai_streamer'] / mib:.0f} MiB "
      f"RSS, dummy (no reads) at {peak['dummy'] / mib:.0f} MiB: {growth:.0f} MiB more; bound {limit} + {overhead} MiB: "
      f"{'ok' if ok else 'EXCEEDED'}")
sys.exit(0 if ok else 1)
EOF
fi

if [[ -n "${GPU_CHECK_REPORT_DIR:-}" ]]; then
    mkdir -p "$GPU_CHECK_REPORT_DIR"
    cp "$DISK_WORK"/reports/* "$GPU_CHECK_REPORT_DIR"/
fi

# -- 5. weight sync: rank 0 pushes, the others receive in place (NCCL on GPUs) -----------------------
if [[ "$SYNC_RANKS" -ge 2 ]]; then
    sync_mib="$SIZE_MIB"
    [[ "$MODE" == gpu ]] && sync_mib=1024
    say "weight sync: torchrun --nproc-per-node $SYNC_RANKS -m distload sync-demo --device $DEVICE --size-mib $sync_mib"
    if ! timeout "$CASE_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$SYNC_RANKS" \
            -m distload sync-demo --device "$DEVICE" --size-mib "$sync_mib" > "$DISK_WORK/sync.log" 2>&1; then
        failed=1
        say "weight sync FAILED: last lines of its output:"
        tail -n 15 "$DISK_WORK/sync.log" | sed 's/^/    /'
    else
        grep -E "received version|digest" "$DISK_WORK/sync.log" | sed 's/^/    /'
    fi
else
    say "weight sync: skipped ($SYNC_RANKS GPU(s) here; syncing over NCCL needs 2 or more)"
fi

# -- 5b. weight sync between two jobs: a trainer job on the host, an inference job on the device ------
# Two torchrun commands meeting at a tcp:// address; the inference rank receives into device tensors
# (through host buffers: the trainer is on the host, so the channel runs on gloo), every bucket
# checksummed. NCCL between jobs needs a GPU per rank on each side.
if [[ "$SYNC_RANKS" -ge 1 ]]; then
    sync_mib="$SIZE_MIB"
    [[ "$MODE" == gpu ]] && sync_mib=1024
    port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    say "weight sync across two jobs: trainer --device cpu, inference --device $DEVICE, --verify, $sync_mib MiB"
    timeout "$CASE_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m distload sync-demo \
        --role trainer --rendezvous "tcp://127.0.0.1:$port" --device cpu --size-mib "$sync_mib" --versions 2 --verify \
        > "$DISK_WORK/sync-trainer.log" 2>&1 &
    trainer_pid=$!
    if timeout "$CASE_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m distload sync-demo \
            --role inference --rendezvous "tcp://127.0.0.1:$port" --device "$DEVICE" --size-mib "$sync_mib" \
            --versions 2 > "$DISK_WORK/sync-inference.log" 2>&1 && wait "$trainer_pid"; then
        grep -E "received version|exactly" "$DISK_WORK/sync-inference.log" | sed 's/^/    /'
    else
        failed=1
        wait "$trainer_pid" 2>/dev/null || true
        say "weight sync across two jobs FAILED: last lines of each job's output:"
        tail -n 8 "$DISK_WORK/sync-trainer.log" "$DISK_WORK/sync-inference.log" | sed 's/^/    /'
    fi
else
    say "weight sync across two jobs: skipped (GPU_CHECK_SYNC_RANKS=0)"
fi

# -- 6. the GPU paths one at a time, each with its own checks (benchmarks/gpu_paths.py; the plan above) ---
# A smaller checkpoint: these cases check behaviour, not speed.
MATRIX_MIB="${GPU_CHECK_MATRIX_MIB:-1024}"
[[ "$MODE" == cpu-smoke ]] && MATRIX_MIB="$SIZE_MIB"
PATHS_PY="$REPO/benchmarks/gpu_paths.py"
case_run() {  # case_run NAME COMMAND...: one case, its output kept; a failure is counted and shown
    local name="$1" rc=0; shift
    say "case $name: $*"
    timeout "$CASE_TIMEOUT" "$@" > "$DISK_WORK/case-$name.log" 2>&1 || rc=$?
    if [[ $rc == 0 ]]; then
        grep -E "^CASE " "$DISK_WORK/case-$name.log" | sed 's/^/    /'
    else
        failed=1
        say "case $name FAILED (exit $rc): last lines of its output:"
        grep -vE "^frame #|^Exception raised from|^$" "$DISK_WORK/case-$name.log" | tail -n 15 | sed 's/^/    /'
    fi
}
two_jobs() {  # two_jobs NAME TRAINER_GPU INFERENCE_GPU [kill]: a two-job sync of TWO_JOBS_MIB on the device
    local name="$1" tgpu="$2" igpu="$3" kill="${4:-}" port trainer
    port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    (sleep 1; CUDA_VISIBLE_DEVICES="$tgpu" timeout "$CASE_TIMEOUT" "$PY" "$PATHS_PY" sync-peer trainer \
        "tcp://127.0.0.1:$port" "$TWO_JOBS_MIB" $kill > "$DISK_WORK/case-$name-trainer.log" 2>&1 || true) &
    trainer=$!
    case_run "$name" env CUDA_VISIBLE_DEVICES="$igpu" "$PY" "$PATHS_PY" sync-peer inference "tcp://127.0.0.1:$port" "$TWO_JOBS_MIB" $kill
    wait "$trainer" || true
}
by_hand() {  # by_hand NAME ARGS...: MATRIX_GPUS ranks started without torchrun; the last one kills itself
    local name="$1" port r rc=0; shift
    port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    say "case $name: $MATRIX_GPUS ranks by hand: $*"
    local pids=()
    for ((r = 0; r < MATRIX_GPUS; r++)); do
        RANK=$r WORLD_SIZE=$MATRIX_GPUS LOCAL_RANK=$r LOCAL_WORLD_SIZE=$MATRIX_GPUS MASTER_ADDR=127.0.0.1 \
            MASTER_PORT=$port timeout "$CASE_TIMEOUT" "$PY" "$PATHS_PY" "$@" > "$DISK_WORK/case-$name-$r.log" 2>&1 &
        pids+=($!)
    done
    for ((r = 0; r < MATRIX_GPUS - 1; r++)); do
        wait "${pids[$r]}" || rc=$?
        grep -E "^CASE " "$DISK_WORK/case-$name-$r.log" | sed 's/^/    /'
    done
    wait "${pids[$((MATRIX_GPUS - 1))]}" || true  # the rank that killed itself
    if [[ $rc != 0 ]]; then
        failed=1
        say "case $name FAILED (a surviving rank exited $rc): last lines of rank 0's output:"
        grep -vE "^frame #|^Exception raised from|^$" "$DISK_WORK/case-$name-0.log" | tail -n 15 | sed 's/^/    /'
    fi
}
# 512 MiB on the device; the CPU smoke run checks the driver's kill case only (the trainer dies at
# its first send of version 2, whatever the size): the smoke checkpoint's size.
TWO_JOBS_MIB=512
[[ "$MODE" == cpu-smoke ]] && TWO_JOBS_MIB="$SIZE_MIB"
MATRIX_CKPT="$DISK_WORK/matrix"
if [[ "$MODE" == cpu-smoke ]]; then
    # Without CUDA only the two-job sync with a killed trainer runs (on the host, gloo): the driver is
    # checked. GPU_CHECK_SYNC_RANKS=0 leaves it out with the other syncs.
    if [[ "$SYNC_RANKS" -ge 1 ]]; then
        two_jobs sync-kill "" "" kill
    else
        say "case sync-kill: skipped (GPU_CHECK_SYNC_RANKS=0)"
    fi
else
    say "writing a ~$MATRIX_MIB MiB checkpoint for the GPU path cases to $MATRIX_CKPT"
    make_ckpt "$MATRIX_CKPT" "$MATRIX_MIB"
    case_run reload-sleep "$PY" "$PATHS_PY" reload-sleep "$MATRIX_CKPT"
    # auto picks InstantTensor on a GPU where it is installed (step 3's auto row is InstantTensor's):
    # with a TP place (size 1) it reads with pread, onto the device.
    case_run pread-device "$PY" "$PATHS_PY" load "$MATRIX_CKPT" auto "" 1 pread
    if [[ "$MATRIX_GPUS" -ge 2 ]]; then
        two_jobs sync-two-gpus 0 1
        two_jobs sync-two-gpus-kill 0 1 kill
    else
        two_jobs sync-one-gpu 0 0
        two_jobs sync-one-gpu-kill 0 0 kill
    fi
    if "$PY" -c "import vllm" 2>/dev/null; then
        case_run vllm "$PY" benchmarks/bench_vllm.py --python "$PY" --hidden 1024 --layers 4 --tp "$MATRIX_GPUS" \
            --repeats 1 --out "$DISK_WORK/vllm"
    elif [[ "${GPU_CHECK_VLLM:-0}" == 1 ]]; then
        not_ready "GPU_CHECK_VLLM=1, but vLLM is not importable by $PY: install vLLM's GPU build (pip install vllm, from its wheel) and rerun"
    else
        say "case vllm: NOT RUN (vLLM is not installed for $PY; GPU_CHECK_VLLM=1 makes it required)"
    fi
    if [[ "$MATRIX_GPUS" -ge 2 ]]; then
        torchrun_n=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$MATRIX_GPUS" "$PATHS_PY")
        case_run instanttensor-group "${torchrun_n[@]}" load "$MATRIX_CKPT" instanttensor "" 0 instanttensor-group
        case_run runai-distributed "${torchrun_n[@]}" load "$MATRIX_CKPT" runai_streamer '{"distributed": true}' 0 runai-distributed
        case_run shared-tp "${torchrun_n[@]}" load "$MATRIX_CKPT" auto '{"distributed": "job"}' "$MATRIX_GPUS" pread-shared
        case_run safetensors-tp "${torchrun_n[@]}" load "$MATRIX_CKPT" safetensors "" "$MATRIX_GPUS" safetensors
        case_run gloo-data "${torchrun_n[@]}" gloo-data "$MATRIX_CKPT"
        case_run subgroup "${torchrun_n[@]}" subgroup "$MATRIX_CKPT"
        by_hand load-kill-shared load-kill "$MATRIX_CKPT" auto '{"distributed": "job"}' "$MATRIX_GPUS"
        by_hand load-kill-instanttensor load-kill "$MATRIX_CKPT" instanttensor "" 0
    fi
fi

if [[ "$failed" != 0 ]]; then
    say "FAILED: a path failed, the digests disagree, or host memory exceeded its bound (see above)"
    exit 1
fi
say "OK: every path loaded onto $EXPECT_DEVICE, every digest agrees, host memory within its bound"
