"""The merge / extract kernels (kernels/*.metal) on CPU, bit for bit against the pure-MLX
reference; every kernel body compiled as CUDA where nvcc is installed."""

import shutil
import subprocess

import pytest
from helpers import bits_equal, random_components
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agentkv import kernels
from agentkv.errors import InvalidRequestError
from agentkv.format.quant import V1, KVQuant
from agentkv.kernels import RowSource

formats = st.sampled_from(
    [(4, 4, 32), (4, 4, 64), (4, 4, 128), (8, 8, 64), (8, 4, 64), (4, 16, 64)]
)
head_dims = st.sampled_from([64, 128, 256])


def both(fn):
    with kernels.use_backend("cpu"):
        ours = fn()
    with kernels.use_backend("reference"):
        theirs = fn()
    return ours, theirs


@settings(max_examples=25, deadline=None)
@given(
    fmt=formats, dim=head_dims, heads=st.integers(1, 4), agents=st.integers(1, 8), data=st.data()
)
def test_merge_matches_reference(fmt, dim, heads, agents, data):
    assume(dim % fmt[2] == 0)
    comps = KVQuant(*fmt, **V1).components(heads, dim, dim)
    lengths = data.draw(st.lists(st.integers(0, 700), min_size=agents, max_size=agents))
    caches = [random_components(comps, 1, n + 37, seed=i) for i, n in enumerate(lengths)]
    used = max(lengths)
    capacity = used + data.draw(st.integers(0, 300))
    sources = [RowSource(c, 0, 0, n) for c, n in zip(caches, lengths)]
    ours, theirs = both(lambda: kernels.merge(sources, used=used, capacity=capacity))
    for a, b in zip(ours, theirs):
        assert bits_equal(a, b)
    # and the rows landed where they belong, right-aligned to `used`
    for i, (c, n) in enumerate(zip(caches, lengths)):
        assert bits_equal(ours[0][i : i + 1, :, used - n : used], c[0][:, :, :n])


@settings(max_examples=25, deadline=None)
@given(fmt=formats, dim=head_dims, heads=st.integers(1, 3), rows=st.integers(1, 8), data=st.data())
def test_extract_and_rebatch_match_reference(fmt, dim, heads, rows, data):
    assume(dim % fmt[2] == 0)
    comps = KVQuant(*fmt, **V1).components(heads, dim, dim)
    capacity = data.draw(st.integers(1, 900))
    batch = random_components(comps, rows, capacity, seed=rows)
    row = data.draw(st.integers(0, rows - 1))
    first = data.draw(st.integers(0, capacity - 1))
    length = data.draw(st.integers(0, capacity - first))
    out_capacity = length + data.draw(st.integers(0, 300))
    ours, theirs = both(
        lambda: kernels.extract(batch, row=row, first=first, length=length, capacity=out_capacity)
    )
    for a, b in zip(ours, theirs):
        assert bits_equal(a, b)
    # merge also takes rows of a batch (extend / filter)
    keep = sorted(set(data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows))))
    sources = [RowSource(batch, r, first, length) for r in keep]
    ours, theirs = both(lambda: kernels.merge(sources, used=length, capacity=out_capacity))
    for a, b in zip(ours, theirs):
        assert bits_equal(a, b)


def test_backend_selection():
    assert kernels.backend() == "cpu"
    assert {"cpu", "reference"} <= set(kernels.available_backends())
    with kernels.use_backend("reference"):
        assert kernels.backend() == "reference"
    assert kernels.backend() == "cpu"
    with pytest.raises(InvalidRequestError, match="unknown kernel backend"):
        kernels.set_backend("opencl")
    if "metal" not in kernels.available_backends():
        with pytest.raises(InvalidRequestError, match="not available"):
            kernels.set_backend("metal")


def test_bad_merge_rows_are_refused_not_read_out_of_bounds():
    comps = KVQuant(**V1).components(1, 64, 64)
    cache = random_components(comps, 1, 10, seed=0)
    with pytest.raises(InvalidRequestError):
        kernels.merge([RowSource(cache, 0, 0, 20)], used=10, capacity=20)
    with pytest.raises(ValueError, match="does not fit its source"):
        kernels.merge([RowSource(cache, 0, 5, 8)], used=8, capacity=20)


