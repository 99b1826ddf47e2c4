"""The "zen" group's typed errors are where the training loop looks the moment the work fails."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zen
import zen.distributed as zd

pytestmark = pytest.mark.inprocess


class Group:
    """What a call tells its group: the error it failed with (ZenProcessGroup.reraise raises that one)."""

    error: BaseException | None = None

    def _call_done(self, call: Any, error: BaseException | None) -> None:
        if error is not None:
            self.error = error


def test_the_group_holds_the_typed_error_before_the_work_fails() -> None:
    """DDP's backward() raises a RuntimeError as soon as the work's future fails, and the loop's reraise()
    asks the group for the zen error behind it. The future failed first and the group heard second, so
    now and then the loop found no zen error, took the abort for a crash, and the job died (example (a)
    surviving a daemon restart, in CI)."""
    group: Any = Group()

    def compute() -> Any:
        raise zen.StepAborted("step 4 of tensor 't' aborted on node 0: peer node lost [ABORTED]")

    call = zd._Call(group, "t", compute, lambda out: [torch.zeros(1)], None, checked=True)
    seen: list[BaseException | None] = []
    call.result.add_done_callback(lambda _: seen.append(group.error))  # runs as the future fails
    call.run()
    assert len(seen) == 1 and isinstance(seen[0], zen.StepAborted), seen
