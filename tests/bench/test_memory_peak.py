"""bench/memory_peak's replay of an allocator trace: the live set at the peak, grouped by origin."""

from bench.memory_peak import format_breakdown, peak_breakdown


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


TRAINER = "/repo/services/trainer/loss.py"
TORCH = "/venv/lib/python3.12/site-packages/torch/nn/functional.py"


def test_the_live_set_at_the_highest_point_is_grouped_by_the_first_frame_in_the_code_under_study() -> None:
    logits = [frame(TORCH, 10, "linear"), frame(TRAINER, 92, "soft_cross_entropy")]
    hidden = [frame(TRAINER, 40, "forward")]
    script = [frame("/repo/bench/vs_specforge.py", 7, "step")]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": logits},
        {"action": "alloc", "addr": 2, "size": 50, "frames": hidden},
        {"action": "alloc", "addr": 3, "size": 30, "frames": logits},
        {"action": "free_requested", "addr": 1, "size": 100},  # not yet free: the stream may still use it
        {"action": "alloc", "addr": 4, "size": 5, "frames": script},  # 185: the peak
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 5, "size": 90, "frames": hidden},  # 175: lower, not the peak
        {"action": "segment_alloc", "addr": 99, "size": 10**9},  # the allocator's own reservations do not count
    ]
    breakdown = peak_breakdown(trace, origins=("services/trainer/",), top=2)
    assert breakdown["peak_bytes"] == 185
    assert breakdown["tensors_at_peak"] == 4
    assert breakdown["by_origin"] == [
        {"origin": "services/trainer/loss.py:92 soft_cross_entropy", "bytes": 130},
        {"origin": "services/trainer/loss.py:40 forward", "bytes": 50},
    ]
    assert breakdown["other_bytes"] == 5  # the script's, outside the top two
    assert "0.000 GiB  everything else" in format_breakdown("1x8 ours", 2**30, breakdown)


def test_an_allocation_with_no_frame_in_the_code_under_study_is_named_by_its_first_frame_outside_torch() -> None:
    trace = [{"action": "alloc", "addr": 1, "size": 8, "frames": [frame(TORCH, 1, "f"), frame("/x/app.py", 3, "g")]}]
    assert peak_breakdown(trace, origins=("specforge/",))["by_origin"][0]["origin"] == "/x/app.py:3 g"
    assert peak_breakdown([], origins=("specforge/",))["peak_bytes"] == 0
