/* minivllm's CPU kernels, float32: paged decode and prefill attention, the elementwise ops of a
 * decoder layer (RMSNorm with its residual add, rotary embedding, SiLU-and-mul), the linear
 * layers of a decode step's few rows (model/cpu_gemm.py uses them) and the sampler's
 * exponential race (sample/sampler.py), registered as torch
 * operators (``torch.ops.minivllm_cpu.*``, the TORCH_LIBRARY block at the end) whose loops run on
 * torch's own thread pool (at::parallel_for). minivllm compiles this file the first time it is
 * needed (minivllm/cpu_kernels.py); the torch code it replaces (attention/torch_backend.py,
 * model/layers.py) computes the same things, and tests/test_cpu_kernels.py compares the two.
 * It includes two torch headers only, and no pybind11: a build from clean takes seconds, not the
 * minute that <torch/extension.h> costs.
 *
 * Decode attention. Layout (attention/backend.py): a layer's K cache is [num_blocks,
 * block_size, kv_heads, d], V the same. Token p of sequence s lives in block
 * block_tables[s][p / block_size], at offset p % block_size. Query head hq reads KV head
 * hq / (heads / kv_heads) (grouped-query attention). Per sequence, block by block: the block's
 * key rows (all KV heads of a token are one contiguous row), eight at a time, are read once and
 * dotted with every query head that uses them; a softmax per head; then the block's value rows
 * are read once and added into every head's output with its probabilities, all while the next
 * block is prefetched (and blocks further on into L2). Nothing is gathered or padded, so each
 * layer reads each context token's K and V once. The sequences are split between threads by
 * their context lengths. With AVX-512's 32 registers, three query heads of a group take each
 * key and value vector from one load (dot8_heads; the value sums likewise at head_dim 64),
 * where one head at a time loads it again per head: the same sums in the same order, and on
 * the 2-core Xeon 8 sequences of 128 tokens x 30 layers' caches read from L2 1.25 ms against
 * 1.99, of 530 tokens from memory 13.7-14.4 ms against 14.5-15.7, and a decode step's layers
 * in the 512->32 closed loop 30.6-30.8 ms against 32.1 (2026-12-04). */

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_DOT8
#endif

namespace {

/* e^x for x <= 0 (a softmax's x - max), branch-free so that its loop vectorizes: Cephes'
 * range reduction x = k ln 2 + r and degree-6 polynomial for e^r (about 2 ulp in float32), then
 * 2^k built in the exponent bits; x below -87 (e^x under 1.6e-38) is clamped there. */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.f;
    return y * std::bit_cast<float>(((int32_t)k + 127) << 23);  /* 2^k */
}

/* Prefetch part `part` of `parts` of the `floats` at p, a line (64 bytes) at a time. The
 * kernel reads its blocks wherever the block table puts them; the hardware's prefetchers do not
 * run ahead of its arithmetic across those jumps, so it asks for the next block while it works on
 * this one, a little per head so that the requests are spread out (measured at batch 64,
 * contexts 64-1024, with the eight-row dots below: 35-41 % of the machine's read rate without
 * it, 54-66 % with it). */
static inline void prefetch_part(const float *p, int64_t floats, int64_t part, int64_t parts) {
    const char *c = (const char *)p;
    const int64_t bytes = floats * (int64_t)sizeof(float);
    for (int64_t o = (bytes * part / parts) & ~(int64_t)63; o < bytes * (part + 1) / parts; o += 64)
        __builtin_prefetch(c + o);
}

/* Ask for a whole block into L2. Over the L1 prefetches above, these run a block or two further
 * ahead: while the keys of block b are scored, the values of block b and the keys of block b + 2
 * come in; while the values of a sequence's first two blocks are added up, the next sequence's
 * first two key blocks (16 sequences of 256-320 tokens, 30 layers' caches, 2 threads: 11.2-12.5
 * ms a step's attention against 15.3-16.5 ms with the L1 prefetches alone, two runs each,
 * alternated). */
static inline void prefetch_block_l2(const float *p, int64_t floats) {
    const char *c = (const char *)p;
    for (int64_t o = 0; o < floats * (int64_t)sizeof(float); o += 64)
        __builtin_prefetch(c + o, 0, 1);
}

#ifdef HAVE_DOT8
/* q_i . k_j for the NH query heads q_i = q + i * D that share the eight key rows k_j = key +
 * j * stride (D floats each, D a multiple of 8), as dots[i] = [dot_0 .. dot_7]: eight
 * independent sums a head (one sum at a time waits on its own additions' latency), added
 * across their lanes all at once at the end. Each key vector is loaded once for all NH heads,
 * so NH > 1 needs fewer loads a multiply-add: 8 NH sums, NH queries and a key are 28 of
 * AVX-512's 32 registers at NH 3 (HAVE_DOT8_HEADS), more than AVX2's 16. */
template <int NH>
static inline __attribute__((always_inline)) void dot8_heads(const float *q, const float *key,
                                                              int64_t stride, const int64_t D,
                                                              __m256 *dots) {
    __m256 acc[NH][8];
#pragma GCC unroll 8
    for (int i = 0; i < NH; i++)
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x[NH];
#pragma GCC unroll 8
        for (int i = 0; i < NH; i++) x[i] = _mm256_loadu_ps(q + i * D + d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256 k = _mm256_loadu_ps(key + j * stride + d);
#pragma GCC unroll 8
            for (int i = 0; i < NH; i++) acc[i][j] = _mm256_fmadd_ps(x[i], k, acc[i][j]);
        }
    }
    /* two rounds of pairwise sums within 128-bit halves, then the halves added */
#pragma GCC unroll 8
    for (int i = 0; i < NH; i++) {
        const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]),
                                         _mm256_hadd_ps(acc[i][2], acc[i][3]));
        const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][4], acc[i][5]),
                                         _mm256_hadd_ps(acc[i][6], acc[i][7]));
        dots[i] = _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20),
                                _mm256_permute2f128_ps(s0, s1, 0x31));
    }
}
#ifdef __AVX512F__
#define HAVE_DOT8_HEADS
#endif
#endif

struct Job {
    const float *q, *k, *v;
    float *out;
    const int32_t *block_tables, *seq_lens;
    int64_t bt_stride, bt_cols, q_stride, out_stride;
    int64_t num_heads, num_kv_heads, head_dim, block_size, num_blocks, window;
    float scale;
    int64_t first, last, max_len; /* this part's sequences [first, last) */
    int status;                   /* 0, or what went wrong (see DECODE_ERRORS) */
};

/* the first context token a sequence of `len` tokens attends to (the last `window` of them
 * when window > 0) */
