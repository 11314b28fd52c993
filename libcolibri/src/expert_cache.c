/*
 * expert_cache.c — (layer, expert) -> slot over a slab and a loader.
 *
 * Every slot of the slab that the cache holds is in one of four states:
 *   LOADING  a read is in flight into it (it is in the map; waiters wait on `loaded`)
 *   READY    its bytes are the record's, checked (in the map)
 *   FAILED   its read failed; it is out of the map and goes back to the slab when the last
 *            pin is released (immediately if it had none)
 *   FREE     back in the slab's free map
 * A slot is evictable when it is READY and has no pins; LOADING and pinned slots never are,
 * so the bytes a layer computes on cannot change under it.
 *
 * One mutex guards everything; I/O completions arrive on loader threads through
 * cache_read_done. No call blocks on I/O while holding the mutex except wait, which sleeps on
 * the condition variable (releasing it).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "aepc_internal.h"

enum { SLOT_FREE = 0, SLOT_LOADING = 1, SLOT_READY = 2, SLOT_FAILED = 3 };

typedef struct {
    int32_t layer, expert;  /* -1, -1 when FREE */
    int32_t state;
    int32_t pins;           /* acquires holding it */
    int32_t prefetched;     /* 1: read by prefetch and not requested since */
    int32_t status;         /* COL_OK, or the failure of its last read */
    int32_t sys_errno;
    uint32_t crc32c;        /* of the bytes read */
    int64_t last_used;      /* cache tick of the last request; 0 for a prefetch not yet requested */
} col_cache_slot;

struct col_expert_cache {
    pthread_mutex_t lock;
    pthread_cond_t loaded;               /* a read completed */
    col_slab *slab;                      /* not owned */
    col_loader *loader;                  /* not owned */
    uint8_t *base;                       /* the slab's region */
    int64_t slot_bytes;
    int32_t n_slots;                     /* S */
    int32_t n_layers, n_experts;         /* L, E */
    int32_t n_record_layers;             /* layers with at least one record */
    int32_t policy;
    int32_t wait_for_pins;               /* see col_expert_cache_params */
    int32_t reads_pending;               /* reads submitted and not completed */
    int64_t tick;                        /* one per expert requested */
    int64_t accesses_since_aging;
    int64_t requests;                    /* count_access calls: the decayed LFU's clock */
    double decay_half_life;              /* in requests */
    int64_t cycle;                       /* passes over the layers: next-use's token clock */
    int32_t last_layer;                  /* of the last request, to see a pass begin */
    double next_use_decay;               /* per cycle: 2^(-1 / next_use_half_life) */
    int32_t *layer_position;             /* (L) index among the layers with records */
    col_expert_record *records;          /* (L, E) */
    int32_t *map;                        /* (L, E) slot, or -1 */
    uint32_t *freq;                      /* (L, E) request counts, halved periodically */
    double *decayed;                     /* (L, E) decayed request score as of decay_stamp */
    int64_t *decay_stamp;                /* (L, E) the request clock when decayed was updated */
    double *decay_rank;                  /* (L, E) log2(decayed) + decay_stamp / half-life: the
                                            order of the scores decayed to any common time */
    double *use_rate;                    /* (L, E) next-use: decayed count of the cycles that
                                            requested it, as of use_cycle */
    int64_t *use_cycle;                  /* (L, E) the cycle use_rate is as of; -1: never */
    int32_t *layer_resident;             /* (L) slots in the map per layer */
    col_cache_slot *slots;               /* (S) */
    col_expert_cache_layer_stats *stats; /* (L) */
};

col_expert_cache_params col_expert_cache_default_params(void) {
    col_expert_cache_params p;
    memset(&p, 0, sizeof p);
    p.policy = COL_POLICY_LRU;
    return p;
}

size_t col_expert_record_size(void) { return sizeof(col_expert_record); }
size_t col_expert_cache_params_size(void) { return sizeof(col_expert_cache_params); }
size_t col_expert_cache_layer_stats_size(void) { return sizeof(col_expert_cache_layer_stats); }
size_t col_expert_load_result_size(void) { return sizeof(col_expert_load_result); }

