// Distributed loads for bindings that run their own collectives: the split (ferry_split_plan)
// and the whole plan (ferry_dist_plan_t, dist/dist_plan.hpp) with the caller's all-reduce.

#include "ferry/distributed.hpp"

#include "capi/internal.hpp"
#include "dist/dist_plan.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

namespace {

// The checked options of a plan; the caller's all-reduce goes into `plan`.
int ToPlanOptions(const ferry_dist_plan_options_t* options, const char* fn, ferry_dist_plan_t* plan,
                  int32_t* nranks, bool* check, uint64_t* own_min_bytes, ferry_error_t* error) {
  if (int rc = CheckSized(options, fn, "options", error); rc != FERRY_OK) return rc;
  if (FERRY_C_HAS(options, rank)) plan->rank = options->rank;
  if (FERRY_C_HAS(options, nranks)) *nranks = options->nranks;
  if (FERRY_C_HAS(options, rounds)) plan->rounds = options->rounds;
  if (FERRY_C_HAS(options, check_plan)) *check = options->check_plan != 0;
  if (FERRY_C_HAS(options, own_min_bytes)) *own_min_bytes = options->own_min_bytes;
  if (*nranks < 1 || plan->rank < 0 || plan->rank >= *nranks || plan->rounds < 1 ||
      plan->rounds > 64) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(fn, ": rank ", plan->rank, " of ", *nranks, " with ", plan->rounds,
                              " rounds (need 0 <= rank < nranks and 1 <= rounds <= 64)"));
  }
  if (FERRY_C_HAS(options, all_reduce_max) && options->all_reduce_max != nullptr) {
    void* user = FERRY_C_HAS(options, all_reduce_user) ? options->all_reduce_user : nullptr;
    plan->all_reduce_max = ToAllReduce(options->all_reduce_max, user);
  } else if (*check) {
    return NullArg(error, fn, "options->all_reduce_max (check_plan is set)");
  }
  return FERRY_OK;
}

// The replicated requests (every tensor when there are none), then the local ones.
int ToDistRequests(const ferry::ShardedCheckpoint& ck, const ferry_load_request_t* requests,
                   size_t n, const ferry_dist_plan_options_t* options, const char* fn,
                   std::vector<ferry::DistributedRequest>* out, ferry_error_t* error) {
  if (n > 0 && requests == nullptr) return NullArg(error, fn, "requests");
  for (size_t i = 0; i < n; ++i) {
    if (requests[i].name == nullptr || requests[i].dst != nullptr) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(fn, ": requests[", i,
                                "] needs a name and no dst (the plan places every item)"));
    }
    ferry::DistributedRequest q;
    q.name = requests[i].name;
    q.row_begin = requests[i].row_begin;
    q.row_end = requests[i].row_end;
    out->push_back(std::move(q));
  }
  size_t num_local = FERRY_C_HAS(options, num_local) ? options->num_local : 0;
  if (num_local == 0) return FERRY_OK;
  if (options->local_names == nullptr) return NullArg(error, fn, "options->local_names");
  if (n == 0) {  // "every tensor" must be spelled out once a local request is there
    for (std::string& name : ck.names()) out->push_back(ferry::DistributedRequest{std::move(name)});
  }
  for (size_t i = 0; i < num_local; ++i) {
    if (options->local_names[i] == nullptr) return NullArg(error, fn, "options->local_names[i]");
    ferry::DistributedRequest q;
    q.name = options->local_names[i];
    q.local = true;
    out->push_back(std::move(q));
  }
  return FERRY_OK;
}

// The plan's C arrays: items, broadcasts in issue order, this rank's reads.
void Export(const ferry::DistPlan& plan, int32_t nranks, ferry_dist_plan_t* out) {
  out->arena_bytes = plan.arena_bytes;
  out->names.reserve(plan.items.size());  // the items point into these strings
  for (const ferry::PlanEntry& m : plan.items) {
    out->names.push_back(m.info.name);
    ferry_dist_item_t c{};
    c.name = out->names.back().c_str();
    c.request = m.request;
    c.shard = m.shard;
    c.bytes = m.len;
    c.row_bytes = m.row_bytes;
    c.arena_offset = m.in_arena ? m.arena_off : FERRY_DIST_OWN_BUFFER;
    c.row_begin = m.whole ? 0 : m.row0;
    c.row_end = m.whole ? -1 : m.row0 + m.info.shape[0];
    out->items.push_back(c);
  }
  for (int32_t k = 0; k < out->rounds; ++k) {
    for (int32_t r = 0; r < nranks; ++r) {
      for (const ferry::PlanBroadcast& b :
           plan.broadcasts[static_cast<size_t>(r) * out->rounds + k]) {
        out->broadcasts.push_back(ferry_dist_broadcast_t{k, b.root, b.item, 0, b.begin, b.bytes});
      }
    }
  }
  const auto mine = ferry::PiecesOf(plan.pieces, out->rank, out->rounds);
  for (int32_t k = 0; k < out->rounds; ++k) {
    for (const ferry::PlanPiece* p : mine[k]) {
      auto [row_begin, row_end] = ferry::PieceRows(plan.items[p->item], *p);
      out->reads.push_back(ferry_dist_read_t{k, p->item, p->begin, p->len, row_begin, row_end});
    }
  }
}

}  // namespace

