"""bench/ttt_step_profile's shapes and its step's kernel time by kind (the profiler's averages, summed by name)."""

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.ttt_step_profile import kernel_categories, parse_shape, top_kernels

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def event(
    name: str, microseconds: float, device_type: torch.autograd.DeviceType = CUDA, count: int = 1
) -> SimpleNamespace:
    return SimpleNamespace(key=name, self_device_time_total=microseconds, device_type=device_type, count=count)


def test_shapes_read_as_batch_by_tokens() -> None:
    assert parse_shape("4x2048") == (4, 2048)
    assert parse_shape("1x8192") == (1, 8192)


def test_kernel_time_is_summed_by_kind_and_host_rows_are_left_out(tmp_path: Path) -> None:
    averages = [
        event("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", 5_000),
        event("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN", 3_000),
        event("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, cutlass::bfloat16_t>>", 1_500),
        event("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", 500),  # not a matmul's sm90_
        event("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 1_500),
        event("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 700),
        event("Memcpy DtoD (Device -> Device)", 300),
        event("void at::native::vectorized_elementwise_kernel<4, silu>", 250),
        event("aten::mm", 9_999, CPU),  # a host operator: its device time is its kernels', already counted
    ]
    path = tmp_path / "kinds.json"
    summary = kernel_categories(averages, path)
    assert summary == {
        "matmul": 8.0,
        "attention": 2.0,
        "compiled (Inductor/Triton)": 1.5,
        "optimizer": 0.7,
        "copy/cast": 0.3,
        "other elementwise": 0.25,
        "total kernel ms": 12.75,
    }
    assert json.loads(path.read_text()) == summary


def test_each_kinds_longest_kernels_are_named_longest_first() -> None:
    averages = [
        event("Memcpy DtoD (Device -> Device)", 300, count=14),
        event("void at::native::CatArrayBatchedCopy<bf16>", 1_200, count=21),
        event("void at::native::direct_copy_kernel_cuda<float, bf16>", 800, count=7),
        event("void at::native::fill_kernel", 50),
        event("void at::native::vectorized_elementwise_kernel<4, fill>", 10),
        event("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN", 3_000, count=49),
        event("aten::copy_", 9_999, CPU),  # a host operator: not a kernel
    ]
    assert top_kernels(averages) == {
        "matmul": [("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN", 3.0, 49)],
        "copy/cast": [
            ("void at::native::CatArrayBatchedCopy<bf16>", 1.2, 21),
            ("void at::native::direct_copy_kernel_cuda<float, bf16>", 0.8, 7),
            ("Memcpy DtoD (Device -> Device)", 0.3, 14),
        ],
    }
