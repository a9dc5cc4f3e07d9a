/* minivllm's CPU kernels, float32: paged decode attention and the elementwise ops of a decoder
 * layer (RMSNorm with its residual add, rotary embedding, SiLU-and-mul). minivllm compiles this
 * file with the machine's C compiler the first time it is needed (minivllm/cpu_kernels.py) and
 * calls it through ctypes; the torch code it replaces (attention/torch_backend.py,
 * model/layers.py) computes the same things, and tests/test_cpu_kernels.py compares the two.
 *
 * Decode attention. Layout (attention/backend.py): a layer's K cache is [num_blocks,
 * block_size, kv_heads, d], V the same. Token p of sequence s lives in block
 * block_tables[s][p / block_size], at offset p % block_size. Query head hq reads KV head
 * hq / (heads / kv_heads) (grouped-query attention). Per sequence, block by block: the block's
 * key rows (all KV heads of a token are one contiguous row), eight at a time, are read once and
 * dotted with every query head that uses them; a softmax per head; then the block's value rows
 * are read once and added into every head's output with its probabilities, all while the next
 * block is prefetched. Nothing is gathered or padded, so each layer reads each context token's
 * K and V once. The sequences are split between threads by their context lengths. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_THREADS 64

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
    union { int32_t i; float f; } two_k = { .i = ((int32_t)k + 127) << 23 };
    return y * two_k.f;
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_DOT8
/* q . k_j for the eight key rows k_j = key + j * stride (D floats each, D a multiple of 8), as
 * [dot_0 .. dot_7]: eight independent sums (one sum at a time waits on its own additions'
 * latency), added across their lanes all at once at the end */
static inline __attribute__((always_inline)) __m256 dot8(const float *q, const float *key,
                                                        int64_t stride, const int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key + stride + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key + 2 * stride + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key + 3 * stride + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key + 4 * stride + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key + 5 * stride + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key + 6 * stride + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key + 7 * stride + d), a7);
    }
    /* two rounds of pairwise sums within 128-bit halves, then the halves added */
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20),
                         _mm256_permute2f128_ps(s0, s1, 0x31));
}
#endif

typedef struct {
    const float *q, *k, *v;
    float *out;
    const int32_t *block_tables, *seq_lens;
    int64_t bt_stride, bt_cols, q_stride, out_stride;
    int64_t num_heads, num_kv_heads, head_dim, block_size, num_blocks, window;
    float scale;
    int64_t first, last, max_len; /* this thread's sequences [first, last) */
    int status;                   /* 0, or what went wrong */
} job_t;

/* one sequence, all its heads; D is a compile-time constant in the common cases (see run) */
static inline __attribute__((always_inline)) int attend_sequence(
        const job_t *a, int64_t s, const int64_t D, float *scores) {
    const int64_t kv_heads = a->num_kv_heads, heads = a->num_heads, bs = a->block_size;
    const int64_t group = heads / kv_heads, row = kv_heads * D, len = a->seq_lens[s];
    const int64_t start = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const int64_t n = len - start, first_block = start / bs, end_block = (len + bs - 1) / bs;
    const int32_t *table = a->block_tables + s * a->bt_stride;
    const float *qs = a->q + s * a->q_stride;
    float *os = a->out + s * a->out_stride;
    if (len <= 0) return 1;
    if (end_block > a->bt_cols) return 2;
    for (int64_t b = first_block; b < end_block; b++)
        if (table[b] < 0 || table[b] >= a->num_blocks) return 2;

    /* scores[h * n + (p - start)] = scale * q_h . k_p, eight tokens at a time */
    for (int64_t b = first_block; b < end_block; b++) {
        const int64_t p0 = b * bs > start ? b * bs : start;
        const int64_t p1 = (b + 1) * bs < len ? (b + 1) * bs : len;
        const float *block = a->k + (int64_t)table[b] * bs * row;
        const float *next = b + 1 < end_block ? a->k + (int64_t)table[b + 1] * bs * row : 0;
        for (int64_t p = p0; p < p1; p += 8) {
            const int64_t m = p1 - p < 8 ? p1 - p : 8;
            const float *keys = block + (p - b * bs) * row;
            for (int64_t h = 0; h < heads; h++) {
                if (next) prefetch_part(next + (p - b * bs) * row, m * row, h, heads);
                const float *qh = qs + h * D, *kh = keys + (h / group) * D;
                float *sh = scores + h * n - start + p;
#ifdef HAVE_DOT8
                if (m == 8 && D % 8 == 0) {
                    _mm256_storeu_ps(sh, _mm256_mul_ps(dot8(qh, kh, row, D),
                                                       _mm256_set1_ps(a->scale)));
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
        float *sh = scores + h * n, max = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; t++) max = sh[t] > max ? sh[t] : max;
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
        const float *next = b + 1 < end_block ? a->v + (int64_t)table[b + 1] * bs * row : 0;
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

static void *run(void *arg) {
    job_t *a = (job_t *)arg;
    const int64_t D = a->head_dim;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(a->num_heads * a->max_len));
    if (!scores) { a->status = 3; return 0; }
    for (int64_t s = a->first; s < a->last && !a->status; s++) {
        if (D == 64) a->status = attend_sequence(a, s, 64, scores);  /* constant head_dims */
        else if (D == 128) a->status = attend_sequence(a, s, 128, scores);  /* unroll fully */
        else a->status = attend_sequence(a, s, D, scores);
    }
    free(scores);
    return 0;
}

/* Returns 0, or 1 (a sequence of length < 1), 2 (a block id outside the cache, or a
 * context longer than its block table row), 3 (out of
 * memory), 4 (bad shape). q: [num_seqs] rows of q_stride floats, each [heads, D] contiguous;
 * out likewise with out_stride. window > 0: only the last `window` tokens are attended. */
int minivllm_paged_decode_f32(
        const float *q, const float *k, const float *v, float *out,
        const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
        int64_t bt_stride, int64_t bt_cols, int64_t q_stride, int64_t out_stride, int64_t num_heads,
        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
        int64_t window, float scale, int64_t num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim < 1 || block_size < 1) return 4;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > num_seqs) num_threads = num_seqs > 0 ? num_seqs : 1;
    int64_t total = 0, max_len = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t n = seq_lens[s];
        if (n < 1) return 1;
        if (window > 0 && n > window) n = window;
        total += n;
        max_len = n > max_len ? n : max_len;
    }
    job_t jobs[MAX_THREADS];
    int64_t s = 0, done = 0;
    for (int64_t i = 0; i < num_threads; i++) {
        job_t *j = &jobs[i];
        *j = (job_t){q, k, v, out, block_tables, seq_lens, bt_stride, bt_cols, q_stride, out_stride,
                     num_heads, num_kv_heads, head_dim, block_size, num_blocks, window, scale,
                     s, s, max_len, 0};
        const int64_t target = total * (i + 1) / num_threads;  /* about equal token counts */
        while (s < num_seqs && (done < target || i == num_threads - 1)) {
            int64_t n = seq_lens[s];
            done += (window > 0 && n > window) ? window : n;
            s++;
        }
        j->last = s;
    }
#ifdef _OPENMP
    /* torch's own OpenMP threads (its libgomp is the process's): they are awake and waiting
     * right after torch's previous op, where threads of our own would compete with them */
    #pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int64_t i = 0; i < num_threads; i++) run(&jobs[i]);
#else
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t i = 1; i < num_threads; i++)
        started[i] = pthread_create(&threads[i], 0, run, &jobs[i]) == 0;
    for (int64_t i = 1; i < num_threads; i++)
        if (!started[i]) run(&jobs[i]);  /* no thread: do its share here */
    run(&jobs[0]);
    for (int64_t i = 1; i < num_threads; i++)
        if (started[i]) pthread_join(threads[i], 0);
