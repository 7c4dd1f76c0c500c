// The base layer's thread helpers: every part of a job runs once, and a thread the system
// refuses is ResourceExhausted or fewer threads, never an exception.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <vector>

#include "base/worker_pool.hpp"

namespace ferry {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

TEST(WorkerPoolTest, DefaultThreadsStaysWithinItsCap) {
  EXPECT_GE(DefaultThreads(3), 1);
  EXPECT_LE(DefaultThreads(3), 3);
  EXPECT_EQ(DefaultThreads(1), 1);
  EXPECT_EQ(DefaultThreads(0), 1);
  EXPECT_LE(DefaultThreads(), 16);
}

TEST(WorkerPoolTest, RunPartsRunsEveryPartOnce) {
  std::vector<std::atomic<int>> ran(37);
  EXPECT_EQ(RunParts(37, [&](int k) { ran[k]++; }), 37);
  for (auto& r : ran) EXPECT_EQ(r.load(), 1);
  EXPECT_EQ(RunParts(0, [&](int) { FAIL(); }), 0);
}

TEST(WorkerPoolTest, ThreadGroupStartsAndJoins) {
  std::atomic<int> sum{0};
  ThreadGroup group;
  ASSERT_TRUE(group
                  .Start(
                      4, [&](int i) { sum += i; }, "test")
                  .ok());
  ASSERT_TRUE(group
                  .Start(
                      2, [&](int i) { sum += i; }, "test")
                  .ok());
  EXPECT_EQ(group.size(), 6);
  group.Join();
  EXPECT_EQ(sum.load(), 0 + 1 + 2 + 3 + 4 + 5);
  EXPECT_EQ(group.size(), 0);
}

// In a child whose address space has no room left for another thread stack: each helper
// reports the refusal its own way. Exit code 0 when all did.
int RefusedThreadsChild() {
  long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  if (pages == 0) return 20;
  const rlim_t limit = static_cast<rlim_t>(pages) * ::sysconf(_SC_PAGESIZE) + (rlim_t{1} << 20);
  struct rlimit rl = {limit, limit};
  if (::setrlimit(RLIMIT_AS, &rl) != 0) return 21;
  // Threads that hold their stacks until the end: whatever stacks the parent left cached, and
  // what room is left, is taken.
  std::atomic<bool> release{false};
  ThreadGroup hog;
  if (hog.Start(
             100000,
             [&](int) {
               while (!release) ::usleep(1000);
             },
             "hog")
          .ok())
    return 22;
  struct Release {
    std::atomic<bool>& flag;
    ThreadGroup& group;
    ~Release() {
      flag = true;
      group.Join();
    }
  } release_at_exit{release, hog};
  ThreadGroup group;
  Status st = group.Start(
      8, [](int) {}, "starting test threads");
  group.Join();
  if (st.code() != StatusCode::kResourceExhausted) return 1;
  if (st.message().rfind("starting test threads 1 of 8: ", 0) != 0) return 2;
  std::vector<int> ran(5, 0);
  if (RunParts(5, [&](int k) { ran[k]++; }) != 1) return 3;
  for (int r : ran) {
    if (r != 1) return 4;
  }
  if (StartDetached([] {}, "detached").code() != StatusCode::kResourceExhausted) return 5;
  if (WorkerPool::Create(4).status().code() != StatusCode::kResourceExhausted) return 6;
  return 0;
}

TEST(WorkerPoolTest, RefusedThreadsAreResourceExhaustedOrFewerThreads) {
  if (kSanitized) GTEST_SKIP() << "sanitizer runtimes need address space an RLIMIT_AS child lacks";
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(RefusedThreadsChild());
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace ferry
