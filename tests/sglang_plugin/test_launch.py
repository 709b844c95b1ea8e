"""The container's entry point: SGLang launch arguments from the environment."""

import json
from pathlib import Path

import pytest
from eagle3_sglang_plugin.config import PluginConfigError
from eagle3_sglang_plugin.launch import launch_argv, num_hidden_layers

from tests.unit.test_engine_eval import sglang_parse


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32}))
    return tmp_path


def values_after(argv: list[str], flag: str, count: int = 1) -> list[str]:
    index = argv.index(flag)
    return argv[index + 1 : index + 1 + count]


def test_defaults_capture_eagle3_layers_without_prefix_cache_or_chunking(model_dir: Path) -> None:
    argv = launch_argv({"EAGLE3_MODEL_PATH": str(model_dir)})

    assert argv[0] == "sglang.launch_server"
    assert values_after(argv, "--model-path") == [str(model_dir)]
    assert values_after(argv, "--host") == ["0.0.0.0"] and values_after(argv, "--port") == ["30000"]
    assert values_after(argv, "--chunked-prefill-size") == ["-1"]
    assert "--disable-radix-cache" in argv and "--skip-tokenizer-init" in argv
    assert "--enable-return-aux-hidden-states" in argv
    assert values_after(argv, "--speculative-algorithm") == ["EAGLE3"]
    # Llama-3.1-8B: [1, 15, 28], which SGLang captures as layers_to_capture [2, 16, 29].
    assert values_after(argv, "--return-aux-hidden-state-layer-ids", 3) == ["1", "15", "28"]
    assert "--disable-prefill-cuda-graph" in argv
    assert "--mem-fraction-static" not in argv
    assert "--enable-deterministic-inference" not in argv
    assert "--enable-prefill-delayer" in argv and values_after(argv, "--prefill-delayer-queue-min-ratio") == ["0.2"]


def test_sglang_reads_the_launch_arguments_as_meant(model_dir: Path) -> None:
    """Every flag the launcher adds exists in SGLang 0.5.23 and means what the docstring says (its own parser)."""
    parsed = sglang_parse(launch_argv({"EAGLE3_MODEL_PATH": str(model_dir)})[1:])  # after "sglang.launch_server"

    assert parsed.returncode == 0, parsed.stderr[-2000:]
    values = json.loads(parsed.stdout)
    assert values["chunked_prefill_size"] == -1 and values["disable_radix_cache"] and values["skip_tokenizer_init"]
    assert values["enable_return_aux_hidden_states"] and values["speculative_algorithm"] == "EAGLE3"
    assert values["disable_prefill_cuda_graph"]
    assert values["enable_prefill_delayer"] and values["prefill_delayer_queue_min_ratio"] == 0.2


def test_settings_and_extra_arguments_reach_sglang(model_dir: Path) -> None:
    environ = {
        "EAGLE3_MODEL_PATH": str(model_dir),
        "EAGLE3_INFERENCE_PORT": "31000",
        "EAGLE3_AUX_LAYER_IDS": "20, 2, 10",
        "EAGLE3_SGLANG_TP_SIZE": "2",
        "EAGLE3_SGLANG_MEM_FRACTION_STATIC": "0.8",
        "EAGLE3_SGLANG_SKIP_TOKENIZER_INIT": "0",
        "EAGLE3_SGLANG_PREFILL_CUDA_GRAPH": "1",
        "EAGLE3_SGLANG_DETERMINISTIC_INFERENCE": "1",
        "EAGLE3_SGLANG_PREFILL_DELAYER": "0",
    }

    argv = launch_argv(environ, ["--log-level", "debug"])

    assert values_after(argv, "--port") == ["31000"] and values_after(argv, "--tp-size") == ["2"]
    assert values_after(argv, "--return-aux-hidden-state-layer-ids", 3) == ["2", "10", "20"]
    assert values_after(argv, "--mem-fraction-static") == ["0.8"]
    assert "--skip-tokenizer-init" not in argv and "--disable-prefill-cuda-graph" not in argv
    assert "--enable-deterministic-inference" in argv  # seeded sampling repeats only in this mode
    assert "--enable-prefill-delayer" not in argv
    assert argv[-2:] == ["--log-level", "debug"]


def test_the_last_layer_is_refused_before_sglang_starts(model_dir: Path) -> None:
    with pytest.raises(PluginConfigError, match="cannot be captured"):
        launch_argv({"EAGLE3_MODEL_PATH": str(model_dir), "EAGLE3_AUX_LAYER_IDS": "1,15,31"})


def test_a_missing_model_volume_is_named(tmp_path: Path) -> None:
    with pytest.raises(PluginConfigError, match="is the model volume mounted"):
        launch_argv({"EAGLE3_MODEL_PATH": str(tmp_path / "absent")})


def test_a_multimodal_config_reads_the_text_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 48}, "vision_config": {}}))

    assert num_hidden_layers(tmp_path) == 48


def test_a_flag_that_is_not_a_boolean_is_refused(model_dir: Path) -> None:
    with pytest.raises(PluginConfigError, match="EAGLE3_SGLANG_SKIP_TOKENIZER_INIT"):
        launch_argv({"EAGLE3_MODEL_PATH": str(model_dir), "EAGLE3_SGLANG_SKIP_TOKENIZER_INIT": "maybe"})
