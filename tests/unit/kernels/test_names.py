"""Kernel names, the ``sdpa`` alias, and what ``auto`` picks for CUDA, resolved without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cp_attention.kernels import (
    KERNEL_NAMES,
    CpuFlashKernel,
    SdpaCpuKernel,
    check_kernel_name,
    get_kernel,
    resolve_kernel_name,
)
from cp_attention.kernels import SdpaCpuKernel as OldImport
from tests.support.cuda import flash_attn_standin

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def test_every_name_and_alias_is_listed():
    # validation sends a kernel as its index into KERNEL_NAMES: every accepted name must be there
    assert set(KERNEL_NAMES) == {"auto", "cpu_flash", "sdpa", "flash", "flash_attn", "efficient", "cudnn", "math"}
    assert len(set(KERNEL_NAMES)) == len(KERNEL_NAMES) and KERNEL_NAMES[0] == "auto"
    for name in KERNEL_NAMES:
        assert check_kernel_name(name) == name
    with pytest.raises(ValueError, match="unknown kernel 'flash2'; expected one of: auto, cpu_flash"):
        check_kernel_name("flash2")


def test_sdpa_is_an_alias_of_cpu_flash():
    assert resolve_kernel_name("sdpa") == "cpu_flash" and resolve_kernel_name("auto") == "auto"
    kern = get_kernel("sdpa", "cpu", FP32)
    assert kern is get_kernel("cpu_flash", "cpu", FP32) and kern.name == "cpu_flash"
    assert SdpaCpuKernel is CpuFlashKernel is OldImport
    # errors name the kernel as the caller spelled it
    with pytest.raises(ValueError, match="kernel 'sdpa' cannot apply softcap; use kernel='math'"):
        get_kernel("sdpa", "cpu", FP32, softcap=True)
    with pytest.raises(ValueError, match="kernel 'sdpa' does not support device cuda"):
        get_kernel("sdpa", "cuda", FP32)


@pytest.mark.parametrize("dtype,kw,want", [  # before CUDA is initialised: the newest row (sm90 on)
    (BF16, {}, "cudnn"),
    (FP16, {}, "cudnn"),
    (FP32, {}, "efficient"),
    (FP64, {}, "math"),  # nothing fused takes fp64
    (BF16, {"head_dim": 128}, "cudnn"),
    (BF16, {"head_dim": 192, "v_head_dim": 128}, "flash"),  # cuDNN: head dim <= 128
    (BF16, {"head_dim": 256}, "flash"),
    (BF16, {"head_dim": 512}, "efficient"),
    (BF16, {"head_dim": 128, "v_head_dim": 264}, "efficient"),
    (FP32, {"head_dim": 512}, "efficient"),
    (BF16, {"mask": True}, "flash"),  # windows: flash's own window_size_left/right
    (FP32, {"mask": True}, "efficient"),
    (BF16, {"softcap": True, "mask": True}, "math"),
    (FP32, {"softcap": True}, "math"),
])
def test_auto_on_cuda(dtype, kw, want):
    kind = "window" if kw.get("mask") else "causal"
    assert get_kernel("auto", "cuda", dtype, **kw).picks[kind] == want
    assert get_kernel("auto", torch.device("cuda", 0), dtype, **kw).picks[kind] == want


def test_auto_softcap_on_cuda_needs_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)  # "not importable"
    monkeypatch.setattr("cp_attention.kernels.cuda_flash_attn._import_interface", lambda: None)
    assert get_kernel("auto", "cuda", BF16, softcap=True).picks['causal'] == "math"
    flash_attn_standin.install(monkeypatch, "2.8.3")
    assert get_kernel("auto", "cuda", BF16, softcap=True).picks['causal'] == "flash_attn"
    assert get_kernel("auto", "cuda", BF16).picks['causal'] == "cudnn"  # the package is used only for softcap
    assert get_kernel("auto", "cuda", BF16, softcap=True, head_dim=512).picks['causal'] == "math"
    assert get_kernel("auto", "cuda", FP32, softcap=True).picks['causal'] == "math"


def test_never_math_on_cuda_when_a_fused_kernel_fits():
    for dtype in (BF16, FP16, FP32):
        for mask in (False, True):
            for head_dim in (None, 64, 256, 320):
                picks = get_kernel("auto", "cuda", dtype, mask=mask, head_dim=head_dim).picks
                assert "math" not in (picks["causal"], picks["full"], picks["window"], picks["masked"]), picks


def test_explicit_cuda_kernels_say_what_they_cannot_do():
    assert get_kernel("cudnn", "cuda", BF16, head_dim=128).name == "cudnn"
    with pytest.raises(ValueError, match="kernel 'flash' does not support device cuda with dtype torch.float32"):
        get_kernel("flash", "cuda", FP32)
    with pytest.raises(ValueError, match="kernel 'flash' does not take head dim 512; use kernel='efficient'"):
        get_kernel("flash", "cuda", BF16, head_dim=512)
    with pytest.raises(ValueError, match="kernel 'cudnn' does not take head dim 192; use kernel='flash'"):
        get_kernel("cudnn", "cuda", BF16, head_dim=192)
    assert get_kernel("flash", "cuda", BF16, mask=True).name == "flash"  # its own window_size_left/right
    with pytest.raises(ValueError, match=r"kernel 'cudnn' cannot apply sliding windows \(masks\); use kernel='flash"):
        get_kernel("cudnn", "cuda", BF16, mask=True)
    with pytest.raises(ValueError, match="kernel 'efficient' cannot apply softcap; use kernel='math'"):
        get_kernel("efficient", "cuda", FP32, softcap=True)
    with pytest.raises(ValueError, match="kernel 'efficient' does not support device cpu"):
        get_kernel("efficient", "cpu", FP32)


@pytest.mark.dist
def test_resolving_for_cuda_does_not_initialise_cuda():
    code = ("import torch\nfrom cp_attention.kernels import get_kernel\n"
            "names = [get_kernel('auto', 'cuda', d).picks['causal'] for d in (torch.bfloat16, torch.float32)]\n"
            "assert names == ['cudnn', 'efficient'], names\n"
            "assert not torch.cuda.is_initialized()\nprint('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_pre_ampere_gpus_get_the_memory_efficient_kernel(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert get_kernel("auto", "cuda", FP16).picks['causal'] == "efficient"
    with pytest.raises(ValueError, match="kernel 'flash' does not support device cuda"):
        get_kernel("flash", "cuda", FP16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert get_kernel("auto", "cuda", FP16).picks['causal'] == "flash"  # Ampere: FA2 first (nothing measured there)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert get_kernel("auto", "cuda", FP16).picks == {"causal": "cudnn", "full": "cudnn", "window": "flash",
                                                      "varlen": "flash", "masked": "efficient"}


def test_bf16_below_ampere_gets_no_fused_kernel(monkeypatch):
    """PyTorch's CUTLASS kernels have no bf16 below sm80: auto must not pick one, and naming one says
    which kernel can run the case (fp16 and fp32 keep the memory-efficient kernel there)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert get_kernel("auto", "cuda", torch.bfloat16).picks['causal'] == "math"
    assert get_kernel("auto", "cuda", torch.float32).picks['causal'] == "efficient"
    for name in ("efficient", "flash", "cudnn"):
        with pytest.raises(ValueError, match=f"kernel '{name}' does not support device cuda with dtype "
                                             r"torch.bfloat16 .*use kernel='math'"):
            get_kernel(name, "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="use kernel='efficient'"):
        get_kernel("flash", "cuda", FP16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert get_kernel("auto", "cuda", torch.bfloat16).picks['causal'] == "flash"
    assert get_kernel("efficient", "cuda", torch.bfloat16).name == "efficient"
