"""Scheduler side: capture tickets, splitting SGLang's flattened extend batch, refusing short captures, writing."""

import asyncio
import json
from pathlib import Path

import pytest
import torch
from eagle3_sglang_plugin.capture import (
    CaptureTicket,
    CaptureWriter,
    PartialPrefill,
    capture_request,
    check_full_prefill,
    is_writer_rank,
    reorder_aux_slots,
    row_spans,
    slot_order,
)
from eagle3_sglang_plugin.http import wait_until_written
from eagle3_sglang_plugin.protocol import CaptureFailed

from shared.capture.protocol import read_capture_file

H = 8  # hidden size of the made-up batches


def flattened_batch(
    lengths: list[int], seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-request aux [L, 3H] and final [L, H], and the same rows concatenated as SGLang hands them over."""
    generator = torch.Generator().manual_seed(seed)
    aux = [torch.randn(length, 3 * H, generator=generator).to(torch.bfloat16) for length in lengths]
    final = [torch.randn(length, H, generator=generator).to(torch.bfloat16) for length in lengths]
    return aux, final, torch.cat(aux), torch.cat(final)  # (T, 3H), (T, H)


# ----------------------------------------------------------------------------------------------------------
# Tickets in sampling_params.custom_params


def test_ticket_survives_the_json_trip_through_custom_params() -> None:
    ticket = CaptureTicket("job-1_sample-7.safetensors", (2, 0, 1))

    custom_params = json.loads(json.dumps(ticket.to_custom_params()))  # SGLang ships custom_params as msgpack/JSON

    assert CaptureTicket.from_custom_params(custom_params) == ticket


@pytest.mark.parametrize("custom_params", [None, {}, {"thinking_budget": 5}, "not a dict"])
def test_requests_without_a_ticket_are_not_captures(custom_params: object) -> None:
    assert CaptureTicket.from_custom_params(custom_params) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("file_name", ["../escape.safetensors", "", "a/b.safetensors", 7])
def test_a_ticket_with_a_bad_file_name_is_refused(file_name: object) -> None:
    with pytest.raises(ValueError, match="eagle3_capture_file"):
        CaptureTicket.from_custom_params({"eagle3_capture_file": file_name, "eagle3_capture_slots": [0, 1, 2]})


# ----------------------------------------------------------------------------------------------------------
# Slot order: SGLang captures in ascending layer order, the protocol wants the requested order


def test_slot_order_maps_requested_ids_onto_ascending_captures() -> None:
    assert slot_order([1, 14, 26], [1, 14, 26]) == (0, 1, 2)
    assert slot_order([1, 14, 26], [26, 1, 14]) == (2, 0, 1)


@pytest.mark.parametrize("requested", [[1, 14, 25], [1, 14], [1, 1, 14]])
def test_slot_order_refuses_layers_the_server_does_not_capture(requested: list[int]) -> None:
    with pytest.raises(ValueError, match=r"captures layers \[1, 14, 26\]"):
        slot_order([1, 14, 26], requested)


def test_reorder_puts_each_slice_in_its_slot() -> None:
    rows = torch.arange(2 * 3 * H, dtype=torch.float32).view(2, 3 * H)  # slices 0, 1, 2 of width H

    reordered = reorder_aux_slots(rows, (2, 0, 1))

    assert torch.equal(reordered[:, :H], rows[:, 2 * H :])
    assert torch.equal(reordered[:, H : 2 * H], rows[:, :H])
    assert torch.equal(reordered[:, 2 * H :], rows[:, H : 2 * H])
    assert reorder_aux_slots(rows, (0, 1, 2)) is rows  # no copy for the usual order


# ----------------------------------------------------------------------------------------------------------
# The flattened extend batch


def test_row_spans_walk_the_batch_like_sglang() -> None:
    assert row_spans([3, 1, 5]) == [(0, 3), (3, 4), (4, 9)]
    assert row_spans([]) == []


def test_a_full_prefill_passes() -> None:
    check_full_prefill("r", rows=12, prompt_len=12)


def test_a_prefix_cache_hit_is_refused_with_the_cure() -> None:
    with pytest.raises(PartialPrefill, match=r"computed 5 of 12 prompt positions.*extra_key"):
        check_full_prefill("job-1/sample-3", rows=5, prompt_len=12)


def test_every_request_of_a_batch_gets_exactly_its_own_rows(tmp_path: Path) -> None:
    lengths = [3, 1, 7]
    aux, final, batch_aux, batch_final = flattened_batch(lengths)

    for i, (start, end) in enumerate(row_spans(lengths)):
        meta = capture_request(
            writer=CaptureWriter(tmp_path, threads=0),
            ticket=CaptureTicket(f"r{i}.safetensors", (0, 1, 2)),
            rid=f"r{i}",
            aux_hidden_states=batch_aux,
            last_hidden_states=batch_final,
            start=start,
            end=end,
            prompt_len=lengths[i],
        )
        assert meta == {"file": f"r{i}.safetensors", "rows": lengths[i], "hidden_size": H}

    for i in range(len(lengths)):
        got_aux, got_final = read_capture_file(tmp_path / f"r{i}.safetensors")
        assert torch.equal(got_aux, aux[i]) and torch.equal(got_final, final[i])


def test_capture_writes_the_requested_slot_order_in_bf16(tmp_path: Path) -> None:
    aux, _, batch_aux, batch_final = flattened_batch([4])

    capture_request(
        writer=CaptureWriter(tmp_path, threads=0),
        ticket=CaptureTicket("r.safetensors", (2, 0, 1)),
        rid="r",
        aux_hidden_states=batch_aux.float(),  # a float32 model: the file is bf16 all the same
        last_hidden_states=batch_final.float(),
        start=0,
        end=4,
        prompt_len=4,
    )

    got_aux, got_final = read_capture_file(tmp_path / "r.safetensors")
    assert got_aux.dtype == got_final.dtype == torch.bfloat16
    assert torch.equal(got_aux, reorder_aux_slots(aux[0], (2, 0, 1)))


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        pytest.param({"end": 2}, "computed 2 of 4", id="prefix-cache-hit"),
        pytest.param({"last_hidden_states": None}, "no post-norm hidden states", id="no-final-state"),
        pytest.param({"aux_hidden_states": None}, "no aux hidden states", id="no-aux-states"),
        pytest.param({"aux_hidden_states": torch.zeros(4, 2 * H)}, "not 3 x hidden size", id="two-aux-layers"),
    ],
)
def test_a_capture_that_cannot_be_complete_reports_an_error_and_writes_nothing(
    tmp_path: Path, overrides: dict, reason: str
) -> None:
    _, _, batch_aux, batch_final = flattened_batch([4])
    arguments = {
        "writer": CaptureWriter(tmp_path, threads=0),
        "ticket": CaptureTicket("r.safetensors", (0, 1, 2)),
        "rid": "r",
        "aux_hidden_states": batch_aux,
        "last_hidden_states": batch_final,
        "start": 0,
        "end": 4,
        "prompt_len": 4,
    }

    meta = capture_request(**{**arguments, **overrides})

    assert reason in meta["error"]
    assert list(tmp_path.iterdir()) == []


def test_writer_threads_write_a_batch_the_http_side_then_finds(tmp_path: Path) -> None:
    lengths = [5, 2, 9, 4]
    aux, final, batch_aux, batch_final = flattened_batch(lengths, seed=1)
    writer = CaptureWriter(tmp_path, threads=3)
    names = [f"r{i}.safetensors" for i in range(len(lengths))]

    for i, (start, end) in enumerate(row_spans(lengths)):
        meta = capture_request(
            writer=writer,
            ticket=CaptureTicket(names[i], (0, 1, 2)),
            rid=f"r{i}",
            aux_hidden_states=batch_aux,
            last_hidden_states=batch_final,
            start=start,
            end=end,
            prompt_len=lengths[i],
        )
        assert meta == {"file": names[i], "rows": lengths[i], "hidden_size": H}  # answered before the write
    asyncio.run(wait_until_written(tmp_path, names, timeout_s=30))

    for i, name in enumerate(names):
        got_aux, got_final = read_capture_file(tmp_path / name)
        assert torch.equal(got_aux, aux[i]) and torch.equal(got_final, final[i])


def test_a_write_that_fails_on_a_writer_thread_is_a_capture_failure_with_the_reason(tmp_path: Path) -> None:
    _, _, batch_aux, batch_final = flattened_batch([3])
    broken = CaptureTicket("r.safetensors", (0, 1, 5))  # slot 5 does not exist: the reordering fails on the thread

    meta = capture_request(
        writer=CaptureWriter(tmp_path, threads=1),
        ticket=broken,
        rid="r",
        aux_hidden_states=batch_aux,
        last_hidden_states=batch_final,
        start=0,
        end=3,
        prompt_len=3,
    )

    assert meta["file"] == "r.safetensors"
    with pytest.raises(CaptureFailed, match="rid r: writing the capture failed"):
        asyncio.run(wait_until_written(tmp_path, ["r.safetensors"], timeout_s=30))
    assert list(tmp_path.iterdir()) == []  # no capture file, and the error file was consumed


def test_waiting_for_a_file_nobody_writes_ends_with_a_capture_failure(tmp_path: Path) -> None:
    with pytest.raises(CaptureFailed, match="not written within"):
        asyncio.run(wait_until_written(tmp_path, ["never.safetensors"], timeout_s=0.05))


# ----------------------------------------------------------------------------------------------------------
# Which rank writes


@pytest.mark.parametrize(
    ("ranks", "writes"),
    [
        pytest.param({"pp_rank": 0, "attn_tp_rank": 0, "attn_cp_rank": 0}, True, id="tp-rank-0"),
        pytest.param({"pp_rank": 0, "attn_tp_rank": 1, "attn_cp_rank": 0}, False, id="tp-rank-1"),
        pytest.param({"pp_rank": 0, "attn_tp_rank": 0, "attn_cp_rank": 1}, False, id="cp-rank-1"),
        pytest.param({"pp_rank": 1, "attn_tp_rank": 0, "attn_cp_rank": 0}, False, id="pp-rank-1"),
    ],
)
def test_only_the_rank_that_answers_the_tokenizer_writes(ranks: dict[str, int], writes: bool) -> None:
    assert is_writer_rank(**ranks) is writes
