"""golden_check.py: its comparison catches an off-by-one layer, and it passes against the reference server."""

from pathlib import Path

import golden_check
import torch

from shared.capture.protocol import CapturedStates

L, H, N = 6, 4, 6


def references(seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    layers = [torch.randn(L, H, generator=generator) for _ in range(N - 1)]  # decoder layers 0 .. N - 2
    return layers, torch.randn(L, H, generator=generator)


def capture_of(layers: list[torch.Tensor], final: torch.Tensor, layer_ids: list[int]) -> CapturedStates:
    aux = torch.cat([layers[i] for i in layer_ids], dim=-1).to(torch.bfloat16)
    return CapturedStates(aux_hidden_state=aux, hidden_state=final.to(torch.bfloat16))


def test_the_right_layers_pass() -> None:
    refs = [references(0), references(1)]
    captures = [capture_of(layers, final, [1, 2, 4]) for layers, final in refs]

    checks = golden_check.compare(captures, refs, [1, 2, 4])

    assert [c.ok for c in checks] == [True, True, True, True]
    assert all(c.max_rel_error < 0.01 for c in checks)


def test_an_off_by_one_layer_fails_even_when_the_layers_are_close() -> None:
    layers, final = references(2)
    # Neighbours about 1% apart, like SmolLM2's middle layers past the first token (at the first, 0.2%: less than
    # bf16 rounding, which is why compare() judges the nearest layer without position 0).
    layers[3] = layers[2] + 0.01 * torch.randn(L, H, generator=torch.Generator().manual_seed(7))
    captured = capture_of(layers, final, [1, 3, 4])  # the server captured layer 3 where 2 was asked for

    checks = golden_check.compare([captured], [(layers, final)], [1, 2, 4], aux_tol=0.05)

    assert [c.ok for c in checks] == [True, False, True, True]
    assert checks[1].nearest == "layer 3"


def test_a_pre_norm_final_state_fails() -> None:
    layers, final = references(3)
    captured = capture_of(layers, layers[-1], [1, 2, 4])  # the last residual instead of the post-norm state

    checks = golden_check.compare([captured], [(layers, final)], [1, 2, 4])

    assert not checks[-1].ok and checks[-1].nearest == "a decoder layer output"


def test_golden_check_passes_against_the_reference_server(reference_server_url: str, tiny_model_dir: Path) -> None:
    assert golden_check.main(["--url", reference_server_url, "--model-path", str(tiny_model_dir)]) == 0


def test_golden_check_fails_for_layers_the_model_does_not_have(reference_server_url: str, tiny_model_dir: Path) -> None:
    status = golden_check.main(
        ["--url", reference_server_url, "--model-path", str(tiny_model_dir), "--aux-layer-ids", "1,3,40"]
    )

    assert status == 2  # the server refuses the request: the check cannot run


def test_the_first_position_does_not_decide_the_nearest_layer() -> None:
    layers, final = references(4)
    # An attention sink: a huge first-token state that layers 1 and 2 share up to less than bf16 rounding, so at the
    # first position an exact bf16 capture of layer 2 is nearer layer 1; the other positions tell the layers apart.
    layers[2][0] = 1e4 * torch.randn(H, generator=torch.Generator().manual_seed(5))
    layers[1][0] = layers[2][0].to(torch.bfloat16).float()
    captured = capture_of(layers, final, [1, 2, 4])
    first_row = captured.aux_hidden_state[:1, H : 2 * H]
    first = [golden_check.relative_error(first_row, layer[:1]) for layer in layers]
    assert min(range(len(first)), key=first.__getitem__) == 1  # what the first position alone would conclude

    checks = golden_check.compare([captured], [(layers, final)], [1, 2, 4])

    assert [c.ok for c in checks] == [True, True, True, True]
