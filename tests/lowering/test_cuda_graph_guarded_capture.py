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


def test_threads_entering_and_leaving_in_any_order_restore_torch_once_all_left():
    real = torch.cuda.synchronize
    before = torch._C._cuda_get_sync_debug_mode()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def a() -> None:
        with host_sync_forbidden():
            a_in.set()
            b_in.wait()
        a_out.set()  # a leaves first, while b is still inside

    def b() -> None:
        a_in.wait()
        with host_sync_forbidden():
            b_in.set()
            a_out.wait()
            seen["patched while b inside"] = torch.cuda.synchronize is not real
            seen["mode while b inside"] = torch._C._cuda_get_sync_debug_mode()
            try:
                torch.cuda.synchronize()
            except LoweringError:
                seen["b refused"] = True

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"patched while b inside": True, "mode while b inside": 2, "b refused": True}
    assert torch.cuda.synchronize is real and torch._C._cuda_get_sync_debug_mode() == before


def test_nesting_on_one_thread_keeps_the_guard_until_the_outer_exit():
    real = torch.cuda.synchronize
    with host_sync_forbidden():
        with host_sync_forbidden():
            pass
        with pytest.raises(LoweringError):
            torch.cuda.synchronize()
    assert torch.cuda.synchronize is real
