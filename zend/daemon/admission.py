"""Which data-plane messages a node takes from its peers, judged at the frame before the payload is read.

Every message of a step is tagged `job_key/tensor_id/step/attempt/phase/round` (node_steps.sync_prefix
and Channel). A peer, even one that holds the cluster secret, may send only what a step of a tensor
this node knows can need:
- a tag of any other shape is refused: the link is dropped, naming the peer (no honest node sends it);
- a message for a tensor this node has not registered is kept only if it is that tensor's first
  agreement (its trainers may not have registered it here yet) and small; else it is discarded;
- a message for a step this node has completed, or for one further ahead than any trainer may
  jump, is discarded (every message of a step is taken before the step completes here; a late one of
  an aborted attempt is dropped as void before this is asked).
Discarded messages are read and dropped, never kept in a mailbox: junk cannot fill the mailboxes and
stall the link; one too big to be read only to be dropped (link_transport.MAX_DISCARDED_BYTES, 64 MiB)
drops the link instead. An abort (which voids every message under its prefix, here and wherever it is replayed)
must name one attempt of one step, `job_key/tensor_id/step/attempt/`: a peer cannot void a whole
job or tensor. Pure code: the registry's answer comes in as a function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from zend.daemon.steps import STEP_WINDOW
from zend.transport.frames import ABORT

MAX_AGREEMENT_BYTES = 64 << 10  # a tensor's description (agreement.py): a few hundred bytes in practice
Verdict = tuple[Literal["discard", "refuse"], str] | None  # None: take it

# (job key, tensor id) -> the last step this node completed of that tensor (-1: none yet), or None
# when no trainer of this node registered it
LastStep = Callable[[str, int], int | None]


def _count(text: str) -> int | None:
    if not text.isdigit() or len(text) > 19:  # non-negative, below 2^63 (no sign, no spaces, no '1e9')
        return None
    return int(text)


def judge_frame(kind: int, tag: str, size: int, last_step: LastStep) -> Verdict:
    """What to do with a data or abort frame from a peer."""
    return judge_abort(tag) if kind == ABORT else judge(tag, size, last_step)


def judge_abort(prefix: str) -> Verdict:
    """An abort's prefix must be one attempt of one step (node_steps.sync_prefix)."""
    parts = prefix.split("/")
    if len(parts) != 5 or parts[4] or not parts[0] or any(_count(p) is None for p in parts[1:4]):
        return "refuse", f"abort prefix {prefix[:80]!r} is not one step's attempt (job/tensor/step/attempt/)"
    return None


def judge(tag: str, size: int, last_step: LastStep) -> Verdict:
    """What to do with a data message `tag` of `size` bytes from a peer (see the module's rules)."""
    parts = tag.split("/")
    if len(parts) != 6:
        return "refuse", f"tag {tag[:80]!r} is not a step's tag (job/tensor/step/attempt/phase/round)"
    job_key, tensor_text, step_text, attempt_text, phase, round_text = parts
    tensor, step, attempt, round_ = (_count(t) for t in (tensor_text, step_text, attempt_text, round_text))
    if tensor is None or step is None or attempt is None or round_ is None or not job_key or not phase:
        return "refuse", f"tag {tag[:80]!r} is not a step's tag (job/tensor/step/attempt/phase/round)"
    last = last_step(job_key, tensor)
    if last is None:
        if phase == "agree" and size <= MAX_AGREEMENT_BYTES:
            return None
        return "discard", f"tensor {tensor} of job key {job_key} is not registered on this node"
    if step <= last:
        return "discard", f"step {step} of tensor {tensor} is already complete here (last {last})"
    if last >= 0 and step > last + STEP_WINDOW:  # a tensor's first step may be any (a job that resumes)
        return "discard", f"step {step} of tensor {tensor} is more than {STEP_WINDOW} past its last step {last}"
    return None