int col_expert_cache_create(const col_expert_cache_params *params, const col_expert_record *records, col_slab *slab,
                            col_loader *loader, col_expert_cache **out) {
    if (out) *out = NULL;
    if (!params || !records || !slab || !loader || !out || params->n_layers <= 0 || params->n_experts <= 0 ||
        params->policy < 0 || params->policy >= COL_POLICY_COUNT ||
        (int64_t)params->n_layers * params->n_experts > (1 << 24))
        return COL_EINVAL;
    col_slab_info si;
    if (col_slab_get_info(slab, &si) != COL_OK) return COL_EINVAL;
    const int64_t n_keys = (int64_t)params->n_layers * params->n_experts;
    int32_t n_record_layers = 0;
    for (int32_t l = 0; l < params->n_layers; l++) {
        int has = 0;
        for (int32_t e = 0; e < params->n_experts; e++) {
            const col_expert_record *r = &records[(int64_t)l * params->n_experts + e];
            if (r->length < 0 || r->offset < 0 || r->length > si.slot_bytes) return COL_EINVAL;
            if (r->length > 0) has = 1;
        }
        n_record_layers += has;
    }

    col_expert_cache *c = calloc(1, sizeof *c);
    if (!c) return COL_ENOMEM;
    c->records = malloc((size_t)n_keys * sizeof *c->records);
    c->map = malloc((size_t)n_keys * sizeof *c->map);
    c->freq = calloc((size_t)n_keys, sizeof *c->freq);
    c->decayed = calloc((size_t)n_keys, sizeof *c->decayed);
    c->decay_stamp = calloc((size_t)n_keys, sizeof *c->decay_stamp);
    c->decay_rank = malloc((size_t)n_keys * sizeof *c->decay_rank);
    c->use_rate = calloc((size_t)n_keys, sizeof *c->use_rate);
    c->use_cycle = malloc((size_t)n_keys * sizeof *c->use_cycle);
    c->layer_position = calloc((size_t)params->n_layers, sizeof *c->layer_position);
    c->layer_resident = calloc((size_t)params->n_layers, sizeof *c->layer_resident);
    c->slots = calloc((size_t)si.n_slots, sizeof *c->slots);
    c->stats = calloc((size_t)params->n_layers, sizeof *c->stats);
    if (!c->records || !c->map || !c->freq || !c->decayed || !c->decay_stamp || !c->decay_rank || !c->use_rate ||
        !c->use_cycle || !c->layer_position || !c->layer_resident || !c->slots || !c->stats) {
        free(c->records); free(c->map); free(c->freq); free(c->layer_resident); free(c->slots); free(c->stats);
        free(c->decayed); free(c->decay_stamp); free(c->decay_rank);
        free(c->use_rate); free(c->use_cycle); free(c->layer_position);
        free(c);
        return COL_ENOMEM;
    }
    memcpy(c->records, records, (size_t)n_keys * sizeof *records);
    for (int64_t k = 0; k < n_keys; k++) {
        c->map[k] = -1;
        c->decay_rank[k] = -INFINITY; /* never requested: score 0 */
        c->use_cycle[k] = -1;
    }
    for (int32_t l = 0, position = 0; l < params->n_layers; l++) {
        c->layer_position[l] = position;
        for (int32_t e = 0; e < params->n_experts; e++)
            if (records[(int64_t)l * params->n_experts + e].length > 0) {
                position++;
                break;
            }
    }
    for (int32_t s = 0; s < si.n_slots; s++) {
        c->slots[s].layer = c->slots[s].expert = -1;
        c->slots[s].state = SLOT_FREE;
    }
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->loaded, NULL);
    c->slab = slab;
    c->loader = loader;
    col_slab_retain(slab);
    col_loader_retain(loader);
    c->base = col_slab_data(slab);
    c->slot_bytes = si.slot_bytes;
    c->n_slots = (int32_t)si.n_slots;
    c->n_layers = params->n_layers;
    c->n_experts = params->n_experts;
    c->n_record_layers = n_record_layers > 0 ? n_record_layers : 1;
    c->policy = params->policy;
    c->decay_half_life = params->decay_half_life > 0 ? params->decay_half_life : 1024;
    c->next_use_decay = pow(2.0, -1.0 / (params->next_use_half_life > 0 ? params->next_use_half_life : 16));
    c->last_layer = -1;
    c->wait_for_pins = params->wait_for_pins != 0;
    *out = c;
    return COL_OK;
}