static inline int64_t window_start(int64_t len, int64_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

/* the key block at `index` among those sequence s reads (0: its first), or null (past its end,
 * or a bad id: the sequence's own turn reports that) */
static inline const float *key_block(const Job *a, int64_t s, int64_t index) {
    const int64_t len = a->seq_lens[s], bs = a->block_size;
    const int64_t start = window_start(len, a->window);
    const int64_t b = start / bs + index;
    if (len <= 0 || b * bs >= len || b >= a->bt_cols) return nullptr;
    const int32_t id = a->block_tables[s * a->bt_stride + b];
    if (id < 0 || id >= a->num_blocks) return nullptr;
    return a->k + (int64_t)id * bs * a->num_kv_heads * a->head_dim;
}

/* one sequence, all its heads; D is a compile-time constant in the common cases (see run) */
static inline __attribute__((always_inline)) int attend_sequence(
        const Job *a, int64_t s, const int64_t D, float *scores) {
    const int64_t kv_heads = a->num_kv_heads, heads = a->num_heads, bs = a->block_size;
    const int64_t group = heads / kv_heads, row = kv_heads * D, len = a->seq_lens[s];
    const int64_t start = window_start(len, a->window);
    const int64_t n = len - start, first_block = start / bs, end_block = (len + bs - 1) / bs;
    const int32_t *table = a->block_tables + s * a->bt_stride;
    const float *qs = a->q + s * a->q_stride;
    float *os = a->out + s * a->out_stride;
    if (len <= 0) return 1;
    if (end_block > a->bt_cols) return 2;
    for (int64_t b = first_block; b < end_block; b++)
        if (table[b] < 0 || table[b] >= a->num_blocks) return 2;

    const int64_t block_floats = bs * row;
    for (int64_t b = first_block; b < end_block && b < first_block + 2; b++)
        prefetch_block_l2(a->k + (int64_t)table[b] * block_floats, block_floats);
    /* scores[h * n + (p - start)] = scale * q_h . k_p, eight tokens at a time */
    for (int64_t b = first_block; b < end_block; b++) {
        const int64_t p0 = b * bs > start ? b * bs : start;
        const int64_t p1 = (b + 1) * bs < len ? (b + 1) * bs : len;
        const float *block = a->k + (int64_t)table[b] * bs * row;
        const float *next = b + 1 < end_block ? a->k + (int64_t)table[b + 1] * bs * row : nullptr;
        prefetch_block_l2(a->v + (int64_t)table[b] * block_floats, block_floats);
        if (b + 2 < end_block)
            prefetch_block_l2(a->k + (int64_t)table[b + 2] * block_floats, block_floats);
        for (int64_t p = p0; p < p1; p += 8) {
            const int64_t m = p1 - p < 8 ? p1 - p : 8;
            const float *keys = block + (p - b * bs) * row;
#ifdef HAVE_DOT8_HEADS
            if (m == 8 && D % 8 == 0 && group % 3 == 0) {  /* three heads to a key load */
                for (int64_t h = 0; h < heads; h += 3) {
                    if (next)
                        prefetch_part(next + (p - b * bs) * row, m * row, h / 3, heads / 3);
                    __m256 dots[3];
                    dot8_heads<3>(qs + h * D, keys + (h / group) * D, row, D, dots);
                    for (int i = 0; i < 3; i++)
                        _mm256_storeu_ps(scores + (h + i) * n - start + p,
                                         _mm256_mul_ps(dots[i], _mm256_set1_ps(a->scale)));
                }
                continue;
            }
#endif
            for (int64_t h = 0; h < heads; h++) {
                if (next) prefetch_part(next + (p - b * bs) * row, m * row, h, heads);
                const float *qh = qs + h * D, *kh = keys + (h / group) * D;
                float *sh = scores + h * n - start + p;
#ifdef HAVE_DOT8
                if (m == 8 && D % 8 == 0) {
                    __m256 dot;
                    dot8_heads<1>(qh, kh, row, D, &dot);
                    _mm256_storeu_ps(sh, _mm256_mul_ps(dot, _mm256_set1_ps(a->scale)));
                    continue;
                }
#endif
                for (int64_t j = 0; j < m; j++) {
                    float dot = 0.f;
                    for (int64_t d = 0; d < D; d++) dot += qh[d] * kh[j * row + d];
                    sh[j] = dot * a->scale;
                }
            }
        }
    }
    /* softmax per head, in place; each head's output starts at zero */
    for (int64_t h = 0; h < heads; h++) {
        float *sh = scores + h * n, max = -INFINITY, sum = 0.f, lane[8];
        /* eight maxima side by side, so that the loop vectorizes (one running max waits on
         * its own comparisons: about a tenth of the kernel's time) */
        std::fill(lane, lane + 8, -INFINITY);
        int64_t t8 = 0;
        for (; t8 + 8 <= n; t8 += 8)
            for (int j = 0; j < 8; j++) lane[j] = sh[t8 + j] > lane[j] ? sh[t8 + j] : lane[j];
        for (int j = 0; j < 8; j++) max = lane[j] > max ? lane[j] : max;
        for (int64_t t = t8; t < n; t++) max = sh[t] > max ? sh[t] : max;
        for (int64_t t = 0; t < n; t++) sh[t] = exp_nonpositive(sh[t] - max);
        for (int64_t t = 0; t < n; t++) sum += sh[t];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; t++) sh[t] *= inv;
        float *oh = os + h * D;
        for (int64_t d = 0; d < D; d++) oh[d] = 0.f;
    }
    /* out_h += p_h,p * v_p */
    for (int64_t b = first_block; b < end_block; b++) {
        const int64_t p0 = b * bs > start ? b * bs : start;
        const int64_t p1 = (b + 1) * bs < len ? (b + 1) * bs : len;
        const float *block = a->v + (int64_t)table[b] * bs * row;
        const float *next = b + 1 < end_block ? a->v + (int64_t)table[b + 1] * bs * row : nullptr;
        if (b - first_block < 2 && s + 1 < a->last)
            if (const float *keys = key_block(a, s + 1, b - first_block))
                prefetch_block_l2(keys, block_floats);
#ifdef HAVE_DOT8_HEADS
        if (D == 64 && group % 3 == 0) {  /* three heads to a value load: 24 sums in registers */
            for (int64_t h = 0; h < heads; h += 3) {
                if (next) prefetch_part(next, bs * row, h / 3, heads / 3);
                const float *vh = block + (h / group) * D;
                __m256 acc[3][8];
#pragma GCC unroll 3
                for (int i = 0; i < 3; i++)
#pragma GCC unroll 8
                    for (int j = 0; j < 8; j++)
                        acc[i][j] = _mm256_loadu_ps(os + (h + i) * D + 8 * j);
                for (int64_t p = p0; p < p1; p++) {
                    const float *value = vh + (p - b * bs) * row;
                    __m256 w[3];
#pragma GCC unroll 3
                    for (int i = 0; i < 3; i++)
                        w[i] = _mm256_set1_ps(scores[(h + i) * n - start + p]);
#pragma GCC unroll 8
                    for (int j = 0; j < 8; j++) {
                        const __m256 v = _mm256_loadu_ps(value + 8 * j);
#pragma GCC unroll 3
                        for (int i = 0; i < 3; i++) acc[i][j] = _mm256_fmadd_ps(w[i], v, acc[i][j]);
                    }
                }
#pragma GCC unroll 3
                for (int i = 0; i < 3; i++)
#pragma GCC unroll 8
                    for (int j = 0; j < 8; j++)
                        _mm256_storeu_ps(os + (h + i) * D + 8 * j, acc[i][j]);
            }
            continue;
        }
#endif
        for (int64_t h = 0; h < heads; h++) {
            if (next) prefetch_part(next, bs * row, h, heads);
            const float *sh = scores + h * n - start, *vh = block + (h / group) * D;
            float *oh = os + h * D, acc[D];
            for (int64_t d = 0; d < D; d++) acc[d] = oh[d];
            for (int64_t p = p0; p < p1; p++) {
                const float w = sh[p], *value = vh + (p - b * bs) * row;
                for (int64_t d = 0; d < D; d++) acc[d] += w * value[d];
            }
            for (int64_t d = 0; d < D; d++) oh[d] = acc[d];
        }
    }
    return 0;
}

static void run(Job *a) {
    const int64_t D = a->head_dim;
    std::unique_ptr<float[]> scores(new (std::nothrow) float[a->num_heads * a->max_len]);
    if (!scores) { a->status = 3; return; }
    for (int64_t s = a->first; s < a->last && !a->status; s++) {
        if (D == 64) a->status = attend_sequence(a, s, 64, scores.get());  /* constant head_dims */
        else if (D == 128) a->status = attend_sequence(a, s, 128, scores.get());  /* unroll fully */
        else a->status = attend_sequence(a, s, D, scores.get());
    }
}

const char *const DECODE_ERRORS[] = {
    "", "a sequence of length < 1",
    "a block id outside the KV cache, or a context longer than its block table", "out of memory"};

void check_float_rows(const at::Tensor &x, const char *op, const char *name) {
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat, op, ": ", name,
                      " must be a float32 CPU tensor");
}

/* [tokens, heads, head_dim] whose heads are one contiguous row per token (any row stride) */
bool heads_side_by_side(const at::Tensor &x) {
    return x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2);
}

/* what both attention kernels take: q and out float32 [tokens, heads, head_dim] with each
 * token's heads side by side, and a contiguous float32 cache of q's head_dim */
void check_attention_rows(const at::Tensor &q, const at::Tensor &kv_cache,
                          const at::Tensor &out, const char *op) {
    check_float_rows(q, op, "q");
    check_float_rows(out, op, "out");
    check_float_rows(kv_cache, op, "kv_cache");
    TORCH_CHECK_VALUE(heads_side_by_side(q) && heads_side_by_side(out) &&
                      out.sizes() == q.sizes(),
                      op, ": q and out must be float32 rows of [heads, head_dim]");
    TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                      kv_cache.size(4) == q.size(2),
                      op, ": kv_cache must be a contiguous [2, blocks, block_size, kv_heads, "
                      "head_dim] of q's head_dim");
}

/* out[i] = attention of q[i] over sequence i's context (its seq_lens[i] tokens, or the last
 * `window` of them when window > 0), for the first len(q) sequences, split into `parts`
 * (<= 0: torch's thread count) of about equal token counts that torch's threads share.
 * Bad input raises ValueError (out may then be partly written). */
void paged_decode(const at::Tensor &q, const at::Tensor &kv_cache, const at::Tensor &block_tables,
                  const at::Tensor &seq_lens, double scale, const at::Tensor &out, int64_t window,
                  int64_t parts) {
    check_attention_rows(q, kv_cache, out, "paged_decode");
    const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = kv_cache.size(3);
    TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                      block_tables.stride(1) == 1 && seq_lens.scalar_type() == at::kInt &&
                      seq_lens.dim() == 1 && seq_lens.is_contiguous() &&
                      block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
                      "paged_decode: block_tables and seq_lens must be int32 CPU rows");
    TORCH_CHECK_VALUE(block_tables.size(0) >= n && seq_lens.size(0) >= n,
                      "paged_decode: fewer block tables or lengths than queries");
    TORCH_CHECK_VALUE(kv_heads >= 1 && heads % kv_heads == 0 && d >= 1,
                      "paged_decode: a bad shape (heads not a multiple of KV heads?)");
    if (n == 0) return;
    const int32_t *lens = seq_lens.data_ptr<int32_t>();
    int64_t total = 0, max_len = 1;
    for (int64_t s = 0; s < n; s++) {
        int64_t len = lens[s];
        TORCH_CHECK_VALUE(len >= 1, "paged_decode: ", DECODE_ERRORS[1]);
        len -= window_start(len, window);
        total += len;
        max_len = len > max_len ? len : max_len;
    }
    if (parts < 1) parts = at::get_num_threads();
    if (parts > n) parts = n;
    const float *k = kv_cache.data_ptr<float>();
    const int64_t cache_half = kv_cache.stride(0);
    std::vector<Job> jobs(parts);
    int64_t s = 0, done = 0;
    for (int64_t i = 0; i < parts; i++) {
        jobs[i] = Job{q.data_ptr<float>(), k, k + cache_half, out.data_ptr<float>(),
                      block_tables.data_ptr<int32_t>(), lens, block_tables.stride(0),
                      block_tables.size(1), q.stride(0), out.stride(0), heads, kv_heads, d,
                      kv_cache.size(2), kv_cache.size(1), window, (float)scale, s, s, max_len, 0};
        const int64_t target = total * (i + 1) / parts;  /* about equal token counts */
        while (s < n && (done < target || i == parts - 1)) {
            const int64_t len = lens[s];
            done += len - window_start(len, window);
            s++;
        }
        jobs[i].last = s;
    }
    /* torch's own threads: awake and waiting right after torch's previous op, where threads of
     * our own would compete with them */
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++) run(&jobs[i]);
    });
    for (const Job &j : jobs)
        TORCH_CHECK_VALUE(j.status == 0, "paged_decode: ", DECODE_ERRORS[j.status]);
}

/* ---- elementwise ops: rows split between torch's threads when there is enough work ---- */

