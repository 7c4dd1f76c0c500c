// Writes and reads a checkpoint through the installed public headers only.
#include <ferry/version.h>

#include <cstdio>
#include <cstring>
#include <ferry/ferry.hpp>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <scratch file>\n", argv[0]);
    return 2;
  }
  if (std::strcmp(ferry::VersionString(), FERRY_VERSION_STRING) != 0) {
    std::fprintf(stderr, "header %s, library %s\n", FERRY_VERSION_STRING, ferry::VersionString());
    return 1;
  }
  const std::string path = argv[1];
  std::vector<float> weights(1000);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = static_cast<float>(i) * 0.5f;
  {
    auto writer = ferry::Writer::Create(path);
    if (!writer.ok()) {
      std::fprintf(stderr, "%s\n", writer.status().ToString().c_str());
      return 1;
    }
    ferry::Status st = writer->AddTensor("w", ferry::DType::kF32, {10, 100}, weights.data(),
                                         weights.size() * sizeof(float), ferry::Encoding::kZstd);
    if (st.ok()) st = writer->SetMetadata("producer", "consumer");
    if (st.ok()) st = writer->Commit();
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
  }
  auto reader = ferry::Reader::Open(path);
  if (!reader.ok()) {
    std::fprintf(stderr, "%s\n", reader.status().ToString().c_str());
    return 1;
  }
  std::vector<float> out(weights.size());
  ferry::Status st = (*reader)->ReadInto("w", out.data(), out.size() * sizeof(float), {true});
  if (!st.ok() || out != weights || (*reader)->metadata("producer") != "consumer") {
    std::fprintf(stderr, "round trip failed: %s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("consumer: TensorFerry %s round trip ok\n", ferry::VersionString());
  return 0;
}