void col_expert_cache_destroy(col_expert_cache *c) {
    if (!c) return;
    pthread_mutex_lock(&c->lock);
    while (c->reads_pending > 0) pthread_cond_wait(&c->loaded, &c->lock);
    for (int32_t s = 0; s < c->n_slots; s++)
        if (c->slots[s].state != SLOT_FREE) col_slab_slot_free(c->slab, s);
    pthread_mutex_unlock(&c->lock);
    pthread_cond_destroy(&c->loaded);
    pthread_mutex_destroy(&c->lock);
    col_loader_release(c->loader);
    col_slab_release(c->slab);
    free(c->records); free(c->map); free(c->freq); free(c->layer_resident); free(c->slots); free(c->stats);
    free(c->decayed); free(c->decay_stamp); free(c->decay_rank);
    free(c->use_rate); free(c->use_cycle); free(c->layer_position);
    free(c);
}

/* ---- eviction policies (called with the lock held) ---- */

static int evictable(const col_cache_slot *s, int for_prefetch) {
    return s->state == SLOT_READY && s->pins == 0 && !(for_prefetch && s->prefetched);
}

/* Least recently used among evictable slots; -1 if none. */
static int32_t victim_lru(col_expert_cache *c, int for_prefetch) {
    int32_t best = -1;
    for (int32_t s = 0; s < c->n_slots; s++) {
        const col_cache_slot *sl = &c->slots[s];
        if (evictable(sl, for_prefetch) && (best < 0 || sl->last_used < c->slots[best].last_used)) best = s;
    }
    return best;
}

/* Least frequently used (then least recent) among evictable slots of the layers `pick`
 * accepts: pick 0 = only `layer`, 1 = only layers over quota, 2 = any layer. */
static int32_t victim_lfu(col_expert_cache *c, int32_t layer, int32_t quota, int pick, int for_prefetch) {
    int32_t best = -1;
    uint32_t best_freq = 0;
    for (int32_t s = 0; s < c->n_slots; s++) {
        const col_cache_slot *sl = &c->slots[s];
        if (!evictable(sl, for_prefetch)) continue;
        if (pick == 0 && sl->layer != layer) continue;
        if (pick == 1 && c->layer_resident[sl->layer] <= quota) continue;
        uint32_t f = c->freq[(int64_t)sl->layer * c->n_experts + sl->expert];
        if (best < 0 || f < best_freq || (f == best_freq && sl->last_used < c->slots[best].last_used)) {
            best = s;
            best_freq = f;
        }
    }
    return best;
}

/* LFRU: each layer with records may keep n_slots / n_record_layers slots. A layer at its quota
 * gives up one of its own; a layer under it takes from a layer over quota; LFU within. */
static int32_t victim_lfru(col_expert_cache *c, int32_t layer, int for_prefetch) {
    int32_t quota = c->n_slots / c->n_record_layers;
    if (quota < 1) quota = 1;
    int32_t v = -1;
    if (c->layer_resident[layer] >= quota) v = victim_lfu(c, layer, quota, 0, for_prefetch);
    if (v < 0) v = victim_lfu(c, layer, quota, 1, for_prefetch);
    if (v < 0) v = victim_lfu(c, layer, quota, 2, for_prefetch);
    return v;
}

/* Decayed LFU: the lowest decayed score among evictable slots, then the least recent. Scores
 * are compared through decay_rank, which orders them as if all were decayed to now. */
static int32_t victim_decayed_lfu(col_expert_cache *c, int for_prefetch) {
    int32_t best = -1;
    double best_rank = 0.0;
    for (int32_t s = 0; s < c->n_slots; s++) {
        const col_cache_slot *sl = &c->slots[s];
        if (!evictable(sl, for_prefetch)) continue;
        const double rank = c->decay_rank[(int64_t)sl->layer * c->n_experts + sl->expert];
        if (best < 0 || rank < best_rank || (rank == best_rank && sl->last_used < c->slots[best].last_used)) {
            best = s;
            best_rank = rank;
        }
    }
    return best;
}

/* Next-use: layer steps until key's next request is expected, seen from a request of `layer`.
 * bench/cache_sim.py's next-use does the same double arithmetic. */