constexpr int64_t PARALLEL_MIN_ELEMENTS = 65536;

/* rows of at least PARALLEL_MIN_ELEMENTS in all per thread, so small calls stay on one */
int64_t grain(int64_t row_elements) {
    return row_elements > 0 ? std::max<int64_t>(1, PARALLEL_MIN_ELEMENTS / row_elements) : 1;
}

/* [..., n] whose last dim is contiguous and whose rows are one stride apart */
int64_t row_stride(const at::Tensor &x, const char *op, const char *name) {
    check_float_rows(x, op, name);
    TORCH_CHECK_VALUE(x.dim() >= 1 && x.stride(-1) == 1 && (x.dim() <= 2 || x.is_contiguous()),
                      op, ": ", name, " must be rows with a contiguous last dim");
    /* more dims: contiguous, so the rows are the last dim's size apart (stride(-2) is not that
     * when dim -2 has size 1, which torch's contiguity ignores) */
    return x.dim() == 2 ? x.stride(-2) : x.size(-1);
}

/* out[i] = weight * r / sqrt(mean(r^2) + eps), r = x[i] (+ residual[i], then also written to
 * residual_out[i]) */
void rms_norm_rows(const float *x, int64_t x_stride, const float *residual, int64_t r_stride,
                   const float *weight, float *out, float *residual_out, int64_t rows,
                   int64_t hidden, float eps) {
    at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++) {
            const float *xi = x + i * x_stride;
            float *oi = out + i * hidden, sum = 0.f;
            if (residual) {
                const float *ri = residual + i * r_stride;
                float *roi = residual_out + i * hidden;
                for (int64_t j = 0; j < hidden; j++) {
                    const float r = xi[j] + ri[j];
                    roi[j] = r;
                    sum += r * r;
                }
                xi = roi;
            } else {
                for (int64_t j = 0; j < hidden; j++) sum += xi[j] * xi[j];
            }
            const float inv = 1.f / sqrtf(sum / (float)hidden + eps);
            for (int64_t j = 0; j < hidden; j++) oi[j] = weight[j] * (xi[j] * inv);
        }
    });
}

int64_t norm_checks(const at::Tensor &x, const at::Tensor &weight) {
    const int64_t hidden = x.size(-1);
    check_float_rows(weight, "rms_norm", "weight");
    TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(),
                      "rms_norm: weight must be a contiguous [hidden]");
    return hidden;
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    const int64_t stride = row_stride(x, "rms_norm", "x"), hidden = norm_checks(x, weight);
    at::Tensor out = at::empty(x.sizes(), x.options());
    rms_norm_rows(x.data_ptr<float>(), stride, nullptr, 0, weight.data_ptr<float>(),
                  out.data_ptr<float>(), nullptr, hidden ? x.numel() / hidden : 0, hidden,
                  (float)eps);
    return out;
}

/* (rms_norm(x + residual), x + residual) */
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor &x,
                                                      const at::Tensor &residual,
                                                      const at::Tensor &weight, double eps) {
    const int64_t stride = row_stride(x, "rms_norm", "x"), hidden = norm_checks(x, weight);
    const int64_t r_stride = row_stride(residual, "rms_norm", "residual");
    TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "rms_norm: residual must be x's shape");
    at::Tensor out = at::empty(x.sizes(), x.options());
    at::Tensor new_residual = at::empty(x.sizes(), x.options());
    rms_norm_rows(x.data_ptr<float>(), stride, residual.data_ptr<float>(), r_stride,
                  weight.data_ptr<float>(), out.data_ptr<float>(), new_residual.data_ptr<float>(),
                  hidden ? x.numel() / hidden : 0, hidden, (float)eps);
    return {out, new_residual};
}

/* out[i, j] = silu(x[i, j]) * x[i, d + j]: x's rows are [gate | up], silu(g) = g * sigmoid(g) */
at::Tensor silu_and_mul(const at::Tensor &x) {
    const int64_t stride = row_stride(x, "silu_and_mul", "x"), d = x.size(-1) / 2;
    TORCH_CHECK_VALUE(x.size(-1) % 2 == 0, "silu_and_mul: the last dim must be even");
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = d;
    at::Tensor out = at::empty(shape, x.options());
    const int64_t rows = d ? out.numel() / d : 0;
    const float *xp = x.data_ptr<float>();
    float *op = out.data_ptr<float>();
    at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++) {
            const float *gate = xp + i * stride, *up = gate + d;
            float *oi = op + i * d;
            for (int64_t j = 0; j < d; j++) {
                const float g = gate[j], e = exp_nonpositive(g < 0.f ? g : -g);  /* e^-|g| */
                const float sigmoid = g < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
                oi[j] = g * sigmoid * up[j];
            }
        }
    });
    return out;
}

/* one head's halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); the output apart from
 * the input (restrict), so that the loop vectorizes without checks for overlap */
static inline void rotate_half(const float *__restrict x, const float *__restrict cos,
                               const float *__restrict sin, float *__restrict o, int64_t half) {
    for (int64_t j = 0; j < half; j++) {
        o[j] = x[j] * cos[j] - x[half + j] * sin[j];
        o[half + j] = x[half + j] * cos[j] + x[j] * sin[j];
    }
}

/* Rotary embedding, "neox" layout, out of place: for token t at position positions[t], each
 * head's halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin), with cos | sin the row of
 * cos_sin (d/2 each). q: [tokens, heads, d] with heads side by side (any token stride), k
 * likewise; the outputs are contiguous. A position outside the table raises IndexError. */
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor &positions,
                                                    const at::Tensor &q, const at::Tensor &k,
                                                    const at::Tensor &cos_sin) {
    check_float_rows(q, "rotary_embedding", "q");
    check_float_rows(k, "rotary_embedding", "k");
    check_float_rows(cos_sin, "rotary_embedding", "cos_sin_cache");
    TORCH_CHECK_VALUE(heads_side_by_side(q) && heads_side_by_side(k) && k.size(0) == q.size(0) &&
                      k.size(2) == q.size(2) && q.size(2) % 2 == 0,
                      "rotary_embedding: q and k must be [tokens, heads, head_dim] rows");
    TORCH_CHECK_VALUE(cos_sin.dim() == 2 && cos_sin.is_contiguous() &&
                      cos_sin.size(1) == q.size(2),
                      "rotary_embedding: cos_sin_cache must be a contiguous [positions, head_dim]");
    TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                      positions.device().is_cpu() && positions.numel() == q.size(0),
                      "rotary_embedding: positions must be int64, one per token");
    const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
    const int64_t half = d / 2, max_position = cos_sin.size(0);
    at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
    const int64_t *pos = positions.data_ptr<int64_t>();
    const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
    const float *table = cos_sin.data_ptr<float>();
    float *qo = q_out.data_ptr<float>(), *ko = k_out.data_ptr<float>();
    const int64_t q_stride = q.stride(0), k_stride = k.stride(0);
    std::atomic<bool> bad{false};
    at::parallel_for(0, tokens, grain((heads + kv_heads) * d), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; t++) {
            const int64_t p = pos[t];
            if (p < 0 || p >= max_position) { bad = true; continue; }
            const float *cos = table + p * d, *sin = cos + half;
            for (int64_t which = 0; which < 2; which++) {
                const int64_t n = which ? kv_heads : heads;
                const float *src = which ? kp + t * k_stride : qp + t * q_stride;
                float *dst = which ? ko + t * kv_heads * d : qo + t * heads * d;
                for (int64_t h = 0; h < n; h++)
                    rotate_half(src + h * d, cos, sin, dst + h * d, half);
            }
        }
    });
    TORCH_CHECK_INDEX(!bad, "rotary_embedding: a position outside [0, ", max_position, ")");
    return {q_out, k_out};
}

/* ---- linear layers for few rows: y = x @ w^T (+ bias), w packed in panels of 16 outputs ----
 *
 * A decode step multiplies one row per running sequence by every weight of the model: it reads
 * each weight once for a few rows' worth of arithmetic, so its speed is how fast the weights
 * stream in. Here a weight [out, in] is packed once (pack_panels, at load time) as panels of 16
 * outputs, [ceil(out / 16)][in][16]: a panel is one contiguous run, and input k needs the 64 bytes
 * (one cache line) at k of it: two 8-float vectors with AVX2, one 16-float vector with AVX-512. A
 * tile is R rows of x against one panel: per input it loads the panel's line and R floats of x
 * (each broadcast to a vector) and does R multiply-adds per vector of the line into sums held in
 * registers: R = 6 with AVX2's 16 vector registers (12 sums), 16 with AVX-512's 32 (16 sums of 16
 * floats: where the CPU's multiply-add units are 512 bits wide, twice the arithmetic per cycle; on
 * a 2-core Xeon with AVX-512, 16 rows of the bundled model's weights took 28-32 ms a step's worth
 * against 34.5 with the 8-float vectors, a decode step of 16 sequences 52-57 ms against 58-60).
 * The loops over the R rows must be unrolled (the pragmas): left to itself the compiler kept the
 * sums of R = 4..8 in memory, at a third of the speed. With AVX-512 the panels go two at a time
 * (wide_tile, up to 14 rows of 32 outputs), which needs fewer loads per multiply-add (the
 * bundled model's 121 weights on the 2-core Xeon: 16 rows 26.9 ms against 29.4-30.6 one panel
 * at a time, 32 rows 40.6 against 46.5, 64 rows 66.6 against 79.2, where oneDNN takes 81.8).
 * More rows than R take more tiles of about equal size, the later ones reading the panel from
 * cache. The first tile asks for the panel's
 * line PREFETCH_FLOATS ahead of the one it reads, into L2: without that the loads wait on memory,
 * since the hardware's own prefetching does not run far enough ahead of this much arithmetic per
 * line (measured on the bundled model's weights, 2 threads, AVX2 vectors: 16 rows 43 ms a step's
 * worth without it, 29 ms with it). The threads split the panels. Written with the compiler's
 * vector type, so it builds for any CPU. The sums run in another order than F.linear's, so the
 * results equal it up to float rounding. */

typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8_unaligned __attribute__((vector_size(32), aligned(4)));

constexpr int64_t PANEL = 16, PREFETCH_FLOATS = 2048;  /* 8 KiB ahead: 128 inputs */
#ifdef __AVX512F__
/* a panel's 16 floats are one AVX-512 vector: one sum per row, 16 rows of 32 registers */
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16_unaligned __attribute__((vector_size(64), aligned(4)));
constexpr int TILE_ROWS = 16;

static inline __attribute__((always_inline)) vec16 load16(const float *p) {
    return *(const vec16_unaligned *)p;
}
#else
constexpr int TILE_ROWS = 6;
#endif

static inline __attribute__((always_inline)) vec8 load8(const float *p) {
    return *(const vec8_unaligned *)p;
}

/* y[r, 0:cols] = x[r] . panel (+ bias) for R rows; cols < 16 only in the last panel. A
 * prefetch never faults, so the last panel's may run past the weight's end. */
template <int R>
static inline __attribute__((always_inline)) void panel_tile(
        const float *x, int64_t x_stride, const float *panel, int64_t K, const float *bias,
        float *y, int64_t y_stride, int64_t cols, bool prefetch) {
    float out[R][PANEL];
#ifdef __AVX512F__
    vec16 acc[R];  /* the loops over the rows unrolled, or the sums live in memory */
#pragma GCC unroll 32
    for (int r = 0; r < R; r++) acc[r] = vec16{};
    for (int64_t k = 0; k < K; k++) {
        if (prefetch) __builtin_prefetch(panel + k * PANEL + PREFETCH_FLOATS, 0, 1);
        vec16 w = load16(panel + k * PANEL);
        asm("" : "+v"(w));  /* in a register: one load, not one folded into each multiply-add */
#pragma GCC unroll 32
        for (int r = 0; r < R; r++) acc[r] += (vec16{} + x[r * x_stride + k]) * w;
    }
    for (int r = 0; r < R; r++) *(vec16_unaligned *)out[r] = acc[r];
#else
    vec8 lo[R], hi[R];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = vec8{};
    for (int64_t k = 0; k < K; k++) {
        if (prefetch) __builtin_prefetch(panel + k * PANEL + PREFETCH_FLOATS, 0, 1);
        vec8 w0 = load8(panel + k * PANEL), w1 = load8(panel + k * PANEL + 8);
#ifdef __AVX__
        /* in registers: otherwise the compiler folds these loads into each of the R rows'
         * multiply-adds, 2R loads where two do (an AVX register holds the 8 floats) */
        asm("" : "+x"(w0), "+x"(w1));
#endif
        for (int r = 0; r < R; r++) {
            const vec8 xk = vec8{} + x[r * x_stride + k];
            lo[r] += xk * w0;
            hi[r] += xk * w1;
        }
    }
    for (int r = 0; r < R; r++) {
        *(vec8_unaligned *)out[r] = lo[r];
        *(vec8_unaligned *)(out[r] + 8) = hi[r];
    }
#endif
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < cols; c++)
            y[r * y_stride + c] = bias ? out[r][c] + bias[c] : out[r][c];
}

#ifdef __AVX512F__
/* Two panels side by side, 32 outputs, for R <= PAIR_ROWS rows: per input two loads of the
 * weights' lines and R broadcasts of x feed 2R multiply-adds into 2R sums, where a one-panel
 * tile's R broadcasts feed R. The one-panel tile asks as much of the load ports as of the
 * multiply-add units, so it cannot keep the latter busy; this one can (see few_rows_linear). */
constexpr int PAIR_ROWS = 14;  /* 28 sums and the two lines: 30 of the 32 vector registers */
/* the pairs' inputs are taken PAIR_K at a time, every tile of rows in turn: the block of the
 * weights the first tile streams in (8 KiB) serves the others from L1, and the stream from
 * memory goes on at one pace while all of them compute (one tile after another over the whole
 * of the inputs streamed while the first computed, then the rest computed with the memory idle:
 * 16 rows 29.4 ms the bundled model's weights against 26.9 with the blocks) */
constexpr int64_t PAIR_K = 64;

/* sums[r * ld + 0 : NP * 16] (+)= x[r, k0:k1] . lines k0..k1 of NP panels side by side (one
 * `K * PANEL` floats after another) for R rows, R * NP + NP <= 32 (the sums and one line of each
 * panel in registers) */
template <int NP, int R>
static inline __attribute__((always_inline)) void wide_tile(
        const float *x, int64_t x_stride, const float *panel, int64_t K, int64_t k0, int64_t k1,
        float *sums, int64_t ld, bool first, bool prefetch) {
    vec16 acc[R][NP];
#pragma GCC unroll 32
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++)
            acc[r][j] = first ? vec16{} : load16(sums + r * ld + j * PANEL);
    for (int64_t k = k0; k < k1; k++) {
        vec16 w[NP];
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++) {
            if (prefetch) __builtin_prefetch(panel + (j * K + k) * PANEL + PREFETCH_FLOATS, 0, 1);
            w[j] = load16(panel + (j * K + k) * PANEL);
            asm("" : "+v"(w[j]));
        }
#pragma GCC unroll 32
        for (int r = 0; r < R; r++) {
            const vec16 xk = vec16{} + x[r * x_stride + k];
#pragma GCC unroll 4
            for (int j = 0; j < NP; j++) acc[r][j] += xk * w[j];
        }
    }
#pragma GCC unroll 32
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++) *(vec16_unaligned *)(sums + r * ld + j * PANEL) = acc[r][j];
}

/* one tile of M <= R rows (R counts down to M) */
template <int NP, int R>
static void wide_rows(const float *x, int64_t x_stride, int64_t M, const float *panel, int64_t K,
                      int64_t k0, int64_t k1, float *sums, int64_t ld, bool first,
                      bool prefetch) {
    if constexpr (R > 1) {
        if (M < R)
            return wide_rows<NP, R - 1>(x, x_stride, M, panel, K, k0, k1, sums, ld, first,
                                        prefetch);
    }
    wide_tile<NP, R>(x, x_stride, panel, K, k0, k1, sums, ld, first, prefetch);
}
#endif

/* one tile of M <= TILE_ROWS rows (R counts down to M) */
template <int R>
static void panel_rows(const float *x, int64_t x_stride, int64_t M, const float *panel, int64_t K,
                       const float *bias, float *y, int64_t y_stride, int64_t cols,
                       bool prefetch) {
    if constexpr (R > 1) {
        if (M < R)
            return panel_rows<R - 1>(x, x_stride, M, panel, K, bias, y, y_stride, cols, prefetch);
    }
    panel_tile<R>(x, x_stride, panel, K, bias, y, y_stride, cols, prefetch);
}

/* w: a contiguous [out, in] -> its panels, [ceil(out / 16), in, 16], zeros past out */
at::Tensor pack_panels(const at::Tensor &w) {
    check_float_rows(w, "pack_panels", "weight");
    TORCH_CHECK_VALUE(w.dim() == 2 && w.is_contiguous(), "pack_panels: weight must be a "
                      "contiguous [out, in]");
    const int64_t N = w.size(0), K = w.size(1), panels = (N + PANEL - 1) / PANEL;
    at::Tensor packed = at::empty({panels, K, PANEL}, w.options());
    const float *src = w.data_ptr<float>();
    float *dst = packed.data_ptr<float>();
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; g++)
            for (int64_t k = 0; k < K; k++)
                for (int64_t c = 0; c < PANEL; c++) {
                    const int64_t n = g * PANEL + c;
                    dst[(g * K + k) * PANEL + c] = n < N ? src[n * K + k] : 0.f;
                }
    });
    return packed;
}

/* x: [..., in] with a contiguous last dim and rows one stride apart; panels: pack_panels of a
 * weight with `out_features` outputs; bias: [out_features] or None. Returns
 * x @ weight^T + bias as [..., out_features]. */
at::Tensor few_rows_linear(const at::Tensor &x, const at::Tensor &panels,
                           const std::optional<at::Tensor> &bias, int64_t out_features) {
    const char *op = "few_rows_linear";
    const int64_t x_stride = row_stride(x, op, "x");
    check_float_rows(panels, op, "panels");
    const int64_t K = x.size(-1), N = out_features;
    TORCH_CHECK_VALUE(panels.dim() == 3 && panels.is_contiguous() && panels.size(1) == K &&
                      panels.size(2) == PANEL && N > (panels.size(0) - 1) * PANEL &&
                      N <= panels.size(0) * PANEL,
                      "few_rows_linear: panels must be pack_panels of an [out_features, in] "
                      "weight, in = x's last dim");
    const float *b = nullptr;
    if (bias.has_value() && bias->defined()) {
        check_float_rows(*bias, op, "bias");
        TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                          "few_rows_linear: bias must be a contiguous [out_features]");
        b = bias->data_ptr<float>();
    }
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    at::Tensor y = at::empty(shape, x.options());
    const int64_t M = K ? x.numel() / K : 0;
    if (M == 0 || N == 0) return y;
    const float *xp = x.data_ptr<float>(), *wp = panels.data_ptr<float>();
    float *yp = y.data_ptr<float>();
    const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t P = panels.size(0);
#ifdef __AVX512F__
    /* panels two at a time (wide_tile); a lone last panel takes the one-panel tile */
    const int64_t step = 2;
    const int64_t pair_tiles = (M + PAIR_ROWS - 1) / PAIR_ROWS;
#else
    const int64_t step = 1;
