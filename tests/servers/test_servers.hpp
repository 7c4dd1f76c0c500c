// The remote-storage test servers (tests/servers/servers.py) for GoogleTest programs: nginx
// over HTTP and HTTPS, moto's S3 server with signature checking, and the fault-injecting
// server, all on 127.0.0.1. A program that includes this header gets a global environment
// that finds them: from the ctest fixture (FERRY_TEST_SERVERS names their servers.json) or,
// when the binary runs alone, by starting the helper itself (stopped at the end).
#ifndef FERRY_TESTS_SERVERS_TEST_SERVERS_HPP_
#define FERRY_TESTS_SERVERS_TEST_SERVERS_HPP_

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/util.hpp"
#include "gtest/gtest.h"
#include "io/aws_config.hpp"

extern char** environ;

namespace ferry {
namespace {

struct ServerState {
  nlohmann::json info;  // servers.json
  std::string problem;  // why there are none (a failure unless python3 itself is missing)
  bool no_python = false;
  pid_t helper = -1;  // started here
  int helper_stdin = -1;
  std::string dir;
};

ServerState& Servers() {
  static ServerState s;
  return s;
}

class ServersEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    ServerState& s = Servers();
    if (const char* path = std::getenv("FERRY_TEST_SERVERS")) {
      std::ifstream in(path);
      if (!in) {
        s.problem = std::string("FERRY_TEST_SERVERS names ") + path + ", which cannot be read";
        return;
      }
      s.info = nlohmann::json::parse(in, nullptr, false);
      if (s.info.is_discarded()) s.problem = std::string(path) + " is not JSON";
      return;
    }
    if (std::system("python3 -c '' >/dev/null 2>&1") != 0) {
      s.no_python = true;
      s.problem = "python3 is not installed (tests/servers/servers.py needs it)";
      return;
    }
    char tmpl[] = "/tmp/ferry_remote_test_XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      s.problem = "mkdtemp failed";
      return;
    }
    s.dir = tmpl;
    int in_pipe[2], out_pipe[2];
    if (pipe(in_pipe) != 0 || pipe(out_pipe) != 0) {
      s.problem = "pipe failed";
      return;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in_pipe[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out_pipe[1], 1);
    posix_spawn_file_actions_addclose(&fa, in_pipe[1]);
    posix_spawn_file_actions_addclose(&fa, out_pipe[0]);
    std::string script = FERRY_SERVERS_SCRIPT;
    const char* argv[] = {"python3",     script.c_str(),  "serve", "--dir",
                          s.dir.c_str(), "--watch-stdin", nullptr};
    int rc = posix_spawnp(&s.helper, "python3", &fa, nullptr, const_cast<char**>(argv), environ);
    posix_spawn_file_actions_destroy(&fa);
    close(in_pipe[0]);
    close(out_pipe[1]);
    s.helper_stdin = in_pipe[1];
    if (rc != 0) {
      s.problem = "cannot start " + script;
      close(out_pipe[0]);
      return;
    }
    std::string line;
    char c;
    while (read(out_pipe[0], &c, 1) == 1 && c != '\n') line += c;
    close(out_pipe[0]);
    s.info = nlohmann::json::parse(line, nullptr, false);
    if (s.info.is_discarded() || !s.info.is_object()) {
      s.problem = script + " serve printed no server list (see its output above)";
    }
  }

  void TearDown() override {
    ServerState& s = Servers();
    if (s.helper_stdin >= 0) close(s.helper_stdin);  // the helper stops its servers
    if (s.helper > 0) waitpid(s.helper, nullptr, 0);
    if (!s.dir.empty()) std::filesystem::remove_all(s.dir);
  }
};

const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new ServersEnvironment);

// Skips the test when the named server's program is missing; fails it when the helper could
// not run for any other reason.
#define REQUIRE_SERVER(what)                                                       \
  do {                                                                             \
    ServerState& s_ = Servers();                                                   \
    if (s_.no_python) GTEST_SKIP() << s_.problem;                                  \
    ASSERT_TRUE(s_.problem.empty()) << s_.problem;                                 \
    if (s_.info["missing"].contains(what)) {                                       \
      GTEST_SKIP() << what << ": " << s_.info["missing"][what].get<std::string>(); \
    }                                                                              \
  } while (0)

std::string Info(const char* key) { return Servers().info[key].get<std::string>(); }

std::vector<uint8_t> DiskBytes(const std::string& name) {
  std::ifstream in(Info("root") + "/" + name, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

std::string TestName() {
  const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(t->test_suite_name()) + "." + t->name();
}

AwsSettings MotoSettings() {
  const nlohmann::json& s3 = Servers().info["s3"];
  AwsSettings aws;
  aws.credentials = {s3["access_key_id"].get<std::string>(),
                     s3["secret_access_key"].get<std::string>(), ""};
  aws.credentials_source = "environment";
  aws.region = s3["region"].get<std::string>();
  aws.endpoint = s3["endpoint"].get<std::string>();
  return aws;
}

std::string S3Url(const std::string& key) {
  return "s3://" + Servers().info["s3"]["bucket"].get<std::string>() + "/" + key;
}

// Sets variables for the length of a scope, restoring what was there.
class ScopedEnv {
 public:
  void Set(const char* name, const std::string& value) {
    const char* old = std::getenv(name);
    saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) {
        setenv(it->first.c_str(), it->second->c_str(), 1);
      } else {
        unsetenv(it->first.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// The process environment of a user of the test S3 server: its keys and endpoint, and a HOME
// without shared AWS files.
void UseMotoEnvironment(ScopedEnv* env) {
  const AwsSettings aws = MotoSettings();
  env->Set("HOME", "/nonexistent");
  env->Set("AWS_ACCESS_KEY_ID", aws.credentials.access_key_id);
  env->Set("AWS_SECRET_ACCESS_KEY", aws.credentials.secret_access_key);
  env->Set("AWS_REGION", aws.region);
  env->Set("AWS_ENDPOINT_URL_S3", aws.endpoint);
}

}  // namespace
}  // namespace ferry

#endif  // FERRY_TESTS_SERVERS_TEST_SERVERS_HPP_