static double expected_steps(const col_expert_cache *c, int64_t key, int32_t layer) {
    const int32_t layers = c->n_record_layers;
    int32_t until = (c->layer_position[key / c->n_experts] - c->layer_position[layer]) % layers;
    if (until < 0) until += layers;
    if (until == 0) until = layers;
    const double d = c->next_use_decay;
    double rate = c->use_cycle[key] < 0 ? 0.0
                  : c->use_rate[key] * pow(d, (double)(c->cycle - c->use_cycle[key])) * (1.0 - d);
    if (rate < 1e-9) rate = 1e-9;
    if (rate > 1.0) rate = 1.0;
    return until + layers * (1.0 - rate) / rate;
}

static int32_t victim_next_use(col_expert_cache *c, int32_t layer, int for_prefetch) {
    int32_t best = -1;
    double best_steps = 0.0;
    for (int32_t s = 0; s < c->n_slots; s++) {
        const col_cache_slot *sl = &c->slots[s];
        if (!evictable(sl, for_prefetch)) continue;
        const double steps = expected_steps(c, (int64_t)sl->layer * c->n_experts + sl->expert, layer);
        if (best < 0 || steps > best_steps || (steps == best_steps && sl->last_used < c->slots[best].last_used)) {
            best = s;
            best_steps = steps;
        }
    }
    return best;
}

static int32_t choose_victim(col_expert_cache *c, int32_t layer, int for_prefetch) {
    switch (c->policy) {
    case COL_POLICY_LFRU: return victim_lfru(c, layer, for_prefetch);
    case COL_POLICY_DECAYED_LFU: return victim_decayed_lfu(c, for_prefetch);
    case COL_POLICY_NEXT_USE: return victim_next_use(c, layer, for_prefetch);
    default: return victim_lru(c, for_prefetch);
    }
}

/* A slot for a new entry of `layer`: a free one from the slab, else an evicted one; -1 if
 * every slot is pinned or loading (or, for prefetch, an unused prefetch). */
static int32_t cache_take_slot(col_expert_cache *c, int32_t layer, int for_prefetch) {
    int32_t s;
    if (col_slab_slot_alloc(c->slab, &s) == COL_OK) return s;
    s = choose_victim(c, layer, for_prefetch);
    if (s < 0) return -1;
    col_cache_slot *sl = &c->slots[s];
    c->map[(int64_t)sl->layer * c->n_experts + sl->expert] = -1;
    c->layer_resident[sl->layer]--;
    c->stats[sl->layer].evictions++;
    sl->state = SLOT_FREE;
    sl->layer = sl->expert = -1;
    sl->prefetched = 0;
    return s;
}

static void cache_read_done(void *ctx, int64_t tag, const col_read_result *res);

/* Puts (layer, expert) in slot s and starts its read. */
static void cache_start_read(col_expert_cache *c, int32_t s, int32_t layer, int32_t expert, int32_t pins,
                             int prefetch) {
    const int64_t key = (int64_t)layer * c->n_experts + expert;
    col_cache_slot *sl = &c->slots[s];
    sl->layer = layer;
    sl->expert = expert;
    sl->state = SLOT_LOADING;
    sl->pins = pins;
    sl->prefetched = prefetch;
    sl->status = COL_OK;
    sl->sys_errno = 0;
    sl->crc32c = 0;
    /* A prefetch counts as used long ago until it is requested (acquire stamps it then): the
     * step it was guessed for pins it before choosing victims if it asks for it, and
     * otherwise the wrong guess is the first victim of the next miss, instead of pushing out
     * an expert that was really used. */
    sl->last_used = prefetch ? 0 : ++c->tick;
    c->map[key] = s;
    c->layer_resident[layer]++;
    col_read rd;
    memset(&rd, 0, sizeof rd);
    rd.dst = c->base + (int64_t)s * c->slot_bytes;
    rd.offset = c->records[key].offset;
    rd.length = c->records[key].length;
    rd.crc32c = c->records[key].crc32c;
    c->reads_pending++;
    if (col_loader_submit(c->loader, &rd, prefetch ? COL_PRIORITY_PREFETCH : COL_PRIORITY_DEMAND, cache_read_done, c,
                          s) != COL_OK) {
        col_read_result res;
        memset(&res, 0, sizeof res);
        res.status = COL_EIO;
        res.sys_errno = ENOMEM;
        /* Same path as a failed read; the lock is held, so inline its effect. */
        c->reads_pending--;
        c->stats[layer].load_failures++;
        sl->status = res.status;
        sl->sys_errno = res.sys_errno;
        c->map[key] = -1;
        c->layer_resident[layer]--;
        sl->state = SLOT_FAILED;
        if (sl->pins == 0) {
            sl->state = SLOT_FREE;
            sl->layer = sl->expert = -1;
            col_slab_slot_free(c->slab, s);
        }
    }
}

