/* Byte-level BPE encoding, equal to Hugging Face tokenizers' BPE model behind GPT-2's
 * ByteLevel pre-tokenizer (add_prefix_space=false, use_regex=true):
 *
 * 1. the text (UTF-8) is cut into pieces by GPT-2's pattern
 *      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *    written out as a scanner over code points; the letter / number / whitespace class
 *    of every code point comes from a table the caller builds (tinylm/native/bpe.py);
 * 2. each piece's bytes become the byte tokens, then the adjacent pair with the lowest
 *    merge rank is merged, the leftmost of equal pairs first, until no pair has a merge
 *    (HF's Word::merge_all: the same order as its (rank, position) heap);
 * 3. a word cache maps a piece's bytes to its ids, so a repeated word costs one lookup.
 *
 * One encoder (tl_bpe) per tokenizer and process; it is not thread-safe (the cache).
 */
#include "tinylm.h"

#include <stdint.h>

enum { C_OTHER = 0, C_LETTER = 1, C_NUMBER = 2, C_SPACE = 3 };
#define N_CODES 0x110000
#define SHORT_WORD 48        /* longer words merge with a heap, shorter by scanning */
#define CACHE_MAX_WORD 64    /* longer pieces are not cached */
#define CACHE_MAX_POOL (48L << 20)  /* bytes of keys + ids before the cache is emptied */

typedef struct { uint64_t key; uint32_t rank, id; } merge_slot;  /* key 0: empty */
typedef struct { uint64_t hash; uint32_t key, ids; uint16_t klen, nids; } cache_slot;

typedef struct {
    merge_slot *merges;
    uint64_t merge_mask;
    uint32_t byte_id[256];
    unsigned char *classes;  /* N_CODES entries */
    cache_slot *cache;
    uint64_t cache_mask, cache_used;
    unsigned char *pool;     /* cached keys and ids (ids 4-aligned) */
    size_t pool_len, pool_cap;
    /* scratch of the merge step, grown to the longest word seen */
    uint32_t *sym, *rank, *next, *prev, *heap_rank, *heap_pos;
    size_t scratch_cap;
} tl_bpe;

static inline uint64_t pair_key(uint32_t a, uint32_t b) {
    return ((uint64_t)a << 32 | b) + 1;  /* never 0 */
}

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static uint64_t hash_bytes(const unsigned char *p, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
        p += 8; n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    return mix(h ^ w) | 1;  /* never 0: 0 marks an empty slot */
}

/* --- the merge table ---------------------------------------------------------------- */

static const merge_slot *find_merge(const tl_bpe *t, uint32_t a, uint32_t b) {
    uint64_t key = pair_key(a, b);
    for (uint64_t i = mix(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const merge_slot *s = &t->merges[i];
        if (s->key == key) return s;
        if (s->key == 0) return NULL;
    }
}

static inline uint32_t rank_of(const tl_bpe *t, uint32_t a, uint32_t b) {
    const merge_slot *s = find_merge(t, a, b);
    return s ? s->rank : UINT32_MAX;
}

/* --- merging one word --------------------------------------------------------------- */

static int grow_scratch(tl_bpe *t, size_t n) {
    if (n <= t->scratch_cap) return 0;
    size_t cap = n < 256 ? 256 : n * 2;
    uint32_t **bufs[] = {&t->sym, &t->rank, &t->next, &t->prev, &t->heap_rank, &t->heap_pos};
    for (size_t k = 0; k < sizeof bufs / sizeof *bufs; k++) {
        uint32_t *p = realloc(*bufs[k], cap * sizeof(uint32_t));
        if (!p) return TL_NOMEM;
        *bufs[k] = p;
    }
    t->scratch_cap = cap;
    return 0;
}

/* Short words: the lowest-rank adjacent pair, leftmost first, by scanning; returns the
 * number of symbols left in t->sym. */
static size_t merge_short(const tl_bpe *t, size_t n) {
    uint32_t *sym = t->sym, *rank = t->rank;
    for (size_t i = 0; i + 1 < n; i++) rank[i] = rank_of(t, sym[i], sym[i + 1]);
    while (n > 1) {
        size_t best = 0;
        for (size_t i = 1; i + 1 < n; i++)
            if (rank[i] < rank[best]) best = i;
        if (rank[best] == UINT32_MAX) break;
        sym[best] = find_merge(t, sym[best], sym[best + 1])->id;
        memmove(sym + best + 1, sym + best + 2, (n - best - 2) * sizeof *sym);
        memmove(rank + best + 1, rank + best + 2, (n - best - 2) * sizeof *rank);
        n--;
        if (best > 0) rank[best - 1] = rank_of(t, sym[best - 1], sym[best]);
        if (best + 1 < n) rank[best] = rank_of(t, sym[best], sym[best + 1]);
    }
    return n;
}

/* The heap of (rank, position) pairs, least first: HF's order. */
static inline int heap_less(const uint32_t *r, const uint32_t *p, size_t i, size_t j) {
    return r[i] < r[j] || (r[i] == r[j] && p[i] < p[j]);
}

static void heap_push(uint32_t *r, uint32_t *p, size_t *len, uint32_t rank, uint32_t pos) {
    size_t i = (*len)++;
    r[i] = rank; p[i] = pos;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!heap_less(r, p, i, up)) break;
        uint32_t tr = r[i], tp = p[i];
        r[i] = r[up]; p[i] = p[up]; r[up] = tr; p[up] = tp;
        i = up;
    }
}