extern "C" {

int ferry_split_plan(const ferry_plan_item_t* items, size_t num_items, int32_t nranks,
                     int32_t rounds, ferry_plan_piece_t* pieces, size_t capacity, size_t* count,
                     ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(count);
    if (num_items > 0) FERRY_C_REQUIRE(items);
    if (nranks < 1 || rounds < 1) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat("ferry_split_plan: nranks ", nranks, " and rounds ", rounds,
                                " must be at least 1"));
    }
    std::vector<ferry::PlanItem> in(num_items);
    for (size_t i = 0; i < num_items; ++i) in[i] = {items[i].bytes, items[i].row_bytes};
    std::vector<ferry::PlanPiece> plan = ferry::SplitPlan(in, nranks, rounds);
    *count = plan.size();
    if (capacity < plan.size()) return FERRY_OK;
    if (!plan.empty()) FERRY_C_REQUIRE(pieces);
    for (size_t i = 0; i < plan.size(); ++i) {
      pieces[i] = {plan[i].item, plan[i].segment, plan[i].begin, plan[i].len};
    }
    return FERRY_OK;
  });
}

void ferry_dist_plan_options_init(ferry_dist_plan_options_t* options) {
  if (options == nullptr) return;
  ferry::DistributedOptions d;
  std::memset(static_cast<void*>(options), 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->nranks = 1;
  options->rounds = d.rounds;
  options->check_plan = d.check_plan ? 1 : 0;
  options->own_min_bytes = FERRY_DIST_OWN_BUFFER;
}

int ferry_dist_plan_create(const ferry_sharded_t* checkpoint, const ferry_load_request_t* requests,
                           size_t num_requests, const ferry_dist_plan_options_t* options,
                           ferry_dist_plan_t** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(checkpoint);
    FERRY_C_REQUIRE(options);
    FERRY_C_REQUIRE(out);
    auto plan = std::make_unique<ferry_dist_plan_t>();
    plan->checkpoint = checkpoint->sharded;
    int32_t nranks = 1;
    bool check = true;
    uint64_t own_min_bytes = FERRY_DIST_OWN_BUFFER;
    int rc = ToPlanOptions(options, fn, plan.get(), &nranks, &check, &own_min_bytes, error);
    if (rc != FERRY_OK) return rc;
    std::vector<ferry::DistributedRequest> reqs;
    rc = ToDistRequests(*plan->checkpoint, requests, num_requests, options, fn, &reqs, error);
    if (rc != FERRY_OK) return rc;
    auto made =
        ferry::MakeDistPlan(ferry::SourceOf(*plan->checkpoint), reqs, plan->rank, nranks,
                            plan->rounds, own_min_bytes, check ? &plan->all_reduce_max : nullptr);
    if (!made.ok()) return Report(made.status(), error);
    Export(*made, nranks, plan.get());
    *out = plan.release();
    return FERRY_OK;
  });
}

int ferry_dist_plan_view(const ferry_dist_plan_t* plan, ferry_dist_plan_view_t* view,
                         ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(plan);
    FERRY_C_REQUIRE(view);
    if (int rc = CheckSized(view, fn, "view", error); rc != FERRY_OK) return rc;
    ferry_dist_plan_view_t full;
    full.struct_size = sizeof(full);
    full.num_items = plan->items.size();
    full.items = plan->items.data();
    full.arena_bytes = plan->arena_bytes;
    full.num_broadcasts = plan->broadcasts.size();
    full.broadcasts = plan->broadcasts.data();
    full.num_reads = plan->reads.size();
    full.reads = plan->reads.data();
    full.rounds = plan->rounds;
    FillSized(full, view);
    return FERRY_OK;
  });
}

int ferry_dist_plan_conclude(ferry_dist_plan_t* plan, int32_t failed, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(plan);
    const std::string& where = plan->checkpoint->path();
    if (!plan->all_reduce_max) return NullArg(error, fn, "the plan's all_reduce_max");
    ferry::Status mine = failed != 0
                             ? ferry::Error(StatusCode::kInternal, where, ": rank ", plan->rank,
                                            ": this rank failed its part of the distributed load")
                             : ferry::Status::Ok();
    return Report(ferry::AgreeOnOutcome(mine, plan->all_reduce_max, where, plan->rank), error);
  });
}

void ferry_dist_plan_free(ferry_dist_plan_t* plan) { delete plan; }

}  // extern "C"
