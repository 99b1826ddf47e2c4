// The native judge of zend/daemon/admission.py: which data and abort frames a node takes from a peer.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace zen {

enum class Verdict { Take, Discard, Refuse };

struct Judgement {
  Verdict verdict = Verdict::Take;
  std::string why;
};

// (job key, tensor) -> the last step completed here (-1: none yet), or nullopt if not registered.
using LastStep = std::function<std::optional<int64_t>(const std::string&, int64_t)>;

// A data message `tag` of `size` bytes (admission.judge).
Judgement judge(const std::string& tag, uint64_t size, const LastStep& last_step, int64_t step_window,
                uint64_t max_agreement_bytes);
// An abort's prefix: one attempt of one step, job/tensor/step/attempt/ (admission.judge_abort).
Judgement judge_abort(const std::string& prefix);

}  // namespace zen