static void cache_read_done(void *ctx, int64_t tag, const col_read_result *res) {
    col_expert_cache *c = ctx;
    const int32_t s = (int32_t)tag;
    pthread_mutex_lock(&c->lock);
    col_cache_slot *sl = &c->slots[s];
    col_expert_cache_layer_stats *st = &c->stats[sl->layer];
    const int64_t key = (int64_t)sl->layer * c->n_experts + sl->expert;
    st->latency_us[col_latency_bucket(res->latency_ns / 1000)]++;
    sl->status = res->status;
    sl->sys_errno = res->sys_errno;
    sl->crc32c = res->crc32c;
    if (res->status == COL_OK) {
        sl->state = SLOT_READY;
        st->loads++;
        st->bytes_read += c->records[key].length;
    } else {
        st->load_failures++;
        c->map[key] = -1; /* the next request reads it again */
        c->layer_resident[sl->layer]--;
        sl->state = SLOT_FAILED;
        if (sl->pins == 0) { /* an unrequested prefetch: nobody to tell */
            sl->state = SLOT_FREE;
            sl->layer = sl->expert = -1;
            sl->prefetched = 0;
            col_slab_slot_free(c->slab, s);
        }
    }
    c->reads_pending--;
    pthread_cond_broadcast(&c->loaded);
    pthread_mutex_unlock(&c->lock);
}

/* Checks layer, experts[] in range, with records, distinct. */
static int check_request(const col_expert_cache *c, int32_t layer, const int32_t *experts, int32_t n, int distinct) {
    if (layer < 0 || layer >= c->n_layers || n < 0 || (n > 0 && !experts)) return 0;
    for (int32_t i = 0; i < n; i++) {
        if (experts[i] < 0 || experts[i] >= c->n_experts) return 0;
        if (c->records[(int64_t)layer * c->n_experts + experts[i]].length <= 0) return 0;
        if (distinct)
            for (int32_t j = 0; j < i; j++)
                if (experts[j] == experts[i]) return 0;
    }
    return 1;
}

/* score(now) = score(stamp) * 2^-((now - stamp) / h) + 1. bench/cache_sim.py's decayed-lfu
 * policy does the same double arithmetic, so that it predicts this cache's counters exactly. */
static void count_decayed(col_expert_cache *c, int64_t key) {
    const int64_t now = ++c->requests;
    const double h = c->decay_half_life;
    c->decayed[key] = c->decayed[key] * exp2(-(double)(now - c->decay_stamp[key]) / h) + 1.0;
    c->decay_stamp[key] = now;
    c->decay_rank[key] = log2(c->decayed[key]) + (double)now / h;
}

/* Next-use's per-token rate: one count per cycle at most, the cycle advancing when a request's
 * layer is below the previous one's (a new pass over the layers: the next token). */
static void count_cycle(col_expert_cache *c, int64_t key) {
    const int32_t layer = (int32_t)(key / c->n_experts);
    if (layer < c->last_layer) c->cycle++;
    c->last_layer = layer;
    if (c->use_cycle[key] == c->cycle) return;
    const double kept = c->use_cycle[key] < 0 ? 0.0
                        : c->use_rate[key] * pow(c->next_use_decay, (double)(c->cycle - c->use_cycle[key]));
    c->use_rate[key] = kept + 1.0;
    c->use_cycle[key] = c->cycle;
}

static void count_access(col_expert_cache *c, int64_t key) {
    count_decayed(c, key);
    count_cycle(c, key);
    c->freq[key]++;
    if (++c->accesses_since_aging >= 8 * (int64_t)c->n_slots) {
        const int64_t n_keys = (int64_t)c->n_layers * c->n_experts;
        for (int64_t k = 0; k < n_keys; k++) c->freq[k] >>= 1;
        c->accesses_since_aging = 0;
    }
}

