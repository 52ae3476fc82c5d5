#!/usr/bin/env bash
# One device call that checks and measures the GPU path, logs under $OUT (or ./gpu_suite_out):
#   bash benchmarks/gpu_suite.sh tests   # cuda_sm100 conformance + engine graph, sampler, memory-profile tests
#   bash benchmarks/gpu_suite.sh kernels # + mla_decode, gemm (fp8, grouped), gemm_decode, prefill_attention
#   bash benchmarks/gpu_suite.sh e2e     # + benchmarks/e2e.py with transformers in the same run (~7 min in all)
#   bash benchmarks/gpu_suite.sh pdl     # programmatic dependent launch (on by default): the graph and greedy-
#                                        # equality tests with it, then decode at batch 1 / 32 with and without
#   bash benchmarks/gpu_suite.sh kt-ws   # the TMA-fed E4M3 keys-as-M kernel (DEEPINFER_MLA_KT_WS): its GPU
#                                        # tests, mla_decode.py's 16-head FP8 shapes off / on twice, and e2e V2-Lite
#                                        # FP8 weights + cache, batch 1 / 32, off / on (~6 min)
#   bash benchmarks/gpu_suite.sh ep      # on a multi-GPU kind: the 2-rank NCCL dispatch/combine and EP engine
#                                        # conformance, then benchmarks/ep_comm.py over every GPU (issue 13)
#   bash benchmarks/gpu_suite.sh ep-e2e  # benchmarks/ep_e2e.py: the V2-Lite-shaped model over every GPU (~8 min)
# Each stage writes its own log and prints a short summary; later stages run even if an earlier one fails,
# so one call (device time is budgeted per session) brings back every number it could take.
set -u
OUT=${OUT:-$PWD/gpu_suite_out}
mkdir -p "$OUT"
LEVEL=${1:-tests}
source benchmarks/device_env.sh >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
rev=$(git rev-parse --short HEAD 2>/dev/null || echo "?")
echo "# gpu_suite $LEVEL at $rev, $(date -u '+%Y-%m-%d %H:%M UTC'), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
if [ "$LEVEL" = ep ]; then
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast stays off
    DEEPINFER_TEST_BACKENDS=cuda_sm100 timeout 300 python3 -m pytest -q tests/conformance/test_comm.py \
        tests/moe/test_expert_parallel_backends.py > "$OUT/tests_ep.log" 2>&1
    echo "EP conformance: $(grep -E 'passed|failed' "$OUT/tests_ep.log" | tail -1)"
    grep -E '^FAILED' "$OUT/tests_ep.log" | head -10
    (cd benchmarks && timeout 200 python3 ep_comm.py --tokens 128 4096 --json "$OUT/ep_comm.json" > "$OUT/ep_comm.log" 2>&1
     timeout 120 python3 ep_comm.py --v2-lite --json "$OUT/ep_comm_v2lite.json" > "$OUT/ep_comm_v2lite.log" 2>&1)
    grep -hE '^\||^#|DeepEP' "$OUT/ep_comm.log" "$OUT/ep_comm_v2lite.log"
    exit 0
fi
if [ "$LEVEL" = ep-e2e ]; then
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout 250 python3 benchmarks/ep_e2e.py --phases peer --json "$OUT/ep_peer.json" --timeout 240 > "$OUT/ep_peer.log" 2>&1
    # The default EP mode only (graphs + overlap); `--ep-modes eager graphs` adds the eager engine (~2 min more).
    timeout 330 python3 benchmarks/ep_e2e.py --phases ep eplb --ep-modes graphs --peer-json "$OUT/ep_peer.json" \
        --json "$OUT/ep_e2e.json" --timeout 320 > "$OUT/ep_e2e.log" 2>&1
    echo "ep_e2e (exit $?):"; grep -vE '^\s*$' "$OUT/ep_e2e.log" | grep -vE 'Warning|warn\(' | tail -60
    exit 0
