#!/usr/bin/env bash
# One prepared GPU check (issue: throughput and memory): correctness on CUDA, then the
# throughput benchmark beside transformers. Installs nothing; uses the machine's python3 with
# torch and transformers. Without a GPU it runs a CPU fallback so the script itself is tested.
#
#   bash scripts/device_check.sh            # writes logs and JSON under ${OUT:-/tmp/qil-device-check}
#
# Budget: under 8 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/qil-device-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
status=0

if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$py" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name())'
    echo "== engine tests on CUDA =="
    QIL_TEST_DEVICE=cuda timeout 240 "$py" -m pytest -q -p no:cacheprovider -s \
        tests/test_gpu.py tests/test_model_logits.py tests/test_engine_generate.py \
        tests/test_engine_sampling.py tests/test_prefix_cache.py 2>&1 | tee "$out/tests.log" | tail -25 || status=1
    echo "== validate (0.6B shape, bf16) =="
    "$py" - <<'PY'
import sys; sys.path.insert(0, "scripts")
from pathlib import Path
from bench_engine import FULL_SHAPE, ensure_model
ensure_model(Path("/tmp/qil-bench-model"), FULL_SHAPE)
PY
    timeout 120 "$py" scripts/validate.py --model /tmp/qil-bench-model --device cuda --dtype bfloat16 \
        --output "$out/validate_bf16.json" 2>&1 | tail -8 || status=1
    echo "== throughput: 256 requests, prompt/output 100-1024, bf16 =="
    timeout 360 "$py" scripts/bench_throughput.py --device cuda --model-dir /tmp/qil-bench-model \
        --hf-batch 64 --json "$out/throughput.json" 2>&1 | grep -v Warning | tee "$out/throughput.log" | tail -12 || status=1
else
    echo "no CUDA device: CPU fallback (quick sizes)"
    timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_model_logits.py 2>&1 | tail -3 || status=1
    timeout 300 "$py" scripts/bench_throughput.py --quick --dtype float32 --json "$out/throughput.json" 2>&1 \
        | grep -v Warning | tail -8 || status=1
fi
exit $status
