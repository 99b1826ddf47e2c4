#include "admission.h"

#include <vector>

#include "text.h"

namespace zen {
namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> parts(1);
  for (char c : s) {
    if (c == '/') parts.emplace_back();
    else parts.back() += c;
  }
  return parts;
}

// A count: decimal digits only, at most 19 of them (below 2^63), as admission._count.
std::optional<int64_t> count(const std::string& text) {
  if (text.empty() || text.size() > 19) return std::nullopt;
  int64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v;
}

}  // namespace

Judgement judge(const std::string& tag, uint64_t size, const LastStep& last_step, int64_t step_window,
                uint64_t max_agreement_bytes) {
  const std::string not_a_step =
      "tag " + py_repr(tag, 80) + " is not a step's tag (job/tensor/step/attempt/phase/round)";
  auto parts = split(tag);
  if (parts.size() != 6) return {Verdict::Refuse, not_a_step};
  auto tensor = count(parts[1]), step = count(parts[2]), attempt = count(parts[3]), round = count(parts[5]);
  const std::string& job = parts[0];
  const std::string& phase = parts[4];
  if (!tensor || !step || !attempt || !round || job.empty() || phase.empty()) return {Verdict::Refuse, not_a_step};
  auto last = last_step(job, *tensor);
  std::string t = std::to_string(*tensor), s = std::to_string(*step);
  if (!last) {
    if (phase == "agree" && size <= max_agreement_bytes) return {};
    return {Verdict::Discard, "tensor " + t + " of job key " + job + " is not registered on this node"};
  }
  if (*step <= *last) {
    return {Verdict::Discard,
            "step " + s + " of tensor " + t + " is already complete here (last " + std::to_string(*last) + ")"};
  }
  if (*last >= 0 && *step - *last > step_window) {  // a tensor's first step may be any (a job that resumes)
    return {Verdict::Discard, "step " + s + " of tensor " + t + " is more than " + std::to_string(step_window) +
                                  " past its last step " + std::to_string(*last)};
  }
  return {};
}

Judgement judge_abort(const std::string& prefix) {
  auto parts = split(prefix);
  if (parts.size() != 5 || !parts[4].empty() || parts[0].empty() || !count(parts[1]) || !count(parts[2]) ||
      !count(parts[3])) {
    return {Verdict::Refuse,
            "abort prefix " + py_repr(prefix, 80) + " is not one step's attempt (job/tensor/step/attempt/)"};
  }
  return {};
}

}  // namespace zen
