"""guarded_capture's host-sync guard: what it refuses, on which thread, and that it restores torch."""

import threading

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.lowering.cuda_graph.guarded_capture import host_sync_forbidden


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: torch.cuda.synchronize(), "torch.cuda.synchronize"),
        (lambda: torch.cuda.Stream.synchronize(None), "torch.cuda.Stream.synchronize"),
        (lambda: torch.cuda.Event.synchronize(None), "torch.cuda.Event.synchronize"),
    ],
)
def test_a_python_level_sync_on_the_capturing_thread_is_a_lowering_error(call, name):
    with host_sync_forbidden():
        with pytest.raises(LoweringError, match=rf"{name}\(\) was called during a CUDA graph capture"):
            call()


def test_other_threads_reach_the_real_functions():
    seen: list[BaseException] = []

    def other() -> None:
        try:
            torch.cuda.synchronize()
        except BaseException as exc:  # no CUDA here: torch's own error, not ours
            seen.append(exc)

    with host_sync_forbidden():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    if torch.cuda.is_available():
        assert seen == []
    else:
        assert len(seen) == 1 and not isinstance(seen[0], LoweringError)


def test_sync_debug_mode_is_error_inside_and_restored_after_even_on_failure():
    real = torch.cuda.synchronize
    before = torch._C._cuda_get_sync_debug_mode()
    with pytest.raises(RuntimeError, match="boom"):
        with host_sync_forbidden():
            assert torch._C._cuda_get_sync_debug_mode() == 2
            raise RuntimeError("boom")
    assert torch._C._cuda_get_sync_debug_mode() == before
    assert torch.cuda.synchronize is real
    assert "synchronize" in torch.cuda.Stream.__dict__ and torch.cuda.Stream.synchronize.__name__ == "synchronize"
    assert not hasattr(torch.cuda.Stream.synchronize, "__wrapped__")
