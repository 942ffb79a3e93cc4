#!/usr/bin/env bash
# Every GPU check in one go (under 10 minutes on one GPU, each part under its own time limit): tests/gpu, then decode speed against HF at 256 and
# 4k context (Qwen2.5-0.5B shape, bf16; one and four chats decoded together; eager, then with the compiled step) and KV bytes / speed of the sliding-window shapes (Gemma 3 1B,
# gpt-oss-20b attention). Figures land in $OUT (default out/gpu): gpu-figures.jsonl, bench-*.json, logs.
#
# A GPU machine without the project's pins: put wheels of transformers 5.24 and bitsandbytes in .whl/ and
# a copy of stories260K in .gpu/stories260K; they are installed to /tmp/site and used from there.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "could not install .whl/"; exit 3; }
  export PYTHONPATH=/tmp/site
fi
[ -d .gpu/stories260K ] && export KVSCOPE_STORIES=$PWD/.gpu/stories260K
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export KVSCOPE_GPU_FIGURES=$OUT/gpu-figures.jsonl
: >"$KVSCOPE_GPU_FIGURES"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  $PY -c 'import torch, transformers, bitsandbytes as b; print("torch", torch.__version__, "transformers", transformers.__version__, "bitsandbytes", b.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
} | tee "$OUT/env.txt"

rc=0
timeout 300 $PY -m pytest tests/gpu -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu-tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1

bench() {  # name, seconds, then engine bench arguments
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PY -m engine bench "$@" --device cuda --json "$OUT/bench-$name.json" 2>&1 | tee -a "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
}
bench qwen 150 --shape qwen2.5-0.5b --dtype bfloat16 --contexts 256,4096 --new-tokens 64 --repeats 2 \
  --modes hf-dynamic,contiguous,paged --concurrency 1,4 --eager
bench sliding 75 --shape gemma3-1b --dtype bfloat16 --contexts 4096 --new-tokens 64 --repeats 2 --modes hf-dynamic,paged --eager
bench gptoss 75 --shape gpt-oss-20b-attn --dtype bfloat16 --contexts 4096 --new-tokens 64 --repeats 2 --modes hf-dynamic,paged --eager
# last, so a slow first compile cuts only itself: the paged rows with the compiled decode step (engine.model.fast_step)
bench compiled 120 --shape qwen2.5-0.5b --dtype bfloat16 --contexts 256,4096 --new-tokens 64 --modes hf-dynamic,paged
exit $rc
