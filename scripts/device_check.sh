#!/usr/bin/env bash
# One prepared GPU check: correctness on CUDA (varlen attention, decode and mixed-step CUDA graphs,
# overlapped scheduling, Qwen3-MoE; tensor parallelism: NCCL at one rank, two ranks sharing the
# GPU over gloo), decode-step timing graphs vs eager, the 256-request workload
# with auto and packed attention, with mixed-step graphs and at Qwen3-30B-A3B's MoE shape,
# embeddings, then the throughput benchmark beside transformers. Uses the machine's python3 with
# torch and transformers; installs nothing except wheels carried in .whl/ (into /tmp/site, first
# on PYTHONPATH): the GPU image's grpcio is older than the committed stubs need, so the served
# tests want grpcio, its health and reflection packages and protobuf as wheels (see
# docs/performance.md, GPU section).
# Without a GPU it runs a CPU fallback so the script itself is tested (with TP 1 against TP 2 on
# gloo at a quick size).
#
#   bash scripts/device_check.sh            # logs and JSON under ${OUT:-/tmp/qil-device-check}
#
# Budget: QIL_CHECK_BUDGET_S (default 470 s, under 8 minutes) for the whole run. Stages run in
# order of importance, each under its own limit cut to what is left of the budget; a stage that
# no longer fits is skipped, and the summary at the end says which ran, failed, timed out or
# were skipped. Only the correctness stages (tests, validate) decide the exit status; benchmark
# outcomes are in the summary. transformers' static batches (hf-static) take longer than a
# stage's limit at these sizes, so they run only with QIL_CHECK_HF_STATIC=1.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/qil-device-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
budget_s="${QIL_CHECK_BUDGET_S:-470}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
status=0
summary=()
model=/tmp/qil-bench-model

# run NAME LIMIT_S KIND LOG FILTER COMMAND...: KIND "check" (its failure fails the script) or
# "bench"; the whole output goes to $out/LOG, the lines matching FILTER (extended regex) to the
# terminal (at most 40).
run() {
    local name=$1 want=$2 kind=$3 log=$4 filter=$5
    shift 5
    echo
    echo "== $name ($(date +%T), ${SECONDS}s of ${budget_s}s used) =="
    local left=$((budget_s - SECONDS))
    if ((left < 20)); then
        echo "skipped: ${left}s of the budget left"
        summary+=("skipped (budget)   $name")
        return 0
    fi
    local limit=$((want < left ? want : left)) rc=0 start=$SECONDS
    timeout -k 10 "$limit" "$@" >"$out/$log" 2>&1 || rc=$?
    grep -E -- "$filter" "$out/$log" | grep -v "Warning\|warn(" | tail -40
    local what="ok"
    if ((rc == 124 || rc == 137)); then
        what="timed out (${limit}s)"
    elif ((rc != 0)); then
        what="failed (exit $rc)"
        tail -5 "$out/$log"
    fi
    summary+=("$(printf '%-18s %4ss  %s' "$what" $((SECONDS - start)) "$name")")
    if [[ $kind == check && $rc != 0 ]]; then status=1; fi
}

if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    run "environment" 60 check environment.log . "$py" -c '
import torch, transformers
from qil_worker.attention import PACKED, PAGED
from qil_worker.attention.names import SEGMENTS
from qil_worker.attention.choice import probe_varlen
print("torch", torch.__version__, "transformers", transformers.__version__, "on", torch.cuda.get_device_name())
for page in (16, 64, 256):
    for mode in (PAGED, PACKED, SEGMENTS):
        why = probe_varlen(torch.device("cuda"), torch.bfloat16, page, 16, 8, 128, mode)
        print(f"varlen attention {mode}, page size {page}:", why or "OK")