#endif
    /* a thread's share is at least PARALLEL_MIN_ELEMENTS weights */
    at::parallel_for(0, (P + step - 1) / step, grain(step * PANEL * K),
                     [&](int64_t begin, int64_t end) {
#ifdef __AVX512F__
        std::vector<float> sums(M * 2 * PANEL);  /* the pairs' sums between input blocks */
#endif
        for (int64_t g = begin * step; g < std::min(P, end * step); g += step) {
            const int64_t n = g * PANEL;
#ifdef __AVX512F__
            if (g + 1 < P) {
                const int64_t cols = std::min(2 * PANEL, N - n);
                for (int64_t k0 = 0; k0 < K; k0 += PAIR_K) {
                    const int64_t k1 = std::min(K, k0 + PAIR_K);
                    for (int64_t t = 0; t < pair_tiles; t++) {  /* tiles of about equal size */
                        const int64_t m0 = M * t / pair_tiles, m1 = M * (t + 1) / pair_tiles;
                        wide_rows<2, PAIR_ROWS>(xp + m0 * x_stride, x_stride, m1 - m0,
                                                wp + g * K * PANEL, K, k0, k1,
                                                sums.data() + m0 * 2 * PANEL, 2 * PANEL,
                                                k0 == 0, t == 0);
                    }
                }
                for (int64_t r = 0; r < M; r++)
                    for (int64_t c = 0; c < cols; c++)
                        yp[r * N + n + c] = b ? sums[r * 2 * PANEL + c] + b[n + c]
                                              : sums[r * 2 * PANEL + c];
                continue;
            }
#endif
            const int64_t cols = std::min(PANEL, N - n);
            for (int64_t t = 0; t < tiles; t++) {  /* tiles of about equal size */
                const int64_t m0 = M * t / tiles, m1 = M * (t + 1) / tiles;
                panel_rows<TILE_ROWS>(xp + m0 * x_stride, x_stride, m1 - m0, wp + g * K * PANEL,
                                      K, b ? b + n : nullptr, yp + m0 * N + n, N, cols, t == 0);
            }
        }
    });
    return y;
}

/* The most rows few_rows_linear should take, above which oneDNN is faster: with the pairs
 * (AVX-512), about 128 on the 2-core Xeon (the bundled model's 121 weights, `python -m
 * minivllm.model.cpu_gemm`: 96 rows 98.0 ms against oneDNN's 109.4, 128 rows 126.3 against
 * 128.4); with AVX2's one-panel tiles 32 (the two even from about 48 rows on a 2-core AMD). */
int64_t few_rows_max() {
#ifdef __AVX512F__
    return 128;
#else
    return 32;
#endif
}

/* ---- prefill attention: each sequence's new tokens over their paged context ----
 *
 * out[t] for the new tokens of a step's prefill chunks: sequence s's queries are tokens
 * query_start_loc[s] .. query_start_loc[s + 1] of q, at positions seq_len - query_len onward, and
 * the query at position p attends to keys 0..p (p - window < key with a window), read straight
 * from the cache's blocks, the new tokens' included (written before the call). The work is cut
 * into items of one sequence, one KV head and 16 consecutive queries. An item packs each query
 * head's 16 queries into a [head_dim, 16] panel once, then walks the keys its queries can see in
 * chunks of up to 16 tokens (never across a block): each chunk's scores are the linear layers'
 * tile (panel_rows) with the chunk's key rows, read in place, as the rows and the query panel as
 * the weights, so a score row holds one key against the 16 queries and the online softmax (a
 * running max and sum per query, FlashAttention's scheme) runs down the columns eight queries to a
 * vector (all sixteen with AVX-512); the chunk's value rows, read in place too, are then added
 * into the item's outputs with their weights. Nothing is gathered, padded or transposed but the
 * queries; keys past an item's last query are never read, and the causal mask costs work only in
 * the chunks it cuts; the threads split the items by their (query, key) pairs. Against torch's
 * gather and scaled_dot_product_attention (2 threads, 9 heads over 3 KV heads, head_dim 64, best
 * of ten, one run): two 256-token chunks, one after 256 cached tokens, 2.5 ms against 4.8 (about
 * 120 GFLOP/s against 63); one fresh 512-token chunk 2.6 against 4.8; one fresh 256-token chunk
 * 0.63 against 1.62. With AVX-512's 16-float vectors in the tiles and the softmax (another
 * machine, a 2-core Xeon, best of twenty): a fresh 512-token chunk 1.44-1.55 ms against 1.76 with
 * 8-float ones, about 200 GFLOP/s against 170. There, too, the scores take three query heads at
 * a time (wide_tile: each broadcast of a key's element serves three panels) and the value sums
 * 64 floats of six queries at a time (pv_wide_tile: each value row's four vectors serve six
 * queries): two 256-token chunks 1.32-1.36 ms against 1.49-1.50, a fresh 512-token chunk
 * 1.42-1.45 against 1.51-1.52 (two runs each, alternated). */

constexpr int64_t QUERY_TILE = PANEL, KEY_CHUNK = 16;
typedef int32_t veci8 __attribute__((vector_size(32)));
#ifdef __AVX512F__
typedef int32_t veci16 __attribute__((vector_size(64)));
typedef vec16 query_vec;  /* the online softmax's vector: a query tile's 16 queries at once */
typedef veci16 query_veci;
#else
typedef vec8 query_vec;  /* half a query tile at once */
typedef veci8 query_veci;
#endif

