/*
 * route.c — a MoE layer's routing decision for every token of a step, in one call: the
 * router product (as col_matmul), then per token the scores, the group limit, the top-k
 * choice and the mixing weights.
 *
 * Legend: T tokens, D hidden, E experts, G groups (E / G experts each), A = top_k.
 *
 * The families differ only in the steps below, chosen by the col_moe_router fields:
 *   logits   plus a per-expert logit bias (gpt-oss's router bias), if given;
 *   scores   softmax over the E logits (Mixtral, Qwen, OLMoE, DeepSeek-V2), an elementwise
 *            sigmoid (DeepSeek-V3, GLM-4.5), or the logits themselves with a softmax over
 *            the chosen ones only (gpt-oss: top-k first, then softmax) or the sigmoid of
 *            each chosen one (Llama 4: top-k first, then sigmoid);
 *   choice   scores + choice_bias (DeepSeek-V3's e_score_correction_bias), used to choose
 *            only: the weights come from the unbiased scores;
 *   groups   each group scored by its best choice score (DeepSeek-V2) or by the sum of its
 *            best two (DeepSeek-V3); only the experts of the best groups_kept groups may be
 *            chosen;
 *   weights  the chosen experts' scores, renormalised to sum 1 if asked (plus 1e-20 in the
 *            denominator, as transformers writes it: a no-op unless the sum is below 1e-12),
 *            times a per-expert scale (Gemma 4) if given, times `scaling`.
 * Every choice takes the larger value first and, on equal values, the lower index, so the
 * decision is a function of the logits alone.
 */
#include <math.h>

#include "col_internal.h"

/* The top n of v (len), best first, lower index on ties, skipping entries whose mask is 0
 * (mask may be NULL). v is not changed; taken (len) is scratch. */
static void top_n(const float *v, const uint8_t *mask, int64_t len, int64_t n, int32_t *out, uint8_t *taken) {
    memset(taken, 0, (size_t)len);
    for (int64_t a = 0; a < n; a++) {
        int64_t best = -1;
        for (int64_t e = 0; e < len; e++) {
            if (taken[e] || (mask && !mask[e])) continue;
            if (best < 0 || v[e] > v[best]) best = e;
        }
        out[a] = (int32_t)best;
        taken[best] = 1;
    }
}

static void softmax_in_place(float *p, int64_t n) {
    float mx = p[0];
    for (int64_t e = 1; e < n; e++) mx = p[e] > mx ? p[e] : mx;
    float sum = 0.0f;
    for (int64_t e = 0; e < n; e++) {
        p[e] = expf(p[e] - mx);
        sum += p[e];
    }
    for (int64_t e = 0; e < n; e++) p[e] /= sum;
}

/* A group's score from the choice scores of its members (size >= 2 for TOP2_SUM). */
static float group_score(const float *choice, int64_t size, int32_t kind) {
    float first = choice[0], second = -INFINITY;
    for (int64_t i = 1; i < size; i++) {
        if (choice[i] > first) {
            second = first;
            first = choice[i];
        } else if (choice[i] > second) {
            second = choice[i];
        }
    }
    return kind == COL_GROUP_SCORE_TOP2_SUM ? first + second : first;
}

typedef struct {           /* per-token scratch, one per call (tokens run one after another) */
    float *choice;         /* (E) scores + choice bias */
    float *groups;         /* (G) group scores */
    uint8_t *allowed;      /* (E) 1: in a kept group */
    uint8_t *taken;        /* (max(E, G)) for top_n */
    int32_t *kept;         /* (G) kept groups */
} route_scratch;

