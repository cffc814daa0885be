/* Decode attention straight over meshlm's paged KV cache, fp32: the kernel `infer/native.py`
 * compiles and `DecodeBatch` calls on a CPU (its torch path, two embedding_bag sums, gives the same numbers).
 *
 * Layouts (those of `new_kv_cache`; every array contiguous):
 *   q        [num_kv, batch, groups, dim]     the decode queries, already multiplied by the softmax scale
 *   k_cache  [num_kv, num_blocks, dim, block] a key block transposed: one row of `block` keys per head dim
 *   v_cache  [num_kv, num_blocks, block, dim]
 *   blocks   [batch, width]   the cache blocks decode b attends, in key order
 *   counts   [batch, width]   how many keys of each it sees (its first ones); 0 skips the entry
 *   out      [num_kv, batch, groups, dim]
 *   lse      [num_kv, batch, groups] or NULL: log-sum-exp of the scores (-inf, and out 0, where no key is seen)
 *   scratch  meshlm_decode_attention_scratch(groups, width, block, threads) floats: per thread, the scores
 *            of one (kv head, decode)
 *   threads  how many threads share the (kv head, decode) pairs, each a contiguous run of them (OpenMP,
 *            where the library was compiled with it: the runtime torch itself uses; else one)
 *
 * Per (kv head, decode): the scores of its `groups` query heads against every key it sees (a key row is
 * read once for all of them), an exact softmax (max, then exp and sum), then the weighted sum of the value
 * rows (each read once for all query heads). Each key and value is read once; nothing is copied. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Register tiles of CHUNK floats (one 512-bit vector, or two 256-bit ones, or what the CPU has: GCC/Clang
 * vector extensions, lowered for the target), summed in registers over a whole reduction and stored once.
 * Summing through the scratch or the output row instead chains every step through a store and a load,
 * several times slower. */
#define CHUNK 16
typedef float vf __attribute__((vector_size(CHUNK * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(CHUNK * sizeof(int32_t))));

static inline vf load(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store(float *p, vf x) { memcpy(p, &x, sizeof x); }

/* A block is its own 4 KiB page or so, where the hardware prefetcher stops: software asks ahead. */
static inline void prefetch(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);
}

static void prefetch_decode(const float *k_cache, const float *v_cache, const int32_t *blk, const int32_t *cnt,
                            int64_t h, int64_t dim, int64_t block, int64_t num_blocks, int64_t width) {
    for (int64_t j = 0; j < width; ++j) {
        if (cnt[j] <= 0) continue;
        prefetch(k_cache + (h * num_blocks + blk[j]) * dim * block, dim * block);
        prefetch(v_cache + (h * num_blocks + blk[j]) * block * dim, cnt[j] * dim);
    }
}

/* e^x for x <= 0 (a score minus its row's max), 0 below -87: x = n ln2 + r with |r| <= ln2/2, e^r by its
 * Taylor polynomial to r^7 (relative error < 2e-7), 2^n put into the exponent bits. */
static inline vf exp_nonpositive(vf x) {
    const vi live = x >= -87.0f, low = (vi)((vf){0} - 87.0f);
    x = (vf)(((vi)x & live) | (low & ~live)); /* max(x, -87) */
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* rounded to the nearest integer */
    const vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;           /* ln2 in two parts */
    vf p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vf scale = (vf)((__builtin_convertvector(n, vi) + 127) << 23);
    return (vf)((vi)(p * scale) & live);
}

/* out[col] (=, or += with `add`) sum over i < n of w[i] * x[i * stride + col], for col < cols: the scores of
 * one query against a key block (rows: head dims, columns: keys) and a query's output from a value block
 * (rows: keys, columns: head dims) are both this. Columns go CHUNK at a time in registers -- two tiles side
 * by side where they fit, so each row is read in address order, whole cache lines, as the hardware
 * prefetcher likes, in two chains per tile; else one tile in four chains (an FMA's latency hidden) --
 * and one at a time where cols is not a multiple of CHUNK. Whole tiles may read and write up to `room`
 * columns (>= cols): the scores' scratch has that room, an output row has none beyond its cols. */
static void weighted_rows(const float *restrict w, const float *restrict x, int64_t n, int64_t stride,
                          int64_t cols, int64_t room, float *restrict out, int add) {
    int64_t c0 = 0;
    for (; c0 + CHUNK < cols && c0 + 2 * CHUNK <= room; c0 += 2 * CHUNK) {
        const float *xc = x + c0;
        vf a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};
        int64_t i = 0;
        for (; i + 2 <= n; i += 2) {
            a0 += w[i] * load(xc + i * stride);
            b0 += w[i] * load(xc + i * stride + CHUNK);
            a1 += w[i + 1] * load(xc + (i + 1) * stride);
            b1 += w[i + 1] * load(xc + (i + 1) * stride + CHUNK);
        }
        for (; i < n; ++i) {
            a0 += w[i] * load(xc + i * stride);
            b0 += w[i] * load(xc + i * stride + CHUNK);
        }
        if (add) {
            a0 += load(out + c0);
            b0 += load(out + c0 + CHUNK);
        }
        store(out + c0, a0 + a1);
        store(out + c0 + CHUNK, b0 + b1);
    }
    for (; c0 < cols && c0 + CHUNK <= room; c0 += CHUNK) {
        const float *xc = x + c0;
        vf a0 = add ? load(out + c0) : (vf){0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
            a0 += w[i] * load(xc + i * stride);
            a1 += w[i + 1] * load(xc + (i + 1) * stride);
            a2 += w[i + 2] * load(xc + (i + 2) * stride);
            a3 += w[i + 3] * load(xc + (i + 3) * stride);
        }
        for (; i < n; ++i) a0 += w[i] * load(xc + i * stride);
        store(out + c0, (a0 + a1) + (a2 + a3));
    }
    for (; c0 < cols; ++c0) {
        float a = add ? out[c0] : 0.0f;
        for (int64_t i = 0; i < n; ++i) a += w[i] * x[i * stride + c0];
        out[c0] = a;
    }
}