/* exp_nonpositive, a vector V of floats (VI: of int32s as wide) at once */
template <typename V, typename VI>
static inline __attribute__((always_inline)) V exp_lanes(V x) {
    x = x < -87.f ? V{} - 87.f : x;
    const V t = x * 1.44269504088896341f + 0.5f;
    V k = __builtin_convertvector(__builtin_convertvector(t, VI), V);
    k = k > t ? k - 1.f : k;  /* floor (the conversion truncates toward zero) */
    const V r = x - k * 0.693359375f + k * 2.12194440e-4f;
    V p = V{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const V y = p * r * r + r + 1.f;
    return y * (V)((__builtin_convertvector(k, VI) + 127) << 23);  /* 2^k */
}

#ifdef __AVX512F__
/* the same with AVX-512's floor (vrndscaleps) and scaling by 2^k (vscalefps): one instruction
 * each where the above takes four, the same floats (k is the same integer, and y * 2^k the same
 * product, exact in both) */
template <>
inline __attribute__((always_inline)) vec16 exp_lanes<vec16, veci16>(vec16 x) {
    x = x < -87.f ? vec16{} - 87.f : x;
    const vec16 t = x * 1.44269504088896341f + 0.5f;
    const vec16 k = (vec16)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEG_INF |
                                                           _MM_FROUND_NO_EXC);
    const vec16 r = x - k * 0.693359375f + k * 2.12194440e-4f;
    vec16 p = vec16{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vec16 y = p * r * r + r + 1.f;
    return (vec16)_mm512_scalef_ps((__m512)y, (__m512)k);
}
#endif

/* A query tile's online-softmax update over a chunk of n keys, `L` queries (one vector) at a
 * time: the scores S[c * Q + r] (scaled, masked to the keys each query sees when `masked`)
 * become their exponentials against the new running max, whose factor for the old one goes
 * to alpha; the running max m and sum l are updated. */
template <typename V, typename VI>
static inline __attribute__((always_inline)) void softmax_chunk(
        float *S, int64_t ld, int64_t n, int64_t c0, bool masked, float scale, const float *pos,
        const float *first, float *m, float *l, float *alpha) {
    typedef V V_unaligned __attribute__((aligned(4)));
    constexpr int64_t L = sizeof(V) / sizeof(float), Q = QUERY_TILE;
    for (int64_t at = 0; at < Q; at += L) {
        const V P = *(const V_unaligned *)(pos + at), F = *(const V_unaligned *)(first + at);
        const V old = *(const V_unaligned *)(m + at);
        /* two running maxima, so that each comparison does not wait on the one before */
        V top0 = old, top1 = old, sum = V{};
        for (int64_t c = 0; c < n; c++) {
            V x = *(const V_unaligned *)(S + c * ld + at) * scale;
            if (masked) {
                const V key = V{} + (float)(c0 + c);
                x = (key <= P) & (key >= F) ? x : V{} - 1e30f;
            }
            *(V_unaligned *)(S + c * ld + at) = x;
            if (c & 1) top1 = x > top1 ? x : top1;
            else top0 = x > top0 ? x : top0;
        }
        const V top = top1 > top0 ? top1 : top0;
        for (int64_t c = 0; c < n; c++) {
            V e = exp_lanes<V, VI>(*(const V_unaligned *)(S + c * ld + at) - top);
            if (masked) {
                const V key = V{} + (float)(c0 + c);
                e = (key <= P) & (key >= F) ? e : V{};
            }
            *(V_unaligned *)(S + c * ld + at) = e;
            sum += e;
        }
        const V scale_old = exp_lanes<V, VI>(old - top);
        *(V_unaligned *)(alpha + at) = scale_old;
        *(V_unaligned *)(l + at) = *(const V_unaligned *)(l + at) * scale_old + sum;
        *(V_unaligned *)(m + at) = top;
    }
}

/* o[r] = o[r] * alpha[r] + sum_c p[c * ld + r] v_c for R rows, d_begin..D (D a multiple of 16)
 * of each, over `tokens` value rows v_c = v + c * v_stride */
template <int R>
static inline __attribute__((always_inline)) void pv_tile(
        const float *p, int64_t ld, const float *alpha, const float *v, int64_t v_stride,
        int64_t tokens, float *o, int64_t D, int64_t d_begin) {
    for (int64_t d0 = d_begin; d0 < D; d0 += 16) {
#ifdef __AVX512F__
        vec16 acc[R];
#pragma GCC unroll 32
        for (int r = 0; r < R; r++) acc[r] = load16(o + r * D + d0) * alpha[r];
        for (int64_t c = 0; c < tokens; c++) {
            vec16 w = load16(v + c * v_stride + d0);
            asm("" : "+v"(w));
#pragma GCC unroll 32
            for (int r = 0; r < R; r++) acc[r] += p[c * ld + r] * w;
        }
        for (int r = 0; r < R; r++) *(vec16_unaligned *)(o + r * D + d0) = acc[r];
#else
        vec8 lo[R], hi[R];
        for (int r = 0; r < R; r++) {
            const vec8 a = vec8{} + alpha[r];
            lo[r] = load8(o + r * D + d0) * a;
            hi[r] = load8(o + r * D + d0 + 8) * a;
        }
        for (int64_t c = 0; c < tokens; c++) {
            vec8 w0 = load8(v + c * v_stride + d0), w1 = load8(v + c * v_stride + d0 + 8);
#ifdef __AVX__
            asm("" : "+x"(w0), "+x"(w1));
#endif
            for (int r = 0; r < R; r++) {
                const vec8 pr = vec8{} + p[c * ld + r];
                lo[r] += pr * w0;
                hi[r] += pr * w1;
            }
        }
        for (int r = 0; r < R; r++) {
            *(vec8_unaligned *)(o + r * D + d0) = lo[r];
            *(vec8_unaligned *)(o + r * D + d0 + 8) = hi[r];
        }
#endif
    }
}

template <int R>
static void pv_rows(const float *p, int64_t ld, const float *alpha, const float *v,
                    int64_t v_stride, int64_t tokens, float *o, int64_t D, int64_t d_begin,
                    int64_t M) {
    if constexpr (R > 1) {
        if (M < R)
            return pv_rows<R - 1>(p, ld, alpha, v, v_stride, tokens, o, D, d_begin, M);
    }
    pv_tile<R>(p, ld, alpha, v, v_stride, tokens, o, D, d_begin);
}

#ifdef __AVX512F__
/* pv_tile's sums for R <= PV_ROWS rows and 64 floats d0..d0 + 64 of each: per value row four
 * loads and R broadcasts feed 4R multiply-adds, where pv_tile's one load and R broadcasts feed
 * R (the same sums in the same order) */
constexpr int PV_ROWS = 6;  /* 24 sums and the row's four vectors: 28 of 32 registers */

template <int R>
static inline __attribute__((always_inline)) void pv_wide_tile(
        const float *p, int64_t ld, const float *alpha, const float *v, int64_t v_stride,
        int64_t tokens, float *o, int64_t D, int64_t d0) {
    vec16 acc[R][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[r][j] = load16(o + r * D + d0 + j * 16) * alpha[r];
    for (int64_t c = 0; c < tokens; c++) {
        vec16 w[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            w[j] = load16(v + c * v_stride + d0 + j * 16);
            asm("" : "+v"(w[j]));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const vec16 pr = vec16{} + p[c * ld + r];
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[r][j] += pr * w[j];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) *(vec16_unaligned *)(o + r * D + d0 + j * 16) = acc[r][j];
}

template <int R>
static void pv_wide_rows(const float *p, int64_t ld, const float *alpha, const float *v,
                         int64_t v_stride, int64_t tokens, float *o, int64_t D, int64_t d0,
                         int64_t M) {
    if constexpr (R > 1) {
        if (M < R)
            return pv_wide_rows<R - 1>(p, ld, alpha, v, v_stride, tokens, o, D, d0, M);
    }
    pv_wide_tile<R>(p, ld, alpha, v, v_stride, tokens, o, D, d0);
}
#endif

struct Prefill {
    const float *q, *k, *v;
    float *out;
    const int32_t *tables, *lens, *qsl;
    int64_t bt_stride, bt_cols, q_stride, out_stride;
    int64_t heads, kv_heads, D, block_size, num_blocks, window;
    float scale;
};

struct PrefillItem {
    int64_t seq, kv_head, first;  /* first: the item's first query, counted in its sequence */
};

/* the first key the query at position p sees */
static inline int64_t first_key(int64_t p, int64_t window) {
    return (window > 0 && p + 1 > window) ? p + 1 - window : 0;
}

/* floats of an item's buffer: per query head its query panel, outputs, running max and sum;
 * the chunk's scores; the queries' positions and first keys */
static inline int64_t prefill_work(int64_t G, int64_t D) {
    return G * QUERY_TILE * (2 * D + 2) + KEY_CHUNK * G * QUERY_TILE + 3 * QUERY_TILE;
}

/* one item (see above). Returns 0, or 2 for a block id outside the cache. */
static int prefill_item(const Prefill &a, const PrefillItem &it, float *work) {
    constexpr int64_t Q = QUERY_TILE;
    const int64_t G = a.heads / a.kv_heads, D = a.D, bs = a.block_size, row = a.kv_heads * D;
    const int64_t s = it.seq, h = it.kv_head, qlen = a.qsl[s + 1] - a.qsl[s];
    const int64_t pos0 = a.lens[s] - qlen + it.first, M = std::min(Q, qlen - it.first);
    const int64_t lo = first_key(pos0, a.window), hi = pos0 + M;  /* the keys [lo, hi) */
    const int32_t *table = a.tables + s * a.bt_stride;
    float *Qp = work, *O = Qp + G * D * Q, *m = O + G * Q * D, *l = m + G * Q;
    /* the chunk's scores, all heads side by side: S[c * ld + g * Q + r] */
    const int64_t ld = G * Q;
    float *S = l + G * Q, *alpha = S + KEY_CHUNK * ld, *pos = alpha + Q, *first = pos + Q;
    const float *qt = a.q + (a.qsl[s] + it.first) * a.q_stride;
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++)
            for (int64_t r = 0; r < Q; r++)
                Qp[(g * D + d) * Q + r] = r < M ? qt[r * a.q_stride + (h * G + g) * D + d] : 0.f;
    std::fill(O, O + G * Q * D, 0.f);
    std::fill(m, m + G * Q, -1e30f);  /* below any score; finite, so m - max is never NaN */
    std::fill(l, l + G * Q, 0.f);
    for (int64_t r = 0; r < Q; r++) {  /* positions past the tile's queries see no key */
        pos[r] = r < M ? (float)(pos0 + r) : -1.f;
        first[r] = (float)first_key(pos0 + r, a.window);
    }
    const int64_t last_first = first_key(pos0 + M - 1, a.window);
    for (int64_t c0 = lo; c0 < hi;) {
        const int64_t b = c0 / bs, c1 = std::min({c0 + KEY_CHUNK, (b + 1) * bs, hi}), n = c1 - c0;
        if (b >= a.bt_cols || table[b] < 0 || table[b] >= a.num_blocks) return 2;
        const int64_t at = ((int64_t)table[b] * bs + c0 - b * bs) * row + h * D;
        const float *keys = a.k + at, *values = a.v + at;
        /* does some query of the tile miss some key of the chunk? */
        const bool masked = c1 - 1 > pos0 || last_first > c0 || M < Q;
#ifdef __AVX512F__
        /* S[c, g, r] = k_c . q_gr: the query heads three (or two) at a time, so that each
         * broadcast of a key's element serves three heads' panels (wide_tile) */
        for (int64_t g = 0; g < G;) {
            const int64_t np = std::min<int64_t>(3, G - g), most = np == 3 ? 9 : 14;
            const int64_t tiles = (n + most - 1) / most;
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t r0 = n * t / tiles, r1 = n * (t + 1) / tiles;
                float *dst = S + r0 * ld + g * Q;
                if (np == 3)
                    wide_rows<3, 9>(keys + r0 * row, row, r1 - r0, Qp + g * D * Q, D, 0, D, dst,
                                    ld, true, false);
                else if (np == 2)
                    wide_rows<2, 14>(keys + r0 * row, row, r1 - r0, Qp + g * D * Q, D, 0, D,
                                     dst, ld, true, false);
                else
                    panel_rows<TILE_ROWS>(keys + r0 * row, row, r1 - r0, Qp + g * D * Q, D,
                                          nullptr, dst, ld, Q, false);
            }
            g += np;
        }
#else
        for (int64_t g = 0; g < G; g++)
            for (int64_t k0 = 0; k0 < n; k0 += TILE_ROWS)  /* S[c, g, r] = k_c . q_gr */
                panel_rows<TILE_ROWS>(keys + k0 * row, row, std::min<int64_t>(TILE_ROWS, n - k0),
                                      Qp + g * D * Q, D, nullptr, S + k0 * ld + g * Q, ld, Q,
                                      false);
#endif
        for (int64_t g = 0; g < G; g++) {
            softmax_chunk<query_vec, query_veci>(S + g * Q, ld, n, c0, masked, a.scale, pos,
                                                 first, m + g * Q, l + g * Q, alpha);
            int64_t d_begin = 0;
#ifdef __AVX512F__
            for (; d_begin + 64 <= D; d_begin += 64)
                for (int64_t r0 = 0; r0 < M; r0 += PV_ROWS)
                    pv_wide_rows<PV_ROWS>(S + g * Q + r0, ld, alpha + r0, values, row, n,
                                          O + (g * Q + r0) * D, D, d_begin,
                                          std::min<int64_t>(PV_ROWS, M - r0));
#endif
            if (d_begin < D)
                for (int64_t r0 = 0; r0 < M; r0 += TILE_ROWS)
                    pv_rows<TILE_ROWS>(S + g * Q + r0, ld, alpha + r0, values, row, n,
                                       O + (g * Q + r0) * D, D, d_begin,
                                       std::min<int64_t>(TILE_ROWS, M - r0));
        }
        c0 = c1;
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t r = 0; r < M; r++) {
            const float inv = 1.f / l[g * Q + r], *o = O + (g * Q + r) * D;
            float *dst = a.out + (a.qsl[s] + it.first + r) * a.out_stride + (h * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
        }
    return 0;
}

/* out[t] for every token t of the sequences' new queries (see above): q and out [tokens,
 * heads, head_dim] with heads side by side, head_dim a multiple of 16; query_start_loc [n + 1],
 * seq_lens [n] and block_tables [n, cols] int32 on the CPU. `parts` <= 0: torch's thread count.
 * Bad input raises ValueError (out may then be partly written). */
void paged_prefill(const at::Tensor &q, const at::Tensor &kv_cache,
                   const at::Tensor &block_tables, const at::Tensor &seq_lens,
                   const at::Tensor &query_start_loc, double scale, const at::Tensor &out,
                   int64_t window, int64_t parts) {
    check_attention_rows(q, kv_cache, out, "paged_prefill");
    const int64_t T = q.size(0), heads = q.size(1), D = q.size(2), kv_heads = kv_cache.size(3);
    TORCH_CHECK_VALUE(kv_heads >= 1 && heads % kv_heads == 0 && D >= 16 && D % 16 == 0,
                      "paged_prefill: heads must be a multiple of KV heads and head_dim of 16");
    for (const at::Tensor *t : {&block_tables, &seq_lens, &query_start_loc})
        TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->device().is_cpu() &&
                          t->dim() == (t == &block_tables ? 2 : 1) && t->stride(-1) == 1,
                          "paged_prefill: block_tables, seq_lens and query_start_loc must be "
                          "int32 CPU rows");
    const int64_t n = seq_lens.size(0);
    TORCH_CHECK_VALUE(query_start_loc.size(0) == n + 1 && block_tables.size(0) >= n,
                      "paged_prefill: query_start_loc must have one more entry than seq_lens, "
                      "and block_tables a row per sequence");
    const int32_t *qsl = query_start_loc.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
    const int64_t G = heads / kv_heads;
    std::vector<PrefillItem> items;
    std::vector<int64_t> cost;  /* cumulative (query, key) pairs */
    int64_t total = 0;
    for (int64_t s = 0; s < n; s++) {
        const int64_t qlen = (int64_t)qsl[s + 1] - qsl[s], len = lens[s];
        TORCH_CHECK_VALUE(qsl[s] >= 0 && qlen >= 0 && qsl[s + 1] <= T && qlen <= len,
                          "paged_prefill: query_start_loc must rise within q, and a sequence's "
                          "new tokens fit in its length");
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t j = 0; j < qlen; j += QUERY_TILE) {
                const int64_t p = len - qlen + j, rows = std::min<int64_t>(QUERY_TILE, qlen - j);
                items.push_back({s, h, j});
                total += rows * (p + rows - first_key(p, window));
                cost.push_back(total);
            }
    }
    if (items.empty()) return;
    const Prefill a{q.data_ptr<float>(), kv_cache.data_ptr<float>(),
                    kv_cache.data_ptr<float>() + kv_cache.stride(0), out.data_ptr<float>(),
                    block_tables.data_ptr<int32_t>(), lens, qsl, block_tables.stride(0),
                    block_tables.size(1), q.stride(0), out.stride(0), heads, kv_heads, D,
                    kv_cache.size(2), kv_cache.size(1), window, (float)scale};
    if (parts < 1) parts = at::get_num_threads();
    parts = std::min<int64_t>(parts, (int64_t)items.size());
    std::vector<int64_t> bounds(parts + 1, 0);  /* parts of about equal cost */
    for (int64_t i = 1; i <= parts; i++)
        bounds[i] = i == parts ? (int64_t)items.size() :
            std::lower_bound(cost.begin(), cost.end(), total * i / parts) - cost.begin() + 1;
    const int64_t work_floats = prefill_work(G, D);
    std::atomic<int> status{0};
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
        std::unique_ptr<float[]> work(new (std::nothrow) float[work_floats]);
        if (!work) { status = 3; return; }
        for (int64_t part = begin; part < end; part++)
            for (int64_t i = bounds[part]; i < bounds[part + 1] && !status; i++)
                if (int e = prefill_item(a, items[i], work.get())) status = e;
    });
    TORCH_CHECK_VALUE(status == 0, "paged_prefill: ", DECODE_ERRORS[status]);
}

