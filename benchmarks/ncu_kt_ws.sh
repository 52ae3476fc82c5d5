#!/usr/bin/env bash
# ncu on the warp-specialised E4M3 keys-as-M kernel at one mla_decode.py shape (default 32 x 65536 keys x 16 heads):
# speed of light, warp states, scheduler and the SASS lines where warps stall (producer against consumer).
#   bash benchmarks/ncu_kt_ws.sh [SHAPE]     # logs under $OUT (or ./ncu_out)
set -u
OUT=${OUT:-$PWD/ncu_out}
mkdir -p "$OUT"
source benchmarks/device_env.sh >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
# DEEPINFER_MLA_KT_WS=1: eager calls too take the TMA-fed kernel (by default it runs only in graphs)
cd benchmarks && DEEPINFER_MLA_KT_WS=1 timeout 200 ncu --clock-control none --kernel-name regex:kt_e4m3_ws --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section SourceCounters python3 mla_decode.py --dtypes fp8_e4m3 --no-peer --reps 1 --shapes "${1:-32x65536x16}" \
    > "$OUT/ncu_kt_ws.log" 2>&1
grep -vE '^\s*$|^==PROF==' "$OUT/ncu_kt_ws.log" | grep -A200 -m1 'kt_e4m3_ws' | head -150