/* Token t: scores (E) is the token's logits on entry and its scores after. */
static void route_token(const col_moe_router *r, float *scores, const route_scratch *s, int32_t *experts,
                        float *weights) {
    const int64_t E = r->n_experts, G = r->n_groups, per_group = E / G;
    if (r->logit_bias)
        for (int64_t e = 0; e < E; e++) scores[e] += r->logit_bias[e];
    if (r->scoring == COL_ROUTER_SIGMOID)
        for (int64_t e = 0; e < E; e++) scores[e] = 1.0f / (1.0f + expf(-scores[e]));
    else if (r->scoring == COL_ROUTER_SOFTMAX)
        softmax_in_place(scores, E);
    const float *choice = scores;
    if (r->choice_bias) {
        for (int64_t e = 0; e < E; e++) s->choice[e] = scores[e] + r->choice_bias[e];
        choice = s->choice;
    }
    const uint8_t *allowed = NULL;
    if (r->groups_kept < G) {
        for (int64_t g = 0; g < G; g++) s->groups[g] = group_score(choice + g * per_group, per_group, r->group_score);
        top_n(s->groups, NULL, G, r->groups_kept, s->kept, s->taken);
        memset(s->allowed, 0, (size_t)E);
        for (int64_t i = 0; i < r->groups_kept; i++) memset(s->allowed + s->kept[i] * per_group, 1, (size_t)per_group);
        allowed = s->allowed;
    }
    top_n(choice, allowed, E, r->top_k, experts, s->taken);
    float sum = 0.0f;
    for (int64_t a = 0; a < r->top_k; a++) {
        weights[a] = scores[experts[a]];
        sum += weights[a];
    }
    if (r->scoring == COL_ROUTER_TOPK_SOFTMAX) { /* experts[0] holds the largest logit */
        softmax_in_place(weights, r->top_k);
        sum = 1.0f;
    } else if (r->scoring == COL_ROUTER_TOPK_SIGMOID) { /* chosen by logit: a sigmoid could round two to 1 */
        sum = 0.0f;
        for (int64_t a = 0; a < r->top_k; a++) {
            weights[a] = 1.0f / (1.0f + expf(-weights[a]));
            sum += weights[a];
        }
    }
    if (r->normalize)
        for (int64_t a = 0; a < r->top_k; a++) weights[a] /= sum + 1e-20f;
    if (r->expert_scale)
        for (int64_t a = 0; a < r->top_k; a++) weights[a] *= r->expert_scale[experts[a]];
    for (int64_t a = 0; a < r->top_k; a++) weights[a] *= r->scaling;
}

size_t col_moe_router_size(void) { return sizeof(col_moe_router); }

static int router_valid(const col_moe_router *r) {
    const int64_t E = r->n_experts, G = r->n_groups;
    if (E <= 0 || r->dim < 0 || r->top_k < 1 || r->top_k > E || G < 1 || E % G != 0) return 0;
    if (r->groups_kept < 1 || r->groups_kept > G || r->top_k > r->groups_kept * (E / G)) return 0;
    if (r->scoring < COL_ROUTER_SOFTMAX || r->scoring > COL_ROUTER_TOPK_SIGMOID) return 0;
    if (r->group_score != COL_GROUP_SCORE_MAX && r->group_score != COL_GROUP_SCORE_TOP2_SUM) return 0;
    if (r->group_score == COL_GROUP_SCORE_TOP2_SUM && G > 1 && E / G < 2) return 0;
    if (!isfinite(r->scaling) || !r->weight || col_type_row_bytes(r->type, r->dim) < 0) return 0;
    return 1;
}

int col_moe_router_route(col_pool *pool, const col_moe_router *router, const float *x, int64_t n_tok,
                         int32_t *experts, float *weights) {
    if (!router || !router_valid(router) || n_tok < 0) return COL_EINVAL;
    if (n_tok == 0) return COL_OK;
    if (!x || !experts || !weights) return COL_EINVAL;
    const col_moe_router *r = router;
    const size_t E = (size_t)r->n_experts, G = (size_t)r->n_groups;
    /* scratch: logits (T, E) | choice (E) | groups (G) | kept (G) i32 | allowed (E) | taken (max(E, G)) */
    const size_t sz_logits = (size_t)n_tok * E * sizeof(float);
    uint8_t *scratch = col_alloc(sz_logits + E * sizeof(float) + G * (sizeof(float) + sizeof(int32_t)) + 2 * E + G);
    if (!scratch) return COL_ENOMEM;
    float *logits = (float *)scratch;
    route_scratch s;
    s.choice = (float *)(scratch + sz_logits);
    s.groups = s.choice + E;
    s.kept = (int32_t *)(s.groups + G);
    s.allowed = (uint8_t *)(s.kept + G);
    s.taken = s.allowed + E;
    const int status = col_matmul(pool, r->type, r->weight, r->n_experts, r->dim, x, n_tok, logits);
    if (status == COL_OK)
        for (int64_t t = 0; t < n_tok; t++)
            route_token(r, logits + (size_t)t * E, &s, experts + t * r->top_k, weights + t * r->top_k);
    col_free(scratch);
    return status;
}

int col_moe_route(col_pool *pool, int type, const void *router, int64_t n_experts, int64_t dim,
                  const float *x, int64_t n_tok, int64_t top_k, int normalize, int32_t *experts,
                  float *weights) {
    const col_moe_router r = {.n_experts = n_experts, .dim = dim, .top_k = top_k, .n_groups = 1, .groups_kept = 1,
                              .type = type, .scoring = COL_ROUTER_SOFTMAX, .group_score = COL_GROUP_SCORE_MAX,
                              .normalize = normalize != 0, .scaling = 1.0f, .weight = router, .choice_bias = NULL,
                              .logit_bias = NULL, .expert_scale = NULL};
    if (!router) return n_tok == 0 && n_experts > 0 && top_k >= 1 && top_k <= n_experts ? COL_OK : COL_EINVAL;
    return col_moe_router_route(pool, &r, x, n_tok, experts, weights);
}