/* ---- sampling: the exponential race, noise and argmax in one pass over each row ----
 *
 * tokens[i] = argmax_j probs[i, j] / q_ij with q_ij = -log(u_ij) ~ Exp(1) (sample/sampler.py's
 * exponential_race, where the u come from torch's generators). Here u_ij is a pure function of
 * the row's 64-bit key and j: a 32-bit integer hash of j under the key (three xorshift-multiply
 * rounds, the multipliers of a published low-bias search, keyed twice), whose top 23 bits pick
 * the midpoint of one of 2^23 equal cells of (0, 1). 23, not 24: a midpoint then needs 24
 * significant bits, which a float holds exactly, so u is never 0 or 1 and -log(u) is finite and
 * positive. Computing u where it is used costs no pass over memory and no serial generator;
 * a row's tokens depend on its key alone, not on the other rows. */

static inline uint32_t hash32(uint32_t x) {
    x ^= x >> 17;
    x *= 0xed5ad4bbu;
    x ^= x >> 11;
    x *= 0xac4c1b51u;
    x ^= x >> 15;
    x *= 0x31848babu;
    x ^= x >> 14;
    return x;
}

static inline float race_uniform(uint32_t j, uint32_t k0, uint32_t k1) {
    const uint32_t h = hash32(hash32(j ^ k0) + k1);
    return ((float)(h >> 9) + 0.5f) * 1.1920928955078125e-7f; /* 2^-23 */
}

/* log(x) for a normal float x > 0, branch-free so that its loop vectorizes: x = m 2^e with m in
 * [sqrt(1/2), sqrt(2)), then Cephes' degree-9 polynomial for log(m) (about 1 ulp in float32). */
static inline float log_positive(float x) {
    const int32_t bits = std::bit_cast<int32_t>(x);
    int32_t e = ((bits >> 23) & 0xff) - 126;
    float m = std::bit_cast<float>((bits & 0x007fffff) | 0x3f000000); /* [0.5, 1) */
    const bool low = m < 0.707106781186547524f;
    e = low ? e - 1 : e;
    m = low ? m + m - 1.f : m - 1.f;
    const float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    const float fe = (float)e;
    y += -2.12194440e-4f * fe - 0.5f * z;
    return m + y + 0.693359375f * fe;
}

constexpr int64_t RACE_CHUNK = 1024;

at::Tensor race_sample(const at::Tensor &probs, const at::Tensor &keys) {
    const int64_t stride = row_stride(probs, "race_sample", "probs");
    TORCH_CHECK_VALUE(probs.dim() == 2, "race_sample: probs must be [rows, vocab]");
    TORCH_CHECK_VALUE(keys.device().is_cpu() && keys.scalar_type() == at::kLong &&
                      keys.dim() == 1 && keys.size(0) == probs.size(0) && keys.is_contiguous(),
                      "race_sample: keys must be a contiguous int64 [rows] on the CPU");
    const int64_t rows = probs.size(0), vocab = probs.size(1);
    TORCH_CHECK_VALUE(vocab > 0 && vocab <= (int64_t)UINT32_MAX, "race_sample: bad vocab size");
    at::Tensor out = at::empty({rows}, keys.options());
    const float *pp = probs.data_ptr<float>();
    const int64_t *kp = keys.data_ptr<int64_t>();
    int64_t *op = out.data_ptr<int64_t>();
    at::parallel_for(0, rows, grain(vocab), [&](int64_t begin, int64_t end) {
        alignas(64) float ratio[RACE_CHUNK];
        for (int64_t i = begin; i < end; i++) {
            const float *p = pp + i * stride;
            const uint64_t key = (uint64_t)kp[i];
            const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
            float best = -1.f;
            int64_t winner = 0;
            for (int64_t c = 0; c < vocab; c += RACE_CHUNK) {
                const int64_t n = std::min(RACE_CHUNK, vocab - c);
                for (int64_t j = 0; j < n; j++)  /* vectorized: no dependence between j */
                    ratio[j] = p[c + j] / -log_positive(race_uniform((uint32_t)(c + j), k0, k1));
                float top = -1.f;
                for (int64_t j = 0; j < n; j++) top = std::max(top, ratio[j]);
                if (top > best) {  /* the first j that reaches it: argmax's first index */
                    int64_t j = 0;
                    while (ratio[j] != top) j++;
                    best = top;
                    winner = c + j;
                }
            }
            op[i] = winner;
        }
    });
    return out;
}

/* ---- a whole step's decoder layers in one call ----
 *
 * The decoder layers of model/llama.py for one step's flattened batch (decodes first, then
 * prefill chunks), the same operators in the same order as the Python forward runs them on a
 * CPU with these kernels swapped in (so the same floats), without the Python between them: on
 * a 2-core CPU the interpreter, the modules and the dispatcher took about a fifth of a decode
 * step, while torch's other threads waited. worker/cpu_layers.py says when the engine calls
 * it. Per layer, `weights` holds ten tensors: the input norm's weight, qkv's panels and oneDNN
 * copy, o_proj's two, the post-attention norm's weight, gate_up's two, down's two; then the
 * final norm's weight. `qkv_biases` holds one per layer (None without), `kv_caches` and
 * `windows` (0: full attention) too; `heads` is (query heads, KV heads, head_dim). A linear
 * layer of at most `few_rows` rows takes the panels, a larger one oneDNN (model/cpu_gemm.py's
 * rule). hidden: the embedded tokens [n, hidden]; slots: where each token's K/V go; the
 * first `num_decodes` of the sequences have one query token each. Returns the final norm's
 * output [n, hidden]. */

/* the n tokens' K and V rows into their slots of a [2, blocks, block_size, kv_heads, d] cache
 * (index_copy_ of each half, as the torch backend writes them) */
