from shared.capture.protocol import default_aux_layer_ids
from shared.data.tokenization import TokenizedSample
from shared.lifecycle.kinds.extract import bytes_per_token, plan_shards
from shared.storage.layout import sample


def tokenized(n: int) -> TokenizedSample:
    return TokenizedSample(
        sample_id=f"s{n}",
        line=1,
        input_ids=[1] * n,
        loss_mask=[1] * n,
        num_tokens=n,
        original_num_tokens=n,
        truncated=False,
    )


def test_shards_respect_token_budget_and_keep_order() -> None:
    samples = [tokenized(n) for n in (40, 30, 50, 10, 90, 5)]
    plan = plan_shards(samples, token_budget=80)
    assert plan == [[0, 1], [2, 3], [4], [5]]
    assert plan_shards(samples, token_budget=80) == plan  # deterministic


def test_a_sample_over_budget_gets_a_shard_of_its_own() -> None:
    assert plan_shards([tokenized(500), tokenized(1)], token_budget=100) == [[0], [1]]


def test_default_aux_layer_ids_follow_eagle3() -> None:
    assert default_aux_layer_ids(32) == [1, 15, 28]  # Llama-3.1-8B
    assert default_aux_layer_ids(30) == [1, 14, 26]  # SmolLM2-135M


def test_bytes_per_token_is_four_bf16_states_plus_ids() -> None:
    assert bytes_per_token(4096) == 4 * 4096 * 2 + 16


def test_sample_keys_use_specforge_row_groups() -> None:
    assert sample("job", 0) == "job/rows_0-2000/data_0.pt"
    assert sample("job", 2001) == "job/rows_2000-4000/data_2001.pt"
