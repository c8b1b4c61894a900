#!/usr/bin/env bash
# The GPU issue's checks in one go, in its order, each step under its own time limit and
# every log under $OUT, so that a step that times out still leaves what ran before it.
#
#   OUT=/tmp/gpu bash tools/gpu_checks.sh                 # all steps
#   OUT=/tmp/gpu bash tools/gpu_checks.sh tests bench     # some of: env tests bench bench_unfused
#                                                         #   kernels profile kv_dtype pooling
#
# Limits (seconds) can be set with T_TESTS, T_BENCH, T_KERNELS, T_PROFILE.  Wheels of packages the
# GPU machine lacks (gguf, fastapi, pydantic, ...) are installed from .whl/ when present
# (see docs/gpu_notes.md); the machine's own torch and triton are kept.
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
STEPS=${*:-env tests bench kernels}

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

step() {  # name limit command...: run, log, and record rc and seconds in $OUT/steps.txt
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/steps.txt"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
    tail -n 40 "$OUT/$name.log"
}

for s in $STEPS; do
    case $s in
    env)
        { nvidia-smi; "$PY" -c "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, \
triton.__version__, transformers.__version__, torch.cuda.get_device_name()); a = torch.ones(4, 8, device='cuda', \
dtype=torch.bfloat16); print('mm out_dtype float32:', torch.mm(a, a.t(), out_dtype=torch.float32).dtype)"; } >"$OUT/env.log" 2>&1
        head -n 20 "$OUT/env.log" ;;
    tests)
        # The GPU-only tests, the files whose tests run on CUDA when it is there (the engine's
        # device is "auto"), and the tiny models' HF parity in bf16 on CUDA; one pytest per
        # file, so that a CUDA error that poisons one process (a device-side assert is
        # sticky) cannot hide the other files' results.  TEST_FILES overrides the list.
        files=${TEST_FILES:-"tests/layers/test_fused_kernels.py tests/attention/test_triton_backend.py tests/worker/test_cuda_graph.py \
tests/worker/test_kv_sizing.py tests/worker/test_async_output.py tests/e2e/test_overlap_parity.py \
tests/e2e/test_hf_parity.py::test_tiny_models_match_hf_on_cuda_bf16"}
        step tests "${T_TESTS:-240}" bash -c 'for f in $0; do echo "--- $f"; "$1" -m pytest -q -p no:cacheprovider \
            -rfEs --tb=short --timeout 120 -k "not fresh_process and not sm90 and not dry_run and not interpreter" \
            "$f"; done' "$files" "$PY" ;;
    bench)
        # W1 (nano-vllm's bench.py) and W2, CUDA graphs and overlap each on and off.
        step bench_gpu "${T_BENCH:-240}" "$PY" -m pagedserve.benchmarks.bench_gpu \
            --output-json "$OUT/bench_gpu.json" ${BENCH_ARGS:-} ;;
    bench_unfused)
        # The same bench with the layers' torch ops instead of the fused Triton kernels.
        PAGEDSERVE_FUSED_KERNELS=0 step bench_unfused "${T_BENCH_UNFUSED:-120}" "$PY" -m \
            pagedserve.benchmarks.bench_gpu --output-json "$OUT/bench_unfused.json" ${UNFUSED_ARGS:-} ;;
    profile)
        # Where a steady decode step's time goes (host functions, kernels), default config.
        step profile "${T_PROFILE:-60}" "$PY" -m pagedserve.benchmarks.profile_steps --batch 256 --context 700 \
            --steps 20 ;;
    kv_dtype)
        # W2 with CUDA graphs and overlap at each KV-cache dtype the Triton kernels read.
        for kv in ${KV_DTYPES:-auto fp8_e4m3 fp8_e5m2}; do
            step "bench_kv_$kv" "${T_BENCH_KV:-100}" "$PY" -m pagedserve.benchmarks.bench_gpu --configs graphs+overlap \
                --workloads w2 --kv-cache-dtype "$kv" --output-json "$OUT/bench_kv_$kv.json"
        done ;;
    pooling)
        # The pooling runner on CUDA (dummy Qwen3-0.6B weights): embeddings of a batch, finite and unit length.
        step pooling 90 "$PY" -c "from pagedserve import LLM; import torch; llm = LLM('qwen3-0.6b', load_format='dummy', \
runner='pooling', max_model_len=1024); e = torch.tensor([o.outputs.embedding for o in llm.embed([[i + 1] * (5 + 7 * i) \
for i in range(64)], use_tqdm=False)]); print(e.shape, e.norm(dim=-1).min().item(), e.norm(dim=-1).max().item()); \
assert torch.isfinite(e).all() and torch.allclose(e.norm(dim=-1), torch.ones(64), atol=1e-3)" ;;
    kernels)
        step bench_kernels "${T_KERNELS:-60}" "$PY" -m pagedserve.benchmarks.bench_kernels --rep-ms 25 \
            --json "$OUT/kernels.json" ;;
    *) echo "unknown step $s" ;;
    esac
done
