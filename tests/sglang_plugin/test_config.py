from pathlib import Path

import pytest
from eagle3_sglang_plugin.config import (
    DEFAULT_SHM_DIR,
    PluginConfig,
    PluginConfigError,
    check_capture_layer_ids,
    parse_layer_ids,
    resolve_capture_layer_ids,
    sglang_layers_to_capture,
)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("1,14,26", id="commas"),
        pytest.param(" 1 14  26 ", id="spaces"),
        pytest.param("[1, 14, 26]", id="json"),
    ],
)
def test_layer_ids_parse_from_the_usual_spellings(text: str) -> None:
    assert parse_layer_ids(text) == [1, 14, 26]


@pytest.mark.parametrize("text", ["1,x,3", "[1, 2.5, 3]", '{"a": 1}', "[1, true, 3]"])
def test_layer_ids_that_are_not_integers_are_refused_naming_the_setting(text: str) -> None:
    with pytest.raises(PluginConfigError, match="EAGLE3_AUX_LAYER_IDS"):
        parse_layer_ids(text)


def test_capture_layer_ids_come_back_in_sglang_capture_order() -> None:
    assert check_capture_layer_ids([26, 1, 14], num_hidden_layers=30) == [1, 14, 26]


@pytest.mark.parametrize(
    ("ids", "reason"),
    [
        pytest.param([1, 14], "exactly 3", id="two-ids"),
        pytest.param([1, 14, 14], "distinct", id="duplicate"),
        pytest.param([1, 14, 29], r"outside \[0, 28\]", id="last-layer"),  # nothing runs after layer N - 1
        pytest.param([-1, 14, 26], r"outside \[0, 28\]", id="negative"),
    ],
)
def test_layer_ids_sglang_cannot_capture_are_refused(ids: list[int], reason: str) -> None:
    with pytest.raises(PluginConfigError, match=reason):
        check_capture_layer_ids(ids, num_hidden_layers=30)


def test_default_layers_are_eagle3_defaults_and_sglang_captures_them_one_layer_later() -> None:
    # SmolLM2-135M has 30 layers: ids [1, 14, 26], i.e. Hugging Face output_hidden_states[2, 15, 27].
    ids = resolve_capture_layer_ids(None, num_hidden_layers=30)

    assert ids == [1, 14, 26]
    # SGLang's own default for set_eagle3_layers_to_capture(None) is [2, N // 2, N - 3]: the same layers.
    assert sglang_layers_to_capture(ids) == [2, 30 // 2, 30 - 3]


def test_configured_layers_override_the_default() -> None:
    assert resolve_capture_layer_ids([3, 2, 5], num_hidden_layers=8) == [2, 3, 5]


def test_plugin_config_reads_the_projects_shm_dir_setting() -> None:
    assert PluginConfig.from_env({}).shm_dir == DEFAULT_SHM_DIR
    assert PluginConfig.from_env({"EAGLE3_SHM_DIR": "/tmp/x"}).shm_dir == Path("/tmp/x")