/* Slots a new entry could get now (free in the slab, or evictable); *soon: how many more will
 * become evictable when the unpinned reads in flight (prefetches) complete; *held: slots
 * pinned (by anyone), which releases will make evictable. */
static int32_t cache_available(col_expert_cache *c, int32_t *soon, int32_t *held) {
    col_slab_info si;
    col_slab_get_info(c->slab, &si);
    int32_t n = (int32_t)si.n_free, later = 0, pinned = 0;
    for (int32_t s = 0; s < c->n_slots; s++) {
        n += evictable(&c->slots[s], 0);
        later += c->slots[s].state == SLOT_LOADING && c->slots[s].pins == 0;
        pinned += c->slots[s].pins > 0;
    }
    *soon = later;
    *held = pinned;
    return n;
}

int col_expert_cache_acquire(col_expert_cache *c, int32_t layer, const int32_t *experts, int32_t n, int32_t *slots) {
    if (!c || (n > 0 && !slots) || !check_request(c, layer, experts, n, 1)) return COL_EINVAL;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        /* Pin what is already here first, so that making room for the misses cannot evict it. */
        int32_t n_missing = 0, soon = 0, held = 0;
        for (int32_t i = 0; i < n; i++) {
            const int32_t s = c->map[(int64_t)layer * c->n_experts + experts[i]];
            slots[i] = s;
            if (s >= 0) c->slots[s].pins++;
            else n_missing++;
        }
        const int32_t available = cache_available(c, &soon, &held);
        if (n_missing <= available) break;
        int32_t held_by_us = 0;
        for (int32_t i = 0; i < n; i++) {
            if (slots[i] >= 0) held_by_us += c->slots[slots[i]].pins-- == 1; /* LOADING or READY */
            slots[i] = -1;
        }
        const int32_t held_by_others = held - held_by_us;
        const int can_wait = n_missing <= available + soon || (c->wait_for_pins && n <= c->n_slots && held_by_others > 0);
        if (!can_wait) {
            pthread_mutex_unlock(&c->lock);
            return COL_EBUSY;
        }
        /* Prefetches in flight (or, with wait_for_pins, other threads' pins) hold the slots we
         * need: wait for a read to land or a release, then look again (what is in the map may
         * have changed meanwhile). We hold no pins while waiting. */
        pthread_cond_wait(&c->loaded, &c->lock);
    }
    col_expert_cache_layer_stats *st = &c->stats[layer];
    for (int32_t i = 0; i < n; i++) {
        const int64_t key = (int64_t)layer * c->n_experts + experts[i];
        count_access(c, key);
        if (slots[i] >= 0) {
            col_cache_slot *sl = &c->slots[slots[i]];
            if (sl->state == SLOT_READY) st->hits++;
            else st->inflight_hits++;
            if (sl->prefetched) st->prefetch_useful++;
            sl->prefetched = 0;
            sl->last_used = ++c->tick;
            continue;
        }
        const int32_t s = cache_take_slot(c, layer, 0); /* cannot fail: counted above */
        st->misses++;
        slots[i] = s;
        cache_start_read(c, s, layer, experts[i], 1, 0);
    }
    pthread_mutex_unlock(&c->lock);
    return COL_OK;
}

int col_expert_cache_wait(col_expert_cache *c, const int32_t *slots, int32_t n, col_expert_load_result *results) {
    if (!c || n < 0 || (n > 0 && !slots)) return COL_EINVAL;
    for (int32_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= c->n_slots) return COL_EINVAL;
    int status = COL_OK;
    pthread_mutex_lock(&c->lock);
    for (int32_t i = 0; i < n; i++) {
        col_cache_slot *sl = &c->slots[slots[i]];
        while (sl->state == SLOT_LOADING) pthread_cond_wait(&c->loaded, &c->lock);
        const int st = sl->state == SLOT_READY ? COL_OK : (sl->state == SLOT_FAILED ? sl->status : COL_EINVAL);
        if (results) {
            memset(&results[i], 0, sizeof results[i]);
            results[i].status = st;
            results[i].sys_errno = sl->sys_errno;
            results[i].crc32c = sl->crc32c;
        }
        if (st != COL_OK && status == COL_OK) status = st;
    }
    pthread_mutex_unlock(&c->lock);
    return status;
}