fi
if [ "$LEVEL" = kt-ws ]; then
    DEEPINFER_TEST_BACKENDS=cuda_sm100 timeout 200 python3 -m pytest -q -n 8 tests/conformance/test_attention_kernels.py \
        -k "keys_as_m or e4m3" > "$OUT/tests_kt_ws.log" 2>&1
    echo "keys-as-M tests: $(grep -E 'passed|failed' "$OUT/tests_kt_ws.log" | tail -1)"
    grep -E '^FAILED|Timeout' "$OUT/tests_kt_ws.log" | head -10
    for ws in 0 1 0 1; do
        (cd benchmarks && DEEPINFER_MLA_KT_WS=$ws timeout 120 python3 mla_decode.py --dtypes fp8_e4m3 --no-peer --reps 20 \
            --shapes 128x4096x16,32x65536x16,64x4096x16,1x16384x16,1x1024x16 > "$OUT/mla_kt_ws_$ws.log" 2>&1)
        echo "mla_decode DEEPINFER_MLA_KT_WS=$ws:"; grep -E '^\| fp8' "$OUT/mla_kt_ws_$ws.log" | cut -d'|' -f2-10
    done
    for ws in 0 1; do
        DEEPINFER_MLA_KT_WS=$ws timeout 150 python3 benchmarks/e2e.py --precision fp8 --kv-cache-dtype fp8_e4m3 \
            --batches 1 32 --contexts 1024 --ttft --no-peer > "$OUT/e2e_kt_ws_$ws.log" 2>&1
        echo "e2e DEEPINFER_MLA_KT_WS=$ws:"; grep -E '^==|^\s+[0-9]+\s+[0-9]+ ' "$OUT/e2e_kt_ws_$ws.log" | cut -c1-120
    done
    exit 0
fi
if [ "$LEVEL" = pdl ]; then
    DEEPINFER_PDL=1 DEEPINFER_TEST_BACKENDS=cuda_sm100 timeout 240 python3 -m pytest -q -n 8 \
        tests/engine/test_cuda_graphs.py tests/conformance/test_model_logits.py tests/conformance/test_moe_fused_paths.py \
        > "$OUT/tests_pdl.log" 2>&1
    echo "tests with PDL: $(grep -E 'passed|failed' "$OUT/tests_pdl.log" | tail -1)"
    for pdl in 0 1; do
        DEEPINFER_PDL=$pdl timeout 200 python3 benchmarks/e2e.py --batches 1 32 --contexts 1024 --ttft --no-peer \
            > "$OUT/e2e_pdl$pdl.log" 2>&1
        echo "DEEPINFER_PDL=$pdl:"; grep -E '^==|^\s+[0-9]+\s+[0-9]+ ' "$OUT/e2e_pdl$pdl.log" | cut -c1-120
    done
    exit 0
fi

DEEPINFER_TEST_BACKENDS=cuda_sm100 timeout 300 python3 -m pytest -q -n 8 tests/conformance tests/engine/test_cuda_graphs.py \
    tests/engine/test_sampler.py tests/engine/test_memory_profile.py > "$OUT/tests.log" 2>&1
echo "tests: $(grep -E 'passed|failed' "$OUT/tests.log" | tail -1)"
grep -E '^FAILED' "$OUT/tests.log" | head -10
[ "$LEVEL" = tests ] && exit 0

(cd benchmarks && timeout 200 python3 mla_decode.py --reps 20 --json "$OUT/mla.json" > "$OUT/mla.log" 2>&1)
echo "mla_decode:"; grep -E '^\| (bf16|fp8)' "$OUT/mla.log" | cut -d'|' -f2-11
(cd benchmarks && timeout 240 python3 gemm.py --sections fp8,grouped --budget 200 --out "$OUT" > "$OUT/gemm.log" 2>&1)
echo "gemm:"; grep -E '^\| (4096|64|128) ' "$OUT/gemm.log" | cut -c1-160
(cd benchmarks && timeout 120 python3 gemm_decode.py --budget 90 --json "$OUT/gemm_decode.json" > "$OUT/gemm_decode.log" 2>&1)
echo "gemm_decode:"; grep -E '^\| B=' "$OUT/gemm_decode.log" | cut -c1-160
(cd benchmarks && timeout 120 python3 prefill_attention.py --chunks 16384x32768,4000x8000 > "$OUT/prefill.log" 2>&1)
echo "prefill attention:"; grep -E 'ours|flash' "$OUT/prefill.log" | cut -c1-150
[ "$LEVEL" = kernels ] && exit 0

timeout 560 python3 benchmarks/e2e.py --max-prefill-tokens 600000 --json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e:"; grep -E 'transformers generate|==|^\s+[0-9]+\s+[0-9]+ |time to first' "$OUT/e2e.log" | cut -c1-200
