/*
 * cblas_* entry points forwarding to the OpenBLAS of the scipy-openblas32 wheel.
 *
 * MLX's Linux CPU wheel links a reference BLAS (~3 GFLOP/s for float32
 * matmul). That OpenBLAS exports its functions with a "scipy_" prefix, so it
 * cannot interpose on MLX's calls by itself; this library, loaded with
 * RTLD_GLOBAL after it and before mlx.core, exports the unprefixed names MLX
 * binds to. No Python, no MLX: only the three GEMMs MLX's CPU matmul calls.
 * The scipy_* symbols are resolved at load time from the global scope.
 */
typedef int blasint; /* scipy-openblas32: 32-bit integers */

extern void scipy_cblas_sgemm(int, int, int, blasint, blasint, blasint, float, const float*,
                              blasint, const float*, blasint, float, float*, blasint);
extern void scipy_cblas_dgemm(int, int, int, blasint, blasint, blasint, double, const double*,
                              blasint, const double*, blasint, double, double*, blasint);
extern void scipy_cblas_cgemm(int, int, int, blasint, blasint, blasint, const void*, const void*,
                              blasint, const void*, blasint, const void*, void*, blasint);

void cblas_sgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, float alpha,
                 const float* a, blasint lda, const float* b, blasint ldb, float beta, float* c,
                 blasint ldc) {
  scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, double alpha,
                 const double* a, blasint lda, const double* b, blasint ldb, double beta, double* c,
                 blasint ldc) {
  scipy_cblas_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, const void* alpha,
                 const void* a, blasint lda, const void* b, blasint ldb, const void* beta, void* c,
                 blasint ldc) {
  scipy_cblas_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* Lets agentkv doctor tell that the shim is the cblas_sgemm in the global scope. */
const char* agentkv_blas_shim_target(void) {
  return "scipy-openblas32";
}
