"""shared/capture/compare.py: a stored sample against a recomputation of its input ids, on synthetic states (the
reason texts, the swap and nearest-layer rules) and on real SmolLM2 states recomputed by the reference engine."""

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from services.inference.reference.engine import ReferenceEngine
from shared.capture.compare import SampleComparison, compare_sample, nearest, relative_error
from shared.capture.protocol import CapturedStates, CaptureSpec, SamplingParams
from shared.capture.tolerances import DEFAULT_TOLERANCES, FieldTolerances, Tolerances
from shared.storage.dtypes import StorageDtype
from shared.storage.sample_format import decode_sample, encode_sample

L, H = 6, 64
LAYER_IDS = [3, 4, 5]


def bf16_exact(*shape: int, seed: int) -> torch.Tensor:
    """Random float32 values that bf16 holds exactly, so a bf16 copy of them compares with error 0."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


def stored_record(
    input_ids: list[int], aux: torch.Tensor, hidden: torch.Tensor, storage_dtype: StorageDtype = "bfloat16"
) -> dict[str, torch.Tensor]:
    """The sample as a worker commits it and an audit reads it back: through the file format."""
    data = encode_sample(
        input_ids, [1] * len(input_ids), aux.bfloat16(), hidden.bfloat16(), storage_dtype=storage_dtype
    )
    return decode_sample(data)


# ----------------------------------------------------------------------------------------------------------
# Relative error and the nearest slice


def test_relative_error_weighs_every_token_alike() -> None:
    expected = bf16_exact(L, H, seed=0)
    expected[0] *= 1000  # an attention sink: one token far larger than the rest
    others = bf16_exact(L, H, seed=1)
    other_prompt = torch.cat([expected[:1], others[1:]])  # the same first token, every later one different

    assert relative_error(expected, expected) == 0
    assert relative_error(torch.zeros_like(expected), expected) == 1.0
    assert relative_error(1.1 * expected, expected) == pytest.approx(0.1, rel=1e-5)
    whole_tensor = float((other_prompt - expected).norm() / expected.norm())
    assert whole_tensor < 0.01  # what the first token hides from ||A - E|| / ||E|| over the whole tensor
    assert relative_error(other_prompt, expected) > 1.0  # per token: 5 of 6 tokens are entirely off


def test_nearest_is_judged_without_the_first_token() -> None:
    layer_a = bf16_exact(L, H, seed=2)
    layer_b = layer_a + 0.01 * bf16_exact(L, H, seed=3)  # neighbours 1% apart, like adjacent layers
    layer_b[0] = layer_a[0] + 0.1 * bf16_exact(H, seed=4)
    actual = torch.cat([layer_a[:1], layer_b[1:]])  # layer b, but for a first token that points at layer a

    assert relative_error(actual, layer_a) < relative_error(actual, layer_b)  # every token judged: layer a
    assert nearest(actual, [layer_a, layer_b]) == 1
    assert nearest(actual[:1], [layer_a[:1], layer_b[:1]]) is None  # a single token cannot tell layers apart
    assert nearest(torch.zeros_like(actual), [layer_a, 2 * layer_a]) is None  # 1.0 from both: no nearest


# ----------------------------------------------------------------------------------------------------------
# compare_sample on synthetic states


@dataclass
class Synthetic:
    input_ids: list[int]
    aux: torch.Tensor  # [L, 3H], bf16-exact float32
    hidden: torch.Tensor  # [L, H]

    def recomputed(self) -> CapturedStates:
        return CapturedStates(aux_hidden_state=self.aux.bfloat16(), hidden_state=self.hidden.bfloat16())


def synthetic(seed: int = 10) -> Synthetic:
    return Synthetic(list(range(100, 100 + L)), bf16_exact(L, 3 * H, seed=seed), bf16_exact(L, H, seed=seed + 1))


def test_a_faithful_sample_passes_with_its_numbers() -> None:
    sample = synthetic()

    result = compare_sample(
        stored_record(sample.input_ids, sample.aux, sample.hidden),
        sample.recomputed(),
        LAYER_IDS,
        "bfloat16",
        recomputed_input_ids=sample.input_ids,
    )

    assert result == SampleComparison("bfloat16", LAYER_IDS, [0.0, 0.0, 0.0], 0.0, [0, 1, 2], [])
    assert result.passed


def test_a_swap_inside_the_tolerance_is_caught_by_the_nearest_slice() -> None:
    sample = synthetic()
    # Recomputed slices 0 and 1 about 2% apart, so each stored slice is inside the tolerance of the other's layer.
    sample.aux[:, H : 2 * H] = (sample.aux[:, :H] + 0.02 * bf16_exact(L, H, seed=20)).bfloat16().float()
    swapped = torch.cat([sample.aux[:, H : 2 * H], sample.aux[:, :H], sample.aux[:, 2 * H :]], dim=-1)

    result = compare_sample(
        stored_record(sample.input_ids, swapped, sample.hidden), sample.recomputed(), LAYER_IDS, "bfloat16"
    )

    assert all(error < DEFAULT_TOLERANCES.bfloat16.aux for error in result.aux_errors), result.aux_errors
    assert result.nearest_aux == [1, 0, 2]
    assert result.reasons == [
        "aux slices 0 and 1 (model layers 3 and 4) are swapped: slice 0 is nearest recomputed slice 1, "
        "slice 1 nearest slice 0"
    ]
    assert not result.passed


def test_the_tolerances_can_be_set() -> None:
    sample = synthetic()
    stored = stored_record(sample.input_ids, 1.04 * sample.aux, sample.hidden)  # every aux state 4% off
    recomputed = sample.recomputed()

    assert compare_sample(stored, recomputed, LAYER_IDS, "bfloat16").passed  # 0.04 < 0.05
    strict = Tolerances(bfloat16=FieldTolerances(aux=0.03, final=0.08))
    reasons = compare_sample(stored, recomputed, LAYER_IDS, "bfloat16", tolerances=strict).reasons
    assert reasons == [
        f"aux layer {slot} (model layer {layer_id}): relative error 0.040 > 0.03 (bfloat16)"
        for slot, layer_id in enumerate(LAYER_IDS)
    ]


def _zeroed_slice(sample: Synthetic) -> tuple[torch.Tensor, torch.Tensor]:
    aux = sample.aux.clone()
    aux[:, 2 * H :] = 0
    return aux, sample.hidden


def _slice_copied_from_another_layer(sample: Synthetic) -> tuple[torch.Tensor, torch.Tensor]:
    aux = sample.aux.clone()
    aux[:, 2 * H :] = aux[:, :H]
    return aux, sample.hidden


def _negated_final(sample: Synthetic) -> tuple[torch.Tensor, torch.Tensor]:
    return sample.aux, -sample.hidden


def _nan_in_aux(sample: Synthetic) -> tuple[torch.Tensor, torch.Tensor]:
    aux = sample.aux.clone()
    aux[3, H + 5] = float("nan")
    return aux, sample.hidden


@pytest.mark.parametrize(
    ("defect", "storage_dtype", "expected_reasons"),
    [
        pytest.param(
            _zeroed_slice,
            "bfloat16",
            [r"aux layer 2 \(model layer 5\): relative error 1\.000 > 0\.05 \(bfloat16\)"],
            id="zeroed-slice",
        ),
        pytest.param(
            _zeroed_slice,
            "fp8_e4m3",
            [r"aux layer 2 \(model layer 5\): relative error 1\.000 > 0\.07 \(fp8_e4m3\)"],
            id="zeroed-slice-fp8",
        ),
        pytest.param(
            _slice_copied_from_another_layer,
            "bfloat16",
            [
                r"aux layer 2 \(model layer 5\): relative error \d+\.\d{3} > 0\.05 \(bfloat16\)",
                r"aux slice 2 \(model layer 5\) is nearest recomputed slice 0 \(model layer 3\), not its own",
            ],
            id="slice-of-another-layer",
        ),
        pytest.param(
            _negated_final,
            "bfloat16",
            [r"final state: relative error 2\.000 > 0\.08 \(bfloat16\)"],
            id="wrong-final-state",
        ),
        pytest.param(
            _nan_in_aux,
            "bfloat16",
            [r"aux layer 1 \(model layer 4\): 1 non-finite value \(NaN or inf\) in the stored state"],
            id="nan",
        ),
    ],
)
def test_each_defect_is_named_with_its_numbers(
    defect: Callable[[Synthetic], tuple[torch.Tensor, torch.Tensor]],
    storage_dtype: StorageDtype,
    expected_reasons: list[str],
) -> None:
    sample = synthetic()
    aux, hidden = defect(sample)

    result = compare_sample(
        stored_record(sample.input_ids, aux, hidden, storage_dtype), sample.recomputed(), LAYER_IDS, storage_dtype
    )

    assert len(result.reasons) == len(expected_reasons), result.reasons
    for pattern, reason in zip(expected_reasons, result.reasons, strict=True):
        assert re.fullmatch(pattern, reason), reason
    assert not result.passed


def test_a_non_finite_recomputation_is_named_as_such() -> None:
    sample = synthetic()
    recomputed = sample.recomputed()
    recomputed.hidden_state[2, :2] = float("inf")

    result = compare_sample(
        stored_record(sample.input_ids, sample.aux, sample.hidden), recomputed, LAYER_IDS, "bfloat16"
    )

    assert result.reasons == ["final state: 2 non-finite values (NaN or inf) in the recomputed state"]
    assert result.aux_errors == [0.0, 0.0, 0.0] and result.final_error != result.final_error  # NaN: not compared


def test_a_length_mismatch_is_named_and_nothing_else_is_compared() -> None:
    sample = synthetic()
    recomputed = CapturedStates(sample.recomputed().aux_hidden_state[:-1], sample.recomputed().hidden_state[:-1])

    result = compare_sample(
        stored_record(sample.input_ids, sample.aux, sample.hidden),
        recomputed,
        LAYER_IDS,
        "bfloat16",
        recomputed_input_ids=sample.input_ids[:-1],
    )

    assert result.reasons == [
        f"length: recomputed aux_hidden_state has {L - 1} tokens, the stored input ids {L}",
        f"length: recomputed hidden_state has {L - 1} tokens, the stored input ids {L}",
        f"length: the recomputed input ids are {L - 1}, the stored ones {L}",
    ]
    assert result.nearest_aux == [None, None, None]
    assert all(error != error for error in [*result.aux_errors, result.final_error])  # NaN: not compared


def test_input_ids_other_than_the_recomputation_are_named() -> None:
    sample = synthetic()
    other_ids = [*sample.input_ids[:2], 7, *sample.input_ids[3:]]

    result = compare_sample(
        stored_record(sample.input_ids, sample.aux, sample.hidden),
        sample.recomputed(),
        LAYER_IDS,
        "bfloat16",
        recomputed_input_ids=other_ids,
    )

    assert result.reasons == [
        f"input ids: 1 of {L} differ from the recomputation's, first at position 2 (stored 102, recomputed 7)"
    ]


# ----------------------------------------------------------------------------------------------------------
# Real SmolLM2 states: stored by a bf16 engine one prompt at a time, recomputed by an fp32 engine in one padded batch


PROMPT_TEXTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number, and explain its complexity.",
    "Explain, step by step, why the sky is blue during the day and red at sunset. " * 4,
]


@dataclass
class RealStates:
    prompts: list[list[int]]
    aux_layer_ids: list[int]
    stored: list[CapturedStates]  # what a worker captured and commits
    recomputed: list[CapturedStates]  # what an audit recomputes with another backend


def capture(engine: ReferenceEngine, prompts: list[list[int]], aux_layer_ids: list[int]) -> list[CapturedStates]:
    future = engine.submit(prompts, SamplingParams(max_new_tokens=0), CaptureSpec(aux_layer_ids=aux_layer_ids))
    states = [result.captured for result in future.result(timeout=300)]
    assert all(state is not None for state in states)
    return [state for state in states if state is not None]


@pytest.fixture(scope="module")
def real_states(smollm2_dir: Path) -> Iterator[RealStates]:
    engines = [ReferenceEngine(smollm2_dir, device="cpu", dtype=dtype) for dtype in ("bfloat16", "float32")]
    try:
        for engine in engines:  # one after the other: two transformers loads at once in one process can fail
            engine.start()
            assert engine.wait_loaded(300) and engine.ready, engine.load_error
        worker, auditor = engines
        tokenizer = worker.tokenizer
        prompts = [
            list(
                tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True).input_ids
            )
            for text in PROMPT_TEXTS
        ]
        layer_ids = worker.model_info.default_aux_layer_ids
        stored = [capture(worker, [prompt], layer_ids)[0] for prompt in prompts]
        yield RealStates(prompts, layer_ids, stored, capture(auditor, prompts, layer_ids))
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.slow
def test_a_clean_recomputation_passes_for_both_storage_dtypes(real_states: RealStates) -> None:
    for prompt, stored, recomputed in zip(real_states.prompts, real_states.stored, real_states.recomputed, strict=True):
        results: dict[StorageDtype, SampleComparison] = {}
        for storage_dtype in ("bfloat16", "fp8_e4m3"):
            record = stored_record(prompt, stored.aux_hidden_state, stored.hidden_state, storage_dtype)
            results[storage_dtype] = compare_sample(
                record, recomputed, real_states.aux_layer_ids, storage_dtype, recomputed_input_ids=prompt
            )
            result = results[storage_dtype]
            limits = DEFAULT_TOLERANCES.for_dtype(storage_dtype)
            assert result.passed, result.reasons
            # Really compared: bf16 against fp32 differs a little, and every slice is judged nearest its own layer.
            assert all(0 < error < limits.aux for error in result.aux_errors), result.aux_errors
            assert 0 < result.final_error < limits.final
            assert result.nearest_aux == [0, 1, 2]
        # The fp8 round trip adds its rounding to every field.
        bf16, fp8 = results["bfloat16"], results["fp8_e4m3"]
        assert all(a < b for a, b in zip(bf16.aux_errors, fp8.aux_errors, strict=True))
        assert bf16.final_error < fp8.final_error


def _zeroed_aux_layer(states: RealStates) -> tuple[torch.Tensor, torch.Tensor]:
    aux = states.stored[1].aux_hidden_state.clone()
    aux[:, aux.shape[1] // 3 : 2 * aux.shape[1] // 3] = 0
    return aux, states.stored[1].hidden_state


def _aux_layers_swapped(states: RealStates) -> tuple[torch.Tensor, torch.Tensor]:
    first, second, third = states.stored[1].aux_hidden_state.chunk(3, dim=-1)
    return torch.cat([second, first, third], dim=-1), states.stored[1].hidden_state


def _final_state_of_another_sample(states: RealStates) -> tuple[torch.Tensor, torch.Tensor]:
    # Prompt 2 is longer; a causal model's first rows are the states of the prompt's first tokens alone.
    length = len(states.prompts[1])
    return states.stored[1].aux_hidden_state, states.stored[2].hidden_state[:length]


def _states_of_another_prompt(states: RealStates) -> tuple[torch.Tensor, torch.Tensor]:
    length = len(states.prompts[1])
    return states.stored[2].aux_hidden_state[:length], states.stored[2].hidden_state[:length]


def _nan_in_the_last_aux_layer(states: RealStates) -> tuple[torch.Tensor, torch.Tensor]:
    aux = states.stored[1].aux_hidden_state.clone()
    aux[7, -1] = float("nan")
    return aux, states.stored[1].hidden_state


@pytest.mark.slow
@pytest.mark.parametrize(
    ("defect", "expected_reasons"),
    [
        pytest.param(
            _zeroed_aux_layer,
            [r"aux layer 1 \(model layer 14\): relative error 1\.000 > 0\.05 \(bfloat16\)"],
            id="zeroed-aux-layer",
        ),
        pytest.param(
            _aux_layers_swapped,
            [
                r"aux layer 0 \(model layer 1\): relative error \d+\.\d{3} > 0\.05 \(bfloat16\)",
                r"aux layer 1 \(model layer 14\): relative error \d+\.\d{3} > 0\.05 \(bfloat16\)",
                r"aux slices 0 and 1 \(model layers 1 and 14\) are swapped: slice 0 is nearest recomputed slice 1, "
                r"slice 1 nearest slice 0",
            ],
            id="aux-layers-swapped",
        ),
        pytest.param(
            _final_state_of_another_sample,
            [r"final state: relative error \d+\.\d{3} > 0\.08 \(bfloat16\)"],
            id="final-state-of-another-sample",
        ),
        pytest.param(
            _states_of_another_prompt,
            [
                r"aux layer 0 \(model layer 1\): relative error \d+\.\d{3} > 0\.05 \(bfloat16\)",
                r"aux layer 1 \(model layer 14\): relative error \d+\.\d{3} > 0\.05 \(bfloat16\)",
                r"aux layer 2 \(model layer 26\): relative error \d+\.\d{3} > 0\.05 \(bfloat16\)",
                r"final state: relative error \d+\.\d{3} > 0\.08 \(bfloat16\)",
            ],
            id="states-of-another-prompt",
        ),
        pytest.param(
            _nan_in_the_last_aux_layer,
            [r"aux layer 2 \(model layer 26\): 1 non-finite value \(NaN or inf\) in the stored state"],
            id="nan",
        ),
    ],
)
def test_each_defect_of_real_states_is_caught_and_named(
    real_states: RealStates,
    defect: Callable[[RealStates], tuple[torch.Tensor, torch.Tensor]],
    expected_reasons: list[str],
) -> None:
    prompt = real_states.prompts[1]
    aux, hidden = defect(real_states)

    result = compare_sample(
        stored_record(prompt, aux, hidden),
        real_states.recomputed[1],
        real_states.aux_layer_ids,
        "bfloat16",
        recomputed_input_ids=prompt,
    )

    assert len(result.reasons) == len(expected_reasons), result.reasons
    for pattern, reason in zip(expected_reasons, result.reasons, strict=True):
        assert re.fullmatch(pattern, reason), reason