import logging; logging.basicConfig(level=logging.INFO)  # the timings of auto (attention.measure)
from qil_worker.attention.choice import auto_choice
for page in (16, 64):
    print(f"auto attention, page size {page}:", auto_choice(torch.device("cuda"), torch.bfloat16, page, 16, 8, 128))'
    # the page size the paged varlen kernel accepts (if any) is used for the benchmarks
    page=$(timeout 120 "$py" -c '
import torch
from qil_worker.attention.choice import probe_varlen
ok = [p for p in (16, 64, 256) if probe_varlen(torch.device("cuda"), torch.bfloat16, p, 16, 8, 128) is None]
print(ok[0] if ok else 16)' 2>/dev/null || echo 16)
    echo "benchmark page size: $page"
    packed=$(timeout 120 "$py" -c '
import torch
from qil_worker.attention import PACKED
from qil_worker.attention.choice import probe_varlen
print(probe_varlen(torch.device("cuda"), torch.bfloat16, '"$page"', 16, 8, 128, PACKED) or "ok")' 2>/dev/null || echo "probe failed")
    echo "packed varlen attention: $packed"

    run "engine tests on CUDA" 200 check tests.log "passed|failed|error|skipped|available|^FAILED" \
        env QIL_TEST_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider -s -rs \
        tests/engine/test_gpu.py tests/engine/runner/test_decode_graphs.py tests/model/test_model_logits.py \
        tests/engine/test_engine_generate.py tests/engine/test_engine_sampling.py tests/kv/test_prefix_cache.py \
        tests/engine/test_overlap.py tests/engine/runner/test_step_graphs.py tests/model/test_moe.py \
        tests/attention/test_varlen_pages.py
    # NCCL at world size 1 (collectives, an engine through the group); TP 2 on this one GPU over
    # gloo (NCCL refuses two ranks on one device) against TP 1's tokens
    run "tensor parallelism on CUDA" 90 check tests_tp.log "passed|failed|error|skipped|refuses|^FAILED" \
        env QIL_TEST_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider -s -rs tests/parallel/test_tensor_parallel_cuda.py
    run "0.6B-shaped model" 90 check model.log . "$py" -c '
import sys; sys.path.insert(0, "scripts")
from pathlib import Path
from bench_engine import FULL_SHAPE, ensure_model
ensure_model(Path("'"$model"'"), FULL_SHAPE)
print("model ready")'
    run "validate (0.6B shape, bf16, page size 16)" 90 check validate.log "." \
        "$py" scripts/validate.py --model "$model" --device cuda --dtype bfloat16 \
        --output "$out/validate_bf16.json"

    throughput() {  # throughput NAME LIMIT LOG ARGS...: bench_throughput.py on the GPU sizes
        local name=$1 limit=$2 log=$3
        shift 3
        run "$name" "$limit" bench "$log" "^\[|workload|prefix cache|failed|Error" \
            "$py" scripts/bench_throughput.py --device cuda --model-dir "$model" --page-size "$page" \
            --token-budget 4096 --prefill-chunk 2048 "$@"
    }
    # the standard workload: auto (overlapped scheduling, the CUDA default), then A/Bs
    throughput "throughput: 256 requests, prompt/output 100-1024, bf16 — qil alone" 90 throughput_256.log \
        --systems qil --json "$out/throughput_256.json"
    # auto's attention against the packed gather (torch builds without a block table: the
    # page-by-page decode of varlen-pages where auto timed it faster)
    throughput "throughput: 256 requests as above — qil with --attention varlen-packed" 90 \
        throughput_256_packed.log --systems qil --attention varlen-packed --json "$out/throughput_256_packed.json"
    # steps with prefill chunks from graphs, opt-in (varlen backends only; graph_mixed_steps in the JSON)
    throughput "throughput: 256 requests as above — qil with --step-graphs" 90 throughput_256_step_graphs.log \
        --systems qil --step-graphs --json "$out/throughput_256_step_graphs.json"
    run "decode step: CUDA graphs vs eager (page size $page)" 90 bench decode_step.log "." \
        "$py" scripts/bench_decode_step.py --model-dir "$model" --device cuda --page-size "$page" \
        --batch 1 8 64 256
    # where a 256-row step with the workload's spread of contexts spends the device's time: the
    # attention backends side by side, then a profile by kernel (the packed path gathers keys)
    if [ "$packed" = ok ]; then
        # page by page reads fewer, longer runs with larger pages: both sides at page size 128
        run "decode step: packed varlen vs page by page (graphs, page size 128), prompts 100-2000, profile" 120 \
            bench decode_step_packed.log "." \
            "$py" scripts/bench_decode_step.py --model-dir "$model" --device cuda --page-size 128 \
            --attention varlen-packed varlen-pages --prompt-len 100 2000 --batch 64 256 --steps 10 --profile 3
    fi
    # Qwen3-MoE at Qwen3-30B-A3B's shape (random weights drawn in GPU memory: the 61 GB
    # checkpoint would not fit the disk); graphs / graph_decode_steps in the JSON say whether
    # the grouped expert kernel was captured
    throughput "MoE: 256 requests as above, random Qwen3-30B-A3B shape, bf16 — qil" 150 throughput_256_moe.log \
        --systems qil --random-shape qwen3-30b-a3b --json "$out/throughput_256_moe.json"
    # embeddings: prefill-only pooled requests through the same scheduler, beside transformers'
    # Qwen3Model with the same last-token pooling (the model's LM head is unused)
    run "embeddings: 256 texts of 32-512 tokens, bf16 — qil vs transformers" 90 bench embed.log \
        "round|ratio|cosine|^\||Error" \
        "$py" scripts/bench_embed.py --device cuda --model-dir "$model" --batch 64 --token-budget 4096 --rounds 2
    # transformers needs minutes for 256 such requests (longer than a stage may take), so the
    # side by side runs the same distribution with 64 requests.
    throughput "side by side: 64 requests, prompt/output 100-1024, bf16 — qil" 90 throughput_64_qil.log \
        --requests 64 --systems qil --json "$out/throughput_64_qil.json"
    throughput "side by side: 64 requests as above — hf-continuous" 150 throughput_64_hf.log \
        --requests 64 --hf-batch 64 --systems hf-continuous --json "$out/throughput_64_hf-continuous.json"
    # a burst sharing a 512-token system prefix: with a 4096-token budget the first step admits
    # many of them, which share the prefix pages being filled in that same step
    throughput "prefix-heavy: 64 requests, +512 shared — qil without, with a cold and a warm cache" 120 \
        throughput_prefix.log --requests 64 --prefix-heavy --systems qil --json "$out/throughput_prefix.json"
    if [ "${QIL_CHECK_HF_STATIC:-0}" = 1 ]; then
        throughput "side by side: 64 requests as above — hf-static" 150 throughput_64_hf_static.log \
            --requests 64 --hf-batch 64 --systems hf-static --json "$out/throughput_64_hf-static.json"
    fi
else
    echo "no CUDA device: CPU fallback (quick sizes)"
    run "engine tests (CPU)" 300 check tests.log "passed|failed|error" \
        "$py" -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/runner/test_decode_graphs.py \
        tests/engine/runner/test_step_graphs.py tests/model/test_model_logits.py
    run "decode step (quick)" 120 bench decode_step.log "." \
        "$py" scripts/bench_decode_step.py --quick --batch 1 8 --steps 5
    run "tensor parallelism (quick, gloo): TP 1 vs TP 2" 120 bench tp.log "^model|^TP|Error" \
        "$py" scripts/bench_tp.py --quick --tp 1 2
    run "throughput (quick)" 300 bench throughput.log "^\[|workload|Error" \
        "$py" scripts/bench_throughput.py --quick --dtype float32 --json "$out/throughput.json"
    run "prefix-heavy (quick)" 120 bench throughput_prefix.log "^\[|prefix cache|Error" \
        "$py" scripts/bench_throughput.py --quick --dtype float32 --prefix-heavy --systems qil
    run "embeddings (quick)" 120 bench embed.log "ratio|cosine|Error" \
        "$py" scripts/bench_embed.py --quick --dtype float32 --threads 1
    run "MoE throughput (quick, random shape in memory)" 120 bench throughput_moe.log "^\[|workload|Error" \
        "$py" scripts/bench_throughput.py --quick --random-shape moe-quick --systems qil --dtype float32
fi
echo
echo "== throughput reports =="
"$py" scripts/throughput_table.py "$out" || true
echo
echo "== summary (${SECONDS}s; logs in $out) =="
printf '%s\n' "${summary[@]}"
echo "status $status"
exit $status
