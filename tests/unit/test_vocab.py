import io
from collections import Counter

import pytest
import torch

from shared.data.tokenization import TokenizedSample
from shared.data.vocab import (
    VocabMapping,
    VocabMappingError,
    build_vocab_mapping,
    count_loss_tokens,
    load_vocab_mapping,
    vocab_mapping_bytes,
)
from shared.errors import ConfigurationError


def sample(input_ids: list[int], loss_mask: list[int]) -> TokenizedSample:
    return TokenizedSample("s", 1, input_ids, loss_mask, len(input_ids), len(input_ids), False)


def assert_consistent(mapping: VocabMapping, chosen: list[int], target_vocab_size: int) -> None:
    """d2t and t2d both describe exactly `chosen`, with draft ids in increasing target-id order."""
    draft_ids = torch.arange(mapping.draft_vocab_size)
    assert mapping.d2t.dtype == torch.long and mapping.d2t.shape == (mapping.draft_vocab_size,)
    assert mapping.t2d.dtype == torch.bool and mapping.t2d.shape == (target_vocab_size,)
    assert (draft_ids + mapping.d2t[draft_ids]).tolist() == sorted(chosen)  # SGLang: target = draft + d2t[draft]
    assert mapping.target_ids.tolist() == sorted(chosen)
    assert mapping.t2d.nonzero().flatten().tolist() == sorted(chosen)


def test_count_loss_tokens_counts_only_masked_tokens() -> None:
    counts = count_loss_tokens([sample([1, 2, 3, 2], [0, 1, 1, 1]), sample([2, 9], [1, 0])])
    assert counts == Counter({2: 3, 3: 1})


def test_draft_vocab_is_the_most_frequent_tokens() -> None:
    counts = Counter({5: 10, 3: 7, 9: 6, 1: 1, 8: 2})
    mapping = build_vocab_mapping(counts, target_vocab_size=12, draft_vocab_size=3)
    assert mapping.draft_vocab_size == 3
    assert_consistent(mapping, [5, 3, 9], 12)
    assert mapping.d2t.tolist() == [3 - 0, 5 - 1, 9 - 2]


def test_ties_go_to_the_lower_token_id() -> None:
    counts = Counter({7: 4, 2: 4, 11: 4, 0: 1})
    mapping = build_vocab_mapping(counts, target_vocab_size=16, draft_vocab_size=2)
    assert_consistent(mapping, [2, 7], 16)


def test_unseen_slots_are_filled_with_the_lowest_unused_ids() -> None:
    counts = Counter({1: 5, 7: 3, 4: 0})  # a zero count is not "seen"
    mapping = build_vocab_mapping(counts, target_vocab_size=10, draft_vocab_size=5)
    assert_consistent(mapping, [0, 1, 2, 3, 7], 10)
    assert mapping.coverage == 1.0


def test_coverage_is_the_share_of_loss_tokens_in_the_draft_vocab() -> None:
    counts = Counter({0: 6, 1: 3, 2: 1})
    mapping = build_vocab_mapping(counts, target_vocab_size=4, draft_vocab_size=2)
    assert mapping.coverage == pytest.approx(0.9)


def test_no_counts_gives_the_lowest_ids_and_zero_coverage() -> None:
    mapping = build_vocab_mapping(Counter(), target_vocab_size=8, draft_vocab_size=3)
    assert_consistent(mapping, [0, 1, 2], 8)
    assert mapping.coverage == 0.0


def test_draft_vocab_is_capped_at_the_target_vocab() -> None:
    mapping = build_vocab_mapping(Counter({3: 1}), target_vocab_size=6, draft_vocab_size=100)
    assert mapping.draft_vocab_size == 6
    assert mapping.d2t.tolist() == [0] * 6
    assert mapping.t2d.all()


@pytest.mark.parametrize(
    ("counts", "target_vocab_size", "draft_vocab_size"),
    [
        pytest.param(Counter({12: 1}), 12, 4, id="id-past-vocab"),
        pytest.param(Counter({-1: 1}), 12, 4, id="negative-id"),
        pytest.param(Counter(), 12, 0, id="empty-draft"),
        pytest.param(Counter(), 0, 4, id="empty-target"),
    ],
)
def test_impossible_inputs_are_configuration_errors(
    counts: Counter[int], target_vocab_size: int, draft_vocab_size: int
) -> None:
    with pytest.raises(ConfigurationError):
        build_vocab_mapping(counts, target_vocab_size=target_vocab_size, draft_vocab_size=draft_vocab_size)


def test_bytes_round_trip() -> None:
    counts = Counter({token: (token * 7919) % 101 for token in range(500)})
    mapping = build_vocab_mapping(counts, target_vocab_size=512, draft_vocab_size=64)
    loaded = load_vocab_mapping(vocab_mapping_bytes(mapping))
    assert torch.equal(loaded.d2t, mapping.d2t) and torch.equal(loaded.t2d, mapping.t2d)
    assert loaded.draft_vocab_size == 64
    assert loaded.coverage is None  # the file holds only d2t and t2d
    assert set(torch.load(io.BytesIO(vocab_mapping_bytes(mapping)), weights_only=True)) == {"d2t", "t2d"}


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


GOOD_D2T = torch.tensor([1, 1, 3], dtype=torch.long)  # target ids 1, 2, 5
GOOD_T2D = torch.tensor([False, True, True, False, False, True, False])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(b"not a torch file", "not a torch.save file", id="garbage"),
        pytest.param(saved([GOOD_D2T, GOOD_T2D]), "expected a dict", id="not-a-dict"),
        pytest.param(saved({"t2d": GOOD_T2D}), "d2t: missing", id="missing-d2t"),
        pytest.param(saved({"d2t": GOOD_D2T.float(), "t2d": GOOD_T2D}), "d2t: expected torch.int64", id="d2t-float"),
        pytest.param(saved({"d2t": GOOD_D2T[None], "t2d": GOOD_T2D}), "d2t: expected", id="d2t-2d"),
        pytest.param(saved({"d2t": GOOD_D2T, "t2d": GOOD_T2D.long()}), "t2d: expected torch.bool", id="t2d-int"),
        pytest.param(saved({"d2t": GOOD_D2T[:2], "t2d": GOOD_T2D}), "t2d: 3 target tokens", id="count-mismatch"),
        pytest.param(saved({"d2t": torch.tensor([1, 2, 3]), "t2d": GOOD_T2D}), "d2t: offsets", id="offsets-disagree"),
    ],
)
def test_bad_vocab_mapping_files_name_the_field(data: bytes, message: str) -> None:
    with pytest.raises(VocabMappingError, match=message) as excinfo:
        load_vocab_mapping(data, source="job-1/vocab_mapping.pt")
    assert str(excinfo.value).startswith("job-1/vocab_mapping.pt: ")


def test_a_hand_written_mapping_loads() -> None:
    loaded = load_vocab_mapping(saved({"d2t": GOOD_D2T, "t2d": GOOD_T2D}))
    assert loaded.target_ids.tolist() == [1, 2, 5]