void write_kv(const at::Tensor &cache, const at::Tensor &k, const at::Tensor &v,
              const int64_t *slots, int64_t n) {
    const int64_t row = cache.size(3) * cache.size(4);
    const int64_t num_slots = cache.size(1) * cache.size(2), half = cache.stride(0);
    float *kc = cache.data_ptr<float>(), *vc = kc + half;
    const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    for (int64_t t = 0; t < n; t++)
        TORCH_CHECK_INDEX(slots[t] >= 0 && slots[t] < num_slots, "decoder_layers: slot ",
                          slots[t], " outside the KV cache");
    const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
    /* the threads split the rows: a prefill chunk's writes go to memory not yet in cache */
    at::parallel_for(0, n, grain(2 * row), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; t++) {
            std::copy_n(kp + t * k_stride, row, kc + slots[t] * row);
            std::copy_n(vp + t * v_stride, row, vc + slots[t] * row);
        }
    });
}

/* x @ weight^T (+ bias): the panels for at most `few_rows` rows, else oneDNN's copy of the
 * weight through torch's operator (mkldnn::_linear_pointwise, as cpu_gemm.linear calls it) */
at::Tensor linear(const at::Tensor &x, const at::Tensor &panels, const at::Tensor &packed,
                  const std::optional<at::Tensor> &bias, int64_t out_features, int64_t few_rows) {
    if (x.size(0) <= few_rows) return few_rows_linear(x, panels, bias, out_features);
    static const c10::OperatorHandle onednn =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack{x, packed, bias, std::string("none"),
                                   c10::List<std::optional<at::Scalar>>(), std::string("")};
    onednn.callBoxed(&stack);
    return stack[0].toTensor();
}

/* a step's queries and the sequences they attend, as the attention kernels take them */
struct Rows {
    at::Tensor q, block_tables, seq_lens, query_start_loc;
    int64_t prefills;
    at::Tensor picked;  /* the rows kept (kept_rows), undefined for all of them */
};

/* The last row of each sequence in `keep` (int64 sequence indices, rising, the first
 * num_decodes of them 0, 1, ..., num_decodes - 1: every decode is kept): a decode is its own
 * last row, a prefill chunk keeps the query of its last token, whose attention the kernel
 * computes the same alone as beside the chunk's other queries. */
Rows kept_rows(const Rows &all, const at::Tensor &keep, int64_t num_decodes) {
    const char *op = "decoder_layers";
    const int64_t seqs = all.seq_lens.size(0), kept = keep.numel();
    TORCH_CHECK_VALUE(keep.scalar_type() == at::kLong && keep.dim() == 1 &&
                      keep.is_contiguous() && keep.device().is_cpu(), op,
                      ": keep must be int64 sequence indices");
    const int64_t *s = keep.data_ptr<int64_t>();
    const int32_t *qsl = all.query_start_loc.data_ptr<int32_t>();
    at::Tensor picked = at::empty({kept}, keep.options()),
               starts = at::empty({kept + 1}, all.query_start_loc.options());
    int64_t *row = picked.data_ptr<int64_t>();
    int32_t *start = starts.data_ptr<int32_t>();
    start[0] = 0;
    for (int64_t i = 0; i < kept; i++) {
        TORCH_CHECK_VALUE(s[i] >= 0 && s[i] < seqs && (i == 0 || s[i] > s[i - 1]) &&
                          (i >= num_decodes || s[i] == i), op,
                          ": keep must name the step's sequences in rising order, every decode "
                          "among them");
        row[i] = qsl[s[i] + 1] - 1;
        start[i + 1] = (int32_t)(i + 1);
    }
    TORCH_CHECK_VALUE(kept >= num_decodes, op, ": keep must hold every decode");
    return Rows{all.q.index_select(0, picked), all.block_tables.index_select(0, keep),
                all.seq_lens.index_select(0, keep), starts, kept - num_decodes, picked};
}

at::Tensor decoder_layers(const at::Tensor &hidden, const at::Tensor &positions,
                          const at::Tensor &slots, const at::Tensor &block_tables,
                          const at::Tensor &seq_lens, const at::Tensor &query_start_loc,
                          int64_t num_decodes, at::TensorList weights,
                          const c10::List<std::optional<at::Tensor>> &qkv_biases,
                          at::TensorList kv_caches, const at::Tensor &cos_sin,
                          at::IntArrayRef windows, at::IntArrayRef heads, double eps,
                          double scale, int64_t few_rows, const std::optional<at::Tensor> &keep) {
    const char *op = "decoder_layers";
    const int64_t layers = (int64_t)kv_caches.size();
    TORCH_CHECK_VALUE(heads.size() == 3 && (int64_t)weights.size() == 10 * layers + 1 &&
                      (int64_t)qkv_biases.size() == layers && (int64_t)windows.size() == layers,
                      op, ": ten weights a layer and the final norm's, one bias, cache and "
                      "window a layer, and (heads, kv_heads, head_dim)");
    check_float_rows(hidden, op, "hidden");
    TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.is_contiguous(), op,
                      ": hidden must be a contiguous [tokens, hidden]");
    TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                      slots.device().is_cpu() && slots.numel() == hidden.size(0),
                      op, ": slots must be int64, one per token");
    const int64_t n = hidden.size(0), H = hidden.size(1), seqs = seq_lens.size(0);
    TORCH_CHECK_VALUE(num_decodes >= 0 && num_decodes <= seqs &&
                      query_start_loc.size(0) == seqs + 1, op,
                      ": num_decodes, seq_lens and query_start_loc disagree");
    const int64_t nh = heads[0], nkv = heads[1], d = heads[2];
    const int64_t q_size = nh * d, kv_size = nkv * d, prefills = seqs - num_decodes;
    at::Tensor h = rms_norm(hidden, weights[0], eps), residual = hidden;
    for (int64_t l = 0; l < layers; l++) {
        const at::Tensor *w = weights.data() + 10 * l;
        if (l > 0) std::tie(h, residual) = fused_add_rms_norm(h, residual, w[0], eps);
        const at::Tensor qkv =
            linear(h, w[1], w[2], qkv_biases.get(l), q_size + 2 * kv_size, few_rows);
        const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, nkv, d});
        auto [q, k] = rotary_embedding(positions, qkv.narrow(1, 0, q_size).view({n, nh, d}),
                                       qkv.narrow(1, q_size, kv_size).view({n, nkv, d}),
                                       cos_sin);
        const at::Tensor &cache = kv_caches[l];
        check_attention_rows(q, cache, q, op);
        TORCH_CHECK_VALUE(cache.size(3) == nkv, op, ": a cache of another KV head count");
        write_kv(cache, k, v, slots.data_ptr<int64_t>(), n);
        /* the last layer: only the kept sequences' last rows go on past the K/V */
        Rows r{q, block_tables, seq_lens, query_start_loc, prefills};
        if (keep && l == layers - 1) {
            r = kept_rows(r, *keep, num_decodes);
            if (r.q.size(0) == 0) return hidden.new_empty({0, H});
            residual = residual.index_select(0, r.picked);
        }
        at::Tensor out = at::empty(r.q.sizes(), r.q.options());
        if (num_decodes)
            paged_decode(r.q.narrow(0, 0, num_decodes), cache, r.block_tables,
                         r.seq_lens.narrow(0, 0, num_decodes), scale,
                         out.narrow(0, 0, num_decodes), windows[l], 0);
        if (r.prefills)
            paged_prefill(r.q, cache, r.block_tables.narrow(0, num_decodes, r.prefills),
                          r.seq_lens.narrow(0, num_decodes, r.prefills),
                          r.query_start_loc.narrow(0, num_decodes, r.prefills + 1), scale, out,
                          windows[l], 0);
        h = linear(out.view({r.q.size(0), q_size}), w[3], w[4], std::nullopt, H, few_rows);
        std::tie(h, residual) = fused_add_rms_norm(h, residual, w[5], eps);
        h = linear(h, w[6], w[7], std::nullopt, 2 * w[8].size(1), few_rows);
        h = linear(silu_and_mul(h), w[8], w[9], std::nullopt, H, few_rows);
    }
    return std::get<0>(fused_add_rms_norm(h, residual, weights[10 * layers], eps));
}

}  // namespace

/* The operators' schemas (what torch.compile and the dispatcher see); their shape functions for
 * tracing are in cpu_kernels.py (torch.library.register_fake). */
TORCH_LIBRARY(minivllm_cpu, m) {
    m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
          "float scale, Tensor(a!) out, int window, int parts) -> ()");
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) "
          "-> (Tensor, Tensor)");
    m.def("silu_and_mul(Tensor x) -> Tensor");
    m.def("pack_panels(Tensor weight) -> Tensor");
    m.def("few_rows_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
    m.def("few_rows_max() -> int", &few_rows_max);  /* no tensor: one kernel for all */
    m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache) "
          "-> (Tensor, Tensor)");
    m.def("race_sample(Tensor probs, Tensor keys) -> Tensor");
    m.def("paged_prefill(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
          "Tensor query_start_loc, float scale, Tensor(a!) out, int window, int parts) -> ()");
    m.def("decoder_layers(Tensor hidden, Tensor positions, Tensor slots, Tensor block_tables, "
          "Tensor seq_lens, Tensor query_start_loc, int num_decodes, Tensor[] weights, "
          "Tensor?[] qkv_biases, Tensor(a!)[] kv_caches, Tensor cos_sin_cache, int[] windows, "
          "int[] heads, float eps, float scale, int few_rows, Tensor? keep=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
    m.impl("paged_decode", &paged_decode);
    m.impl("rms_norm", &rms_norm);
    m.impl("fused_add_rms_norm", &fused_add_rms_norm);
    m.impl("silu_and_mul", &silu_and_mul);
    m.impl("pack_panels", &pack_panels);
    m.impl("few_rows_linear", &few_rows_linear);
    m.impl("rotary_embedding", &rotary_embedding);
    m.impl("race_sample", &race_sample);
    m.impl("paged_prefill", &paged_prefill);
    m.impl("decoder_layers", &decoder_layers);
}

/* oneDNN's copies of the weights are tensors of torch's MkldnnCPU backend */
TORCH_LIBRARY_IMPL(minivllm_cpu, MkldnnCPU, m) {
    m.impl("decoder_layers", &decoder_layers);
}