#endif
    int status = 0;
    for (int64_t i = 0; i < num_threads; i++)
        if (jobs[i].status && !status) status = jobs[i].status;
    return status;
}

/* ---- elementwise ops: rows split between torch's threads when there is enough work ---- */

#define PARALLEL_MIN_ELEMENTS 65536

/* out[i] = weight * r / sqrt(mean(r^2) + eps), r = x[i] (+ residual[i], then also written to
 * residual_out[i]); rows of `hidden` floats with the given row strides (in floats) */
void minivllm_rms_norm_f32(const float *x, int64_t x_stride, const float *residual,
                           int64_t r_stride, const float *weight, float *out, int64_t out_stride,
                           float *residual_out, int64_t ro_stride, int64_t rows, int64_t hidden,
                           float eps, int64_t num_threads) {
    (void)num_threads;
    #pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * x_stride;
        float *oi = out + i * out_stride, sum = 0.f;
        if (residual) {
            const float *ri = residual + i * r_stride;
            float *roi = residual_out + i * ro_stride;
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
}

/* out[i, j] = silu(x[i, j]) * x[i, d + j]: x's rows are [gate | up], silu(g) = g * sigmoid(g) */
void minivllm_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                               int64_t rows, int64_t d, int64_t num_threads) {
    (void)num_threads;
    #pragma omp parallel for num_threads(num_threads) if (rows * d >= PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < rows; i++) {
        const float *gate = x + i * x_stride, *up = gate + d;
        float *oi = out + i * out_stride;
        for (int64_t j = 0; j < d; j++) {
            const float g = gate[j], e = exp_nonpositive(g < 0.f ? g : -g);  /* e^-|g| */
            const float sigmoid = g < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
            oi[j] = g * sigmoid * up[j];
        }
    }
}

/* Rotary embedding, "neox" layout, out of place: for token t at position positions[t], each
 * head's halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin), with cos | sin the row of
 * cos_sin (d/2 each). q: [tokens, heads, d] with token stride q_stride (heads contiguous), k
 * likewise; q_out and k_out contiguous. Returns 1 if a position is outside the table. */
int minivllm_rotary_f32(const int64_t *positions, const float *q, int64_t q_stride,
                        const float *k, int64_t k_stride, const float *cos_sin,
                        int64_t max_position, float *q_out, float *k_out, int64_t tokens,
                        int64_t heads, int64_t kv_heads, int64_t d, int64_t num_threads) {
    (void)num_threads;
    const int64_t half = d / 2;
    int bad = 0;
    #pragma omp parallel for num_threads(num_threads) reduction(| : bad) \
        if (tokens * (heads + kv_heads) * d >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t pos = positions[t];
        if (pos < 0 || pos >= max_position) { bad = 1; continue; }
        const float *cos = cos_sin + pos * d, *sin = cos + half;
        for (int64_t which = 0; which < 2; which++) {
            const int64_t n = which ? kv_heads : heads;
            const float *src = which ? k + t * k_stride : q + t * q_stride;
            float *dst = which ? k_out + t * kv_heads * d : q_out + t * heads * d;
            for (int64_t h = 0; h < n; h++) {
                const float *x1 = src + h * d, *x2 = x1 + half;
                float *o1 = dst + h * d, *o2 = o1 + half;
                for (int64_t j = 0; j < half; j++) {
                    o1[j] = x1[j] * cos[j] - x2[j] * sin[j];
                    o2[j] = x2[j] * cos[j] + x1[j] * sin[j];
                }
            }
        }
    }
    return bad;
}
