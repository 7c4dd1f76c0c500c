// AWS settings from the environment and the shared credentials and config files.
#include "io/aws_config.hpp"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <utility>
#include <vector>

#include "base/util.hpp"

namespace ferry {
namespace {

// "section\nkey" = value, for every setting of a file. Files are small: a linear search
// keeps std::map instantiations (which libstdc++ gives default visibility) out of the library.
using IniFile = std::vector<std::pair<std::string, std::string>>;

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

// The AWS INI dialect: "[section]", "key = value", '#' and ';' comment lines, and nested
// settings ("s3 =" followed by indented "key = value" lines) stored as "s3.key".
IniFile ParseIni(std::istream& in) {
  IniFile out;
  std::string section;
  bool in_section = false;
  std::string parent;  // the key of an open nested block
  std::string line;
  while (std::getline(in, line)) {
    std::string t = Trim(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    if (t[0] == '[') {
      size_t close = t.find(']');
      section = Trim(t.substr(1, close == std::string::npos ? std::string::npos : close - 1));
      in_section = true;
      parent.clear();
      continue;
    }
    if (!in_section) continue;
    size_t eq = t.find('=');
    if (eq == std::string::npos) continue;
    std::string key = Trim(t.substr(0, eq));
    std::string value = Trim(t.substr(eq + 1));
    bool indented = line[0] == ' ' || line[0] == '\t';
    if (indented && !parent.empty()) {
      out.emplace_back(section + "\n" + parent + "." + key, value);
      continue;
    }
    parent = value.empty() ? key : "";
    out.emplace_back(section + "\n" + key, value);
  }
  return out;
}

Result<std::optional<IniFile>> ReadIni(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    if (errno == ENOENT || errno == ENOTDIR) return std::optional<IniFile>();
    return Error(StatusCode::kIoError, path, ": cannot read the AWS settings file ",
                 ErrnoText(errno));
  }
  return std::optional<IniFile>(ParseIni(in));
}

// One section of a file: null when the file or the section is absent.
struct Section {
  const IniFile* file = nullptr;
  std::string name;
  explicit operator bool() const { return file != nullptr; }
};

std::string Get(const Section& s, const std::string& key) {
  if (!s) return "";
  std::string full = s.name + "\n" + key;
  std::string value;
  for (const auto& [k, v] : *s.file) {
    if (k == full) value = v;  // the last one wins, as in the AWS CLI
  }
  return value;
}

Section Find(const std::optional<IniFile>& file, const std::string& name) {
  if (!file) return {};
  std::string prefix = name + "\n";
  for (const auto& [k, v] : *file) {
    if (k.compare(0, prefix.size(), prefix) == 0) return Section{&*file, name};
  }
  return {};
}

}  // namespace

EnvLookup ProcessEnvironment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

Result<AwsSettings> ResolveAwsSettings(const EnvLookup& env) {
  auto var = [&](const char* name) {
    std::optional<std::string> v = env(name);
    return v ? *v : std::string();
  };
  auto home_path = [&](const std::string& explicit_path, const char* rel) {
    std::string p = explicit_path;
    if (p.empty()) p = "~/.aws/" + std::string(rel);
    if (p.rfind("~/", 0) == 0) p = var("HOME") + p.substr(1);
    return p;
  };
  AwsSettings out;
  if (std::string p = var("AWS_PROFILE"); !p.empty()) out.profile = p;
  std::string cred_path = home_path(var("AWS_SHARED_CREDENTIALS_FILE"), "credentials");
  std::string config_path = home_path(var("AWS_CONFIG_FILE"), "config");
  FERRY_ASSIGN_OR_RETURN(std::optional<IniFile> creds_file, ReadIni(cred_path));
  FERRY_ASSIGN_OR_RETURN(std::optional<IniFile> config_file, ReadIni(config_path));
  Section cred = Find(creds_file, out.profile);
  Section conf = Find(config_file, "profile " + out.profile);
  if (!conf && out.profile == "default") conf = Find(config_file, "default");

  AwsCredentials env_keys{var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY"),
                          var("AWS_SESSION_TOKEN")};
  if (!env_keys.empty()) {
    out.credentials = env_keys;
    out.credentials_source = "environment";
  } else if (AwsCredentials c{Get(cred, "aws_access_key_id"), Get(cred, "aws_secret_access_key"),
                              Get(cred, "aws_session_token")};
             !c.empty()) {
    out.credentials = c;
    out.credentials_source = "shared credentials file";
  } else if (AwsCredentials c{Get(conf, "aws_access_key_id"), Get(conf, "aws_secret_access_key"),
                              Get(conf, "aws_session_token")};
             !c.empty()) {
    out.credentials = c;
    out.credentials_source = "config file";
  } else if (out.profile != "default" && !cred && !conf) {
    return Error(StatusCode::kNotFound, "AWS profile '", out.profile,
                 "' (AWS_PROFILE) is in neither ", cred_path, " nor ", config_path);
  }

  for (const std::string& r : {var("AWS_REGION"), var("AWS_DEFAULT_REGION"), Get(conf, "region")}) {
    if (!r.empty()) {
      out.region = r;
      break;
    }
  }
  for (const std::string& e : {var("AWS_ENDPOINT_URL_S3"), var("AWS_ENDPOINT_URL"),
                               Get(conf, "s3.endpoint_url"), Get(conf, "endpoint_url")}) {
    if (!e.empty()) {
      out.endpoint = e;
      break;
    }
  }
  std::string style = var("AWS_S3_ADDRESSING_STYLE");
  const char* style_from = "AWS_S3_ADDRESSING_STYLE";
  if (style.empty()) {
    style = Get(conf, "s3.addressing_style");
    style_from = "the config file's s3 addressing_style";
  }
  if (!style.empty()) {
    if (style != "path" && style != "virtual" && style != "auto") {
      return Error(StatusCode::kInvalidArgument, style_from, " is '", style,
                   "'; expected path, virtual or auto");
    }
    out.addressing_style = style;
  }
  out.ca_bundle = var("AWS_CA_BUNDLE");
  if (out.ca_bundle.empty()) out.ca_bundle = Get(conf, "ca_bundle");
  return out;
}

}  // namespace ferry
