#!/bin/bash
# The GPU tests on a lent CUDA machine with no package index (benchmarks/RESULTS.md, "GPU"):
# installs the bundle tests/scripts/gpu_bundle.py made (BUNDLE, default .devkit) into the
# machine's Python, builds agentkv there, runs tests/gpu and the architectures on the GPU,
# then `agentkv bench gpu` alone on the GPU (BENCH=0 skips it; BENCH_ARGS adds options;
# BENCH_WRAP runs it under a command, e.g. a sampling profiler). TESTS=0 skips the tests,
# ARCH=0 the architectures alone. MLX's compiled CUDA kernels are kept in MLX_PTX_CACHE_DIR:
# a $BUNDLE/ptx.tar.xz is unpacked there first, and PTX_OUT=1 packs it into $OUT after (carry
# it into the bundle for the next lent machine: its first engine start compiles for ~80 s).
# Logs, JUnit files and bench.json go to $OUT (default /tmp/gpu-check).
BUNDLE=${BUNDLE:-.devkit}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
set -x
nvidia-smi -L
PY=${PY:-python3}
SP=$($PY -c "import site; print(site.getsitepackages()[0])")
tar -C "$SP" -xJf "$BUNDLE/site.tar.xz" || exit 1
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}
mkdir -p "$MLX_PTX_CACHE_DIR"
[ -f "$BUNDLE/ptx.tar.xz" ] && tar -C "$MLX_PTX_CACHE_DIR" -xJf "$BUNDLE/ptx.tar.xz"
$PY -m pip wheel -q --no-build-isolation --no-deps -w /tmp/agentkv-wheel . || exit 1
$PY -m pip install -q --no-deps --no-index /tmp/agentkv-wheel/agentkv-*.whl || exit 1
$PY -c "import mlx.core as mx; from agentkv import kernels; print(mx.default_device(), kernels.available_backends())" || exit 1
export AGENTKV_TEST_TOKENIZER=$PWD/$BUNDLE/tokenizer PYTHONUNBUFFERED=1
T="-p no:cacheprovider -v -rfE --tb=short --timeout=${TEST_TIMEOUT:-120} --timeout-method=thread"
# The two runs share the GPU and run side by side; the architectures split over workers
# (first uses of MLX's CUDA kernels compile them, which is CPU work).
if [ "${TESTS:-1}" != 0 ]; then
  timeout ${GPU_LIMIT:-300} $PY -m pytest $T --junitxml="$OUT/gpu.xml" tests/gpu \
    "tests/kernels/test_kernels.py::test_the_same_bodies_compile_as_cuda" > "$OUT/gpu.log" 2>&1 &
  GPU_RUN=$!
  [ "${ARCH:-1}" != 0 ] && timeout ${ARCH_LIMIT:-360} $PY -m pytest $T -n ${ARCH_WORKERS:-6} --junitxml="$OUT/arch.xml" \
    tests/model/test_architectures.py > "$OUT/arch.log" 2>&1 &
  wait $GPU_RUN $!  # not a bare wait: it would also wait for the tee above, which never ends
  tail -c 3000 "$OUT/gpu.log"
  tail -c 4000 "$OUT/arch.log"
fi
if [ "${BENCH:-1}" != 0 ]; then
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  timeout ${BENCH_LIMIT:-600} $BENCH_WRAP $PY -c "import sys; from agentkv.cli.main import main; sys.exit(main())" \
    bench gpu --json --tokenizer "$BUNDLE/tokenizer" $BENCH_ARGS > "$OUT/bench.json" 2> "$OUT/bench.log"
  echo "bench gpu: exit $?"
  grep -v "^gpu: row" "$OUT/bench.log" | tail -c 3000
fi
if [ "${PTX_OUT:-0}" != 0 ]; then
  tar -C "$MLX_PTX_CACHE_DIR" -cJf "$OUT/ptx.tar.xz" . && ls -l "$OUT/ptx.tar.xz"
fi