static void heap_pop(uint32_t *r, uint32_t *p, size_t *len) {
    size_t n = --(*len), i = 0;
    r[0] = r[n]; p[0] = p[n];
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        if (l < n && heap_less(r, p, l, m)) m = l;
        if (l + 1 < n && heap_less(r, p, l + 1, m)) m = l + 1;
        if (m == i) break;
        uint32_t tr = r[i], tp = p[i];
        r[i] = r[m]; p[i] = p[m]; r[m] = tr; p[m] = tp;
        i = m;
    }
}

/* Long words: HF's algorithm itself, symbols in a linked list, candidate merges in a
 * heap (at most one entry per merge made plus the n - 1 first pairs). */
static size_t merge_long(tl_bpe *t, size_t n) {
    uint32_t *sym = t->sym, *next = t->next, *prev = t->prev;
    uint32_t *hr = t->heap_rank, *hp = t->heap_pos;
    const uint32_t END = UINT32_MAX;
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        next[i] = i + 1 < n ? (uint32_t)(i + 1) : END;
        prev[i] = i > 0 ? (uint32_t)(i - 1) : END;
        t->rank[i] = 1;  /* alive */
    }
    for (size_t i = 0; i + 1 < n; i++) {
        uint32_t r = rank_of(t, sym[i], sym[i + 1]);
        if (r != UINT32_MAX) heap_push(hr, hp, &len, r, (uint32_t)i);
    }
    while (len > 0) {
        uint32_t r = hr[0], pos = hp[0];
        heap_pop(hr, hp, &len);
        if (!t->rank[pos] || next[pos] == END) continue;
        uint32_t right = next[pos];
        const merge_slot *m = find_merge(t, sym[pos], sym[right]);
        if (!m || m->rank != r) continue;  /* a pair that has changed since */
        sym[pos] = m->id;
        t->rank[right] = 0;
        next[pos] = next[right];
        if (next[right] != END) prev[next[right]] = pos;
        /* each merge removes a symbol and adds at most two entries: 3n slots do */
        if (prev[pos] != END) {
            uint32_t rr = rank_of(t, sym[prev[pos]], sym[pos]);
            if (rr != UINT32_MAX) heap_push(hr, hp, &len, rr, prev[pos]);
        }
        if (next[pos] != END) {
            uint32_t rr = rank_of(t, sym[pos], sym[next[pos]]);
            if (rr != UINT32_MAX) heap_push(hr, hp, &len, rr, pos);
        }
    }
    size_t k = 0;
    for (uint32_t i = 0; i != END && i < n; i = next[i]) sym[k++] = sym[i];
    return k;
}

/* The ids of one piece into t->sym; returns their count, or -1 when out of memory. */
static long merge_word(tl_bpe *t, const unsigned char *p, size_t n) {
    if (grow_scratch(t, 3 * n + 2)) return -1;
    for (size_t i = 0; i < n; i++) t->sym[i] = t->byte_id[p[i]];
    return (long)(n <= SHORT_WORD ? merge_short(t, n) : merge_long(t, n));
}

/* --- the word cache ----------------------------------------------------------------- */

static void cache_clear(tl_bpe *t) {
    memset(t->cache, 0, (t->cache_mask + 1) * sizeof *t->cache);
    t->cache_used = 0;
    t->pool_len = 0;
}

