// The distributed loader's split, for bindings that run their own collectives.

#include "ferry/distributed.hpp"

#include "capi/internal.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

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

}  // extern "C"