int col_expert_cache_release(col_expert_cache *c, const int32_t *slots, int32_t n) {
    if (!c || n < 0 || (n > 0 && !slots)) return COL_EINVAL;
    int status = COL_OK;
    pthread_mutex_lock(&c->lock);
    for (int32_t i = 0; i < n; i++) {
        const int32_t s = slots[i];
        if (s < 0 || s >= c->n_slots || c->slots[s].pins <= 0) {
            status = COL_EINVAL;
            continue;
        }
        col_cache_slot *sl = &c->slots[s];
        if (--sl->pins == 0 && sl->state == SLOT_FAILED) {
            sl->state = SLOT_FREE;
            sl->layer = sl->expert = -1;
            sl->prefetched = 0;
            col_slab_slot_free(c->slab, s);
        }
    }
    if (c->wait_for_pins) pthread_cond_broadcast(&c->loaded); /* an acquire may wait for slots */
    pthread_mutex_unlock(&c->lock);
    return status;
}

int col_expert_cache_prefetch(col_expert_cache *c, int32_t layer, const int32_t *experts, int32_t n, int32_t *issued) {
    if (issued) *issued = 0;
    if (!c || !check_request(c, layer, experts, n, 0)) return COL_EINVAL;
    int32_t started = 0;
    pthread_mutex_lock(&c->lock);
    col_expert_cache_layer_stats *st = &c->stats[layer];
    for (int32_t i = 0; i < n; i++) {
        const int64_t key = (int64_t)layer * c->n_experts + experts[i];
        if (c->map[key] >= 0) continue; /* here or on its way */
        const int32_t s = cache_take_slot(c, layer, 1);
        if (s < 0) {
            st->prefetch_skipped += n - i;
            break;
        }
        cache_start_read(c, s, layer, experts[i], 0, 1);
        st->prefetch_issued++;
        started++;
    }
    pthread_mutex_unlock(&c->lock);
    if (issued) *issued = started;
    return COL_OK;
}

int col_expert_cache_get_stats(col_expert_cache *c, int32_t layer, col_expert_cache_layer_stats *out) {
    if (!c || !out || layer < 0 || layer >= c->n_layers) return COL_EINVAL;
    pthread_mutex_lock(&c->lock);
    *out = c->stats[layer];
    pthread_mutex_unlock(&c->lock);
    return COL_OK;
}

void col_expert_cache_reset_stats(col_expert_cache *c) {
    if (!c) return;
    pthread_mutex_lock(&c->lock);
    memset(c->stats, 0, (size_t)c->n_layers * sizeof *c->stats);
    pthread_mutex_unlock(&c->lock);
}

int col_expert_cache_count(col_expert_cache *c, int32_t *resident, int32_t *pinned) {
    if (!c) return COL_EINVAL;
    int32_t r = 0, p = 0;
    pthread_mutex_lock(&c->lock);
    for (int32_t l = 0; l < c->n_layers; l++) r += c->layer_resident[l];
    for (int32_t s = 0; s < c->n_slots; s++) p += c->slots[s].pins > 0;
    pthread_mutex_unlock(&c->lock);
    if (resident) *resident = r;
    if (pinned) *pinned = p;
    return COL_OK;
}

int col_expert_cache_contains(col_expert_cache *c, int32_t layer, int32_t expert) {
    if (!c || layer < 0 || layer >= c->n_layers || expert < 0 || expert >= c->n_experts) return 0;
    pthread_mutex_lock(&c->lock);
    const int32_t s = c->map[(int64_t)layer * c->n_experts + expert];
    const int here = s >= 0 && c->slots[s].state == SLOT_READY;
    pthread_mutex_unlock(&c->lock);
    return here;
}

int col_expert_cache_set_policy(col_expert_cache *c, int32_t policy) {
    if (!c || policy < 0 || policy >= COL_POLICY_COUNT) return COL_EINVAL;
    pthread_mutex_lock(&c->lock);
    c->policy = policy;
    pthread_mutex_unlock(&c->lock);
    return COL_OK;
}
