// The S3 settings users already have: credentials, region, endpoint and addressing style from
// the standard AWS_* environment variables and the shared ~/.aws/credentials and
// ~/.aws/config files, resolved in the order the AWS CLI and SDKs use. The S3 source is the
// only reader of these variables (the library reads no other environment).
//
// Precedence (first found wins):
//   credentials  AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN);
//                the profile's keys in the shared credentials file; then in the config file;
//                none: requests go unsigned (public buckets).
//   profile      AWS_PROFILE, else "default" (config sections "[default]", "[profile NAME]";
//                credentials sections "[NAME]").
//   files        AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials;
//                AWS_CONFIG_FILE, else ~/.aws/config.
//   region       AWS_REGION; AWS_DEFAULT_REGION; the profile's region; "us-east-1".
//   endpoint     AWS_ENDPOINT_URL_S3; AWS_ENDPOINT_URL; the profile's "s3 = endpoint_url";
//                the profile's endpoint_url; AWS's https://s3.REGION.amazonaws.com.
//   addressing   AWS_S3_ADDRESSING_STYLE (path, virtual or auto); the profile's
//                "s3 = addressing_style"; auto: path-style for endpoints that are IP addresses
//                or localhost and for bucket names with dots, virtual-hosted otherwise.
//   CA bundle    AWS_CA_BUNDLE; the profile's ca_bundle.
// Thread safety: pure functions of their arguments and the files they read.
#ifndef FERRY_SRC_IO_AWS_CONFIG_HPP_
#define FERRY_SRC_IO_AWS_CONFIG_HPP_

#include <functional>
#include <optional>
#include <string>

#include "ferry/status.hpp"
#include "io/sigv4.hpp"

namespace ferry {

struct AwsSettings {
  AwsCredentials credentials;  // empty: unsigned requests
  // Where the credentials came from, for messages ("environment", "shared credentials file",
  // "config file", "none"); never the keys themselves.
  std::string credentials_source = "none";
  std::string profile = "default";
  std::string region = "us-east-1";
  std::string endpoint;                   // empty: AWS's own
  std::string addressing_style = "auto";  // "auto", "path" or "virtual"
  std::string ca_bundle;                  // empty: the system's
};

// Looks a variable up: its value, or nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
// The process environment (getenv).
EnvLookup ProcessEnvironment();

// InvalidArgument for an AWS_S3_ADDRESSING_STYLE or addressing_style that is not path,
// virtual or auto; NotFound for an AWS_PROFILE named in neither file while the environment
// holds no keys. A file that does not exist is skipped; one that cannot be read is IoError.
Result<AwsSettings> ResolveAwsSettings(const EnvLookup& env);

}  // namespace ferry

#endif  // FERRY_SRC_IO_AWS_CONFIG_HPP_