# As mx.fast.cuda_kernel writes a kernel (mlx/backend/cuda/custom_kernel.cpp): the header,
# then in namespace mlx::core::cu a __global__ function of the inputs and outputs by dtype,
# its template arguments as `using` / `constexpr`, then the preamble and the body.
CUDA_HEADER = """
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
{helpers}
namespace mlx::core::cu {{
template <typename T>
__global__ void merge(const T* src0, const T* src1, const int* rows, const int* dims, T* out) {{
{preamble}const T* srcs[2] = {{src0, src1}};
{merge}
}}
template <typename T>
__global__ void extract(const T* batch, const int* meta, const int* dims, T* out) {{
{preamble}{extract}
}}
template __global__ void merge<uint32_t>(const uint32_t*, const uint32_t*, const int*, const int*,
                                         uint32_t*);
template __global__ void extract<uint16_t>(const uint16_t*, const int*, const int*, uint16_t*);
"""
CUDA_PAGED = """
__global__ void paged_attention_{n}(const {q}* q_in, const uint32_t* kw, const __half* ks,
    const __half* kb, const uint32_t* vw, const __half* vs, const __half* vb,
    const int32_t* tables, const int32_t* lengths, const int32_t* dims, const float* sinks,
    const float* scale, const __half* tail, const int32_t* tail_slots, const __half* done,
    const int32_t* done_first, {t}* out, float* stats) {{
  using T = {t};
  constexpr int NQ = {nq};
  constexpr int KL = {kl};
  constexpr int TG = 128;
  constexpr int KU = {ku};
{group_ids}{body}
}}
__global__ void paged_attention_merge_{n}(const float* parts, const float* stats,
    const float* sinks, const int32_t* dims, {t}* out) {{
  using T = {t};
{preamble}{merge}
}}
"""
CUDA_STORE = """
__global__ void store_rows_{n}(const {t}* k_in, const {t}* v_in, const {t}* q_in,
    const int32_t* dims, const float* scale, const int32_t* starts, const float* rope,
    const {t}* norm, __half* k_out, uint32_t* vw, __half* vs, __half* vb, {t}* q_out) {{
  using T = {t};
  using H = __half;
  constexpr int KL = {kl};
  constexpr int TG = 128;
{group_ids}{body}
}}
"""
CUDA_DENSE_ROWS = """
__global__ void dense_rows_{n}(const uint32_t* kw, const __half* ks, const __half* kb,
    const uint32_t* vw, const __half* vs, const __half* vb, const __half* tail,
    const __half* done, const int32_t* src, const int32_t* dims, const float* scale,
    {t}* k_out, {t}* v_out) {{
  using T = {t};
  constexpr int TG = 256;
{group_ids}{body}
}}
"""
CUDA_QUANTIZE_GROUPS = """
__global__ void quantize_groups(const __half* x, const int32_t* dims, uint32_t* words,
    __half* scales, __half* biases) {{
  using H = __half;
{group_ids}{body}
}}
"""
# (input dtype, KL): the head dims 64 and 128 in float16, 32 and 256 in the other types
CUDA_STORE_SHAPES = [("__half", 8), ("__half", 16), ("float", 4), ("__nv_bfloat16", 32)]
# (query dtype, output dtype, NQ, KL, KU): the shapes the engine launches, and the extremes
CUDA_SHAPES = [
    ("__half", "__half", 4, 8, 2),
    ("float", "float", 8, 32, 1),
    ("__nv_bfloat16", "__nv_bfloat16", 1, 16, 4),
    ("__half", "float", 2, 4, 2),
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles; runs no GPU)")
def test_the_same_bodies_compile_as_cuda(tmp_path):
    from agentkv.kernels import gpu

    source = CUDA_HEADER.format(
        helpers=gpu.helpers("cuda"),
        preamble=gpu.CUDA_THREAD_ID,
        merge=gpu.body("merge"),
        extract=gpu.body("extract"),
    )
    for n, (q, t, nq, kl, ku) in enumerate(CUDA_SHAPES):
        source += CUDA_PAGED.format(
            n=n, q=q, t=t, nq=nq, kl=kl, ku=ku,
            group_ids=gpu.GROUP_IDS["cuda"],
            body=gpu.body("paged_attention"),
            preamble=gpu.CUDA_THREAD_ID,
            merge=gpu.body("paged_attention_merge"),
        )  # fmt: skip
    for n, (t, kl) in enumerate(CUDA_STORE_SHAPES):
        source += CUDA_STORE.format(n=n, t=t, kl=kl, group_ids=gpu.GROUP_IDS["cuda"],
                                    body=gpu.body("store_rows"))  # fmt: skip
    for n, t in enumerate(("__half", "float", "__nv_bfloat16")):  # the queries' dtypes
        source += CUDA_DENSE_ROWS.format(n=n, t=t, group_ids=gpu.GROUP_IDS["cuda"],
                                         body=gpu.body("dense_rows"))  # fmt: skip
    source += CUDA_QUANTIZE_GROUPS.format(group_ids=gpu.GROUP_IDS["cuda"],
                                          body=gpu.body("quantize_groups"))  # fmt: skip
    source += "}  // namespace mlx::core::cu\n"
    path = tmp_path / "kernels.cu"
    path.write_text(source)
    out = subprocess.run(
        ["nvcc", "-arch=sm_90", "-c", "-o", str(tmp_path / "kernels.o"), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr


def test_the_gpu_gets_the_bodies_without_comments_and_the_host_compiles_the_same_lines():
    """What MLX gets (``gpu.body``, ``gpu.helpers``: MLX copies a custom kernel's whole source
    into every call and hashes it at every evaluation) is each file without its comments,
    indentation and empty lines, token for token the file the CPU build compiles: the same
    text once every comment and all white space are taken out of both."""
    import re
    from importlib import resources

    from agentkv.kernels import gpu

    def tokens(text: str) -> str:
        return re.sub(r"\s+", "", re.sub(r"//[^\n]*", "", text))

    sources = resources.files("agentkv").joinpath("_kernel_sources")
    names = ("paged_attention", "paged_attention_merge", "store_rows", "dense_rows", "merge")
    for name in (*names, "quantize_groups", "extract"):
        raw, sent = sources.joinpath(f"{name}.metal").read_text(), gpu.body(name)
        assert "//" not in sent and "\n\n" not in sent and len(sent) < 0.8 * len(raw)
        assert tokens(sent) == tokens(raw)
    for backend in ("cuda", "metal"):
        raw = sources.joinpath(f"{backend}.h").read_text()
        assert tokens(gpu.helpers(backend)) == tokens(raw)
    # a macro continued onto a comment ends there, emptied or not
    assert gpu.compact("#define A 1 \\\n  // the end\nint b;\n") == "#define A 1 \\\n\nint b;\n"