static int cache_grow(tl_bpe *t) {
    uint64_t cap = (t->cache_mask + 1) * 2;
    cache_slot *fresh = calloc(cap, sizeof *fresh);
    if (!fresh) return TL_NOMEM;
    for (uint64_t i = 0; i <= t->cache_mask; i++) {
        cache_slot s = t->cache[i];
        if (!s.hash) continue;
        uint64_t j = s.hash & (cap - 1);
        while (fresh[j].hash) j = (j + 1) & (cap - 1);
        fresh[j] = s;
    }
    free(t->cache);
    t->cache = fresh;
    t->cache_mask = cap - 1;
    return 0;
}

static int pool_reserve(tl_bpe *t, size_t more) {
    if (t->pool_len + more <= t->pool_cap) return 0;
    size_t cap = t->pool_cap * 2 + more;
    unsigned char *p = realloc(t->pool, cap);
    if (!p) return TL_NOMEM;
    t->pool = p;
    t->pool_cap = cap;
    return 0;
}

/* Append the ids of piece p[0:n] to out; returns how many, or -1 when out of memory. */
static long encode_piece(tl_bpe *t, const unsigned char *p, size_t n, uint32_t *out) {
    if (n == 1) {
        out[0] = t->byte_id[p[0]];
        return 1;
    }
    if (n > CACHE_MAX_WORD) {
        long k = merge_word(t, p, n);
        if (k > 0) memcpy(out, t->sym, (size_t)k * sizeof *out);
        return k;
    }
    uint64_t h = hash_bytes(p, n), i = h & t->cache_mask;
    for (;; i = (i + 1) & t->cache_mask) {
        cache_slot *s = &t->cache[i];
        if (!s->hash) break;
        if (s->hash == h && s->klen == n && !memcmp(t->pool + s->key, p, n)) {
            memcpy(out, t->pool + s->ids, (size_t)s->nids * sizeof *out);
            return s->nids;
        }
    }
    long k = merge_word(t, p, n);
    if (k < 0) return -1;
    memcpy(out, t->sym, (size_t)k * sizeof *out);
    size_t need = n + 3 + (size_t)k * 4;
    if (t->pool_len + need > CACHE_MAX_POOL) {  /* bounded memory: start over */
        cache_clear(t);
        i = h & t->cache_mask;
    }
    if (pool_reserve(t, need)) return k;  /* no room to cache it: still encoded */
    cache_slot s = {h, (uint32_t)t->pool_len, 0, (uint16_t)n, (uint16_t)k};
    memcpy(t->pool + t->pool_len, p, n);
    t->pool_len = (t->pool_len + n + 3) & ~(size_t)3;
    s.ids = (uint32_t)t->pool_len;
    memcpy(t->pool + t->pool_len, t->sym, (size_t)k * 4);
    t->pool_len += (size_t)k * 4;
    t->cache[i] = s;
    if (++t->cache_used * 2 > t->cache_mask + 1 && cache_grow(t)) cache_clear(t);
    return k;
}

/* --- pre-tokenization ----------------------------------------------------------------- */

/* The code point at p (valid UTF-8, as Python encodes it) and its byte length. */
static inline uint32_t decode(const unsigned char *p, int *len) {
    uint32_t c = p[0];
    if (c < 0x80) { *len = 1; return c; }
    if (c < 0xE0) { *len = 2; return (c & 0x1F) << 6 | (p[1] & 0x3F); }
    if (c < 0xF0) { *len = 3; return (c & 0x0F) << 12 | (p[1] & 0x3F) << 6 | (p[2] & 0x3F); }
    *len = 4;
    return (c & 0x07) << 18 | (p[1] & 0x3F) << 12 | (p[2] & 0x3F) << 6 | (p[3] & 0x3F);
}

static inline int class_at(const tl_bpe *t, const unsigned char *p, const unsigned char *end,
                           int *len) {
    if (p >= end) { *len = 0; return -1; }
    uint32_t c = decode(p, len);
    return c < N_CODES ? t->classes[c] : C_OTHER;
}

/* The end of a run of characters of class cls starting at p. */
static inline const unsigned char *run_of(const tl_bpe *t, const unsigned char *p,
                                          const unsigned char *end, int cls) {
    int len;
    while (p < end) {
        if (*p < 0x80) {
            if (t->classes[*p] != cls) break;
            p++;
            continue;
        }
        if (class_at(t, p, end, &len) != cls) break;
        p += len;
    }
    return p;
}