/* The floats `scratch` holds: per thread, the scores of each query head of one decode, plus room for a
 * last tile. */
int64_t meshlm_decode_attention_scratch(int64_t groups, int64_t width, int64_t block, int64_t threads) {
    return threads * groups * (width * block + CHUNK);
}

void meshlm_decode_attention(const float *restrict q, const float *restrict k_cache,
                             const float *restrict v_cache, const int32_t *restrict blocks,
                             const int32_t *restrict counts, float *restrict out, float *restrict lse,
                             float *restrict scratch, int64_t num_kv, int64_t batch, int64_t groups,
                             int64_t dim, int64_t block, int64_t num_blocks, int64_t width, int64_t threads) {
    const int64_t stride = width * block + CHUNK; /* scores of one query head in `scratch`, room for a tile */
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t hb = 0; hb < num_kv * batch; ++hb) {
        const int64_t h = hb / batch, b = hb % batch;
#ifdef _OPENMP
        float *restrict scores = scratch + omp_get_thread_num() * groups * stride;
#else
        float *restrict scores = scratch;
#endif
        const int32_t *blk = blocks + b * width, *cnt = counts + b * width;
        const float *qb = q + (h * batch + b) * groups * dim;
        float *ob = out + (h * batch + b) * groups * dim;
        /* the next decode's keys and values on their way to the cache while this one computes */
        if (b + 1 < batch)
            prefetch_decode(k_cache, v_cache, blk + width, cnt + width, h, dim, block, num_blocks, width);
        else if (h + 1 < num_kv)
            prefetch_decode(k_cache, v_cache, blocks, counts, h + 1, dim, block, num_blocks, width);
        /* scores: s[g][key] = sum_d q[g][d] * K[d][key] (keys past c land in the next block's place or the
         * room, to be overwritten) */
        int64_t seen = 0;
        for (int64_t j = 0; j < width; ++j) {
            const int64_t c = cnt[j];
            if (c <= 0) continue;
            const float *kb = k_cache + (h * num_blocks + blk[j]) * dim * block;
            for (int64_t g = 0; g < groups; ++g)
                weighted_rows(qb + g * dim, kb, dim, block, c, block, scores + g * stride + seen, 0);
            seen += c;
        }
        /* softmax per query head, the probabilities left in `scores` */
        for (int64_t g = 0; g < groups; ++g) {
            float *s = scores + g * stride;
            float top = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t < seen; ++t) top = s[t] > top ? s[t] : top;
            vf part = {0};
            int64_t t = 0;
            for (; t + CHUNK <= seen; t += CHUNK) {
                const vf e = exp_nonpositive(load(s + t) - top);
                store(s + t, e);
                part += e;
            }
            if (t < seen) { /* the last keys: a whole tile computed, the ones past `seen` zeroed */
                vf e = exp_nonpositive(load(s + t) - top);
                for (int i = (int)(seen - t); i < CHUNK; ++i) e[i] = 0.0f;
                store(s + t, e);
                part += e;
            }
            for (int i = 0; i < CHUNK; ++i) sum += part[i];
            const float inv = seen ? 1.0f / sum : 0.0f;
            for (t = 0; t < seen; ++t) s[t] *= inv;
            if (lse) lse[(h * batch + b) * groups + g] = seen ? top + logf(sum) : -INFINITY;
            for (int64_t d = 0; d < dim; ++d) ob[g * dim + d] = 0.0f;
        }
        /* output: o[g] = sum_key p[g][key] * V[key] */
        seen = 0;
        for (int64_t j = 0; j < width; ++j) {
            const int64_t c = cnt[j];
            if (c <= 0) continue;
            const float *vb = v_cache + (h * num_blocks + blk[j]) * block * dim;
            for (int64_t g = 0; g < groups; ++g)
                weighted_rows(scores + g * stride + seen, vb, c, dim, dim, dim, ob + g * dim, 1);
            seen += c;
        }
    }
}
