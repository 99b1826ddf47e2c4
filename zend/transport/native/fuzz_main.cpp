// The fuzz target without libFuzzer (g++ only): replays every corpus file, then mutates them at random
// (a fixed seed: a failure replays) until the time is up. Usage: fuzz_frames_replay SECONDS FILE|DIR...
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

void load(const std::string& path, std::vector<std::vector<uint8_t>>& out) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    DIR* dir = opendir(path.c_str());
    if (dir == nullptr) return;
    std::vector<std::string> names;
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] != '.') names.push_back(path + "/" + e->d_name);
    }
    closedir(dir);
    std::sort(names.begin(), names.end());
    for (const auto& name : names) load(name, out);
    return;
  }
  std::ifstream in(path, std::ios::binary);
  out.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s SECONDS FILE|DIR...\n", argv[0]);
    return 2;
  }
  double seconds = std::atof(argv[1]);
  std::vector<std::vector<uint8_t>> corpus;
  for (int i = 2; i < argc; ++i) load(argv[i], corpus);
  for (const auto& input : corpus) LLVMFuzzerTestOneInput(input.data(), input.size());
  std::printf("replayed %zu corpus inputs\n", corpus.size());
  if (corpus.empty()) corpus.push_back({0});
  std::mt19937_64 rng(26);
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  uint64_t runs = 0;
  while (std::chrono::steady_clock::now() < end) {
    for (int batch = 0; batch < 256; ++batch, ++runs) {
      std::vector<uint8_t> input = corpus[rng() % corpus.size()];
      int edits = 1 + static_cast<int>(rng() % 8);
      for (int k = 0; k < edits; ++k) {
        size_t at = input.empty() ? 0 : rng() % input.size();
        switch (rng() % 5) {
          case 0: if (!input.empty()) input[at] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
          case 1: if (!input.empty()) input[at] = static_cast<uint8_t>(rng()); break;
          case 2: input.insert(input.begin() + static_cast<long>(at), static_cast<uint8_t>(rng())); break;
          case 3: if (!input.empty()) input.erase(input.begin() + static_cast<long>(at)); break;
          default: if (input.size() > 1) input.resize(rng() % input.size()); break;
        }
      }
      LLVMFuzzerTestOneInput(input.data(), input.size());
    }
  }
  std::printf("ran %llu mutated inputs in %g s\n", static_cast<unsigned long long>(runs), seconds);
  return 0;
}
