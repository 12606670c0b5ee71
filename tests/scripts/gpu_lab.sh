#!/bin/bash
# One lent-GPU call of experiments (tests/scripts/gpu_lab.py): installs as gpu_check.sh does
# (carry .devkit), then the kernel's variants alone, then decode A/Bs of MLX's CUDA graph
# settings, each arm a process of its own, one after another (ARMS: which, by name), then
# (LAB_TESTS=1) tests/gpu. Results: $OUT/lab.jsonl; where a step's build goes: $OUT/build.jsonl.
OUT=${OUT:-/tmp/gpu-lab}
mkdir -p "$OUT"
TESTS=0 BENCH=0 bash tests/scripts/gpu_check.sh > "$OUT/install.log" 2>&1 || exit 1
export MLX_PTX_CACHE_DIR=/tmp/mlx-ptx PYTHONUNBUFFERED=1
LAB="python3 tests/scripts/gpu_lab.py --tokenizer .devkit/tokenizer"
timeout ${KERNEL_LIMIT:-90} $LAB kernel --contexts 1024,8192,32768 | tee -a "$OUT/lab.jsonl"
# where building a decode step's graph goes, per arm (cProfile; rows with "top" are long)
timeout ${BUILD_LIMIT:-60} $LAB build > "$OUT/build.jsonl" 2> /tmp/build.log
cut -c1-400 "$OUT/build.jsonl"; tail -n 2 /tmp/build.log
arm() {  # name, one VAR=value, then the lab's arguments
  local name=$1 setting=$2
  shift 2
  [[ " ${ARMS:-$name} " == *" $name "* ]] || return 0
  echo "== $name"
  env "$setting" timeout ${ARM_LIMIT:-35} $LAB decode "$@" 2> "/tmp/arm-$name.log" | sed "s/^{/{\"env\": \"$name\", /" |
    tee -a "$OUT/lab.jsonl"
  tail -n 2 "/tmp/arm-$name.log"
}
arm default-q4 X=0 --arm q4
arm default-mlx-lm X=0 --arm mlx-lm
arm devindex-q4 AGENTKV_GPU_DEVICE_INDEX=1 --arm q4
arm graph1000-q4 MLX_MAX_OPS_PER_BUFFER=1000 --arm q4
arm opsstore-q4 AGENTKV_GPU_STORE=0 --arm q4
arm opsgather-q4 AGENTKV_GPU_GATHER=0 --arm q4
arm separate-q4 AGENTKV_GPU_JOINT=0 --arm q4
arm noprologue-q4 AGENTKV_GPU_PROLOGUE=0 --arm q4
arm graph1000-mlx-lm MLX_MAX_OPS_PER_BUFFER=1000 --arm mlx-lm
arm nographs-q4 MLX_USE_CUDA_GRAPHS=0 --arm q4
arm default-kv16 X=0 --arm kv16
arm devindex-kv16 AGENTKV_GPU_DEVICE_INDEX=1 --arm kv16
arm nographs-mlx-lm MLX_USE_CUDA_GRAPHS=0 --arm mlx-lm
if [ "${LAB_TESTS:-0}" != 0 ]; then
  export AGENTKV_TEST_TOKENIZER=$PWD/.devkit/tokenizer
  timeout ${GPU_LIMIT:-150} python3 -m pytest -p no:cacheprovider -q -rfE --tb=short tests/gpu \
    "tests/kernels/test_kernels.py::test_the_same_bodies_compile_as_cuda" > "$OUT/gpu-tests.log" 2>&1
  echo "tests/gpu: exit $?"
  tail -c 2500 "$OUT/gpu-tests.log"
fi