/* A contraction ('s 't 're 've 'm 'll 'd) at p: its length, else 0. */
static inline int contraction(const unsigned char *p, const unsigned char *end) {
    if (p + 1 >= end || p[0] != '\'') return 0;
    unsigned char a = p[1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (p + 2 >= end) return 0;
    unsigned char b = p[2];
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* The end of the piece that starts at p (p < end): GPT-2's pattern, alternative by
 * alternative. */
static const unsigned char *piece_end(const tl_bpe *t, const unsigned char *p,
                                      const unsigned char *end) {
    int len, len2;
    int k = contraction(p, end);
    if (k) return p + k;
    int cls = class_at(t, p, end, &len);
    if (*p == ' ') {  /* " ?X+" when a letter, number or other follows the space */
        int next = class_at(t, p + 1, end, &len2);
        if (next >= 0 && next != C_SPACE) return run_of(t, p + 1 + len2, end, next);
    }
    if (cls != C_SPACE) return run_of(t, p + len, end, cls);
    /* \s+(?!\S) then \s+: a whitespace run, less its last character when a non-space
     * follows it (and it has more than one) */
    const unsigned char *q = p + len, *last = p;
    while (q < end) {
        if (class_at(t, q, end, &len2) != C_SPACE) break;
        last = q;
        q += len2;
    }
    return (q < end && last > p) ? last : q;
}

/* --- the exported functions ----------------------------------------------------------- */

TL_API void tl_bpe_free(void *handle) {
    tl_bpe *t = handle;
    if (!t) return;
    free(t->merges); free(t->classes); free(t->cache); free(t->pool);
    free(t->sym); free(t->rank); free(t->next); free(t->prev);
    free(t->heap_rank); free(t->heap_pos);
    free(t);
}

TL_API void *tl_bpe_new(const unsigned *merges, long n_merges, const unsigned *byte_ids,
                        const unsigned char *classes) {
    tl_bpe *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    uint64_t cap = 16;
    while (cap < (uint64_t)n_merges * 2 + 2) cap *= 2;
    t->merges = calloc(cap, sizeof *t->merges);
    t->merge_mask = cap - 1;
    t->classes = malloc(N_CODES);
    t->cache = calloc(1 << 12, sizeof *t->cache);
    t->cache_mask = (1 << 12) - 1;
    t->pool_cap = 1 << 16;
    t->pool = malloc(t->pool_cap);
    if (!t->merges || !t->classes || !t->cache || !t->pool || grow_scratch(t, 256)) {
        tl_bpe_free(t);
        return NULL;
    }
    memcpy(t->classes, classes, N_CODES);
    memcpy(t->byte_id, byte_ids, sizeof t->byte_id);
    for (long r = 0; r < n_merges; r++) {  /* a pair listed twice: the later rank wins */
        uint64_t key = pair_key(merges[3 * r], merges[3 * r + 1]);
        uint64_t i = mix(key) & t->merge_mask;
        while (t->merges[i].key && t->merges[i].key != key) i = (i + 1) & t->merge_mask;
        t->merges[i] = (merge_slot){key, (uint32_t)r, merges[3 * r + 2]};
    }
    return t;
}

/* Encode n texts, text i being bytes [ends[i-1], ends[i]) of text (ends[-1] = 0): the ids
 * of all into out (room for ends[n-1] ids: never more ids than bytes), the count of each
 * into lengths. Returns the total, or -1 when out of memory. */
TL_API long tl_bpe_encode(void *handle, const char *text, const long *ends, long n,
                          unsigned *out, long *lengths) {
    tl_bpe *t = handle;
    const unsigned char *base = (const unsigned char *)text;
    long total = 0, start = 0;
    for (long i = 0; i < n; i++) {
        const unsigned char *p = base + start, *end = base + ends[i];
        long before = total;
        while (p < end) {
            const unsigned char *q = piece_end(t, p, end);
            long k = encode_piece(t, p, (size_t)(q - p), out + total);
            if (k < 0) return -1;
            total += k;
            p = q;
        }
        lengths[i] = total - before;
        start = ends[i];
    }
    return total;
}

/* The pieces of text[0:len] (pre-tokenization only): their end offsets into ends (room
 * for len); returns their count. */
TL_API long tl_bpe_split(void *handle, const char *text, long len, long *ends) {
    const tl_bpe *t = handle;
    const unsigned char *p = (const unsigned char *)text, *end = p + len;
    long n = 0;
    while (p < end) {
        p = piece_end(t, p, end);
        ends[n++] = (long)(p - (const unsigned char *)text);
    }
    return n;
}
