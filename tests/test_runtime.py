"""llmflow.runtime (devices, dtypes, distributed start-up) and llmflow.mesh (layout checks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from server_process import free_port

from llmflow import runtime
from llmflow.mesh import LayoutError, ParallelLayout, build_mesh, layout_problems, validate_layout
from llmflow.models import ModelConfig

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    """No torchrun variables and no device override."""
    for name in (*TORCHRUN_VARS, "LLMFLOW_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ----------------------------------------------------------------------------- devices and dtypes


def test_detect_device_type_is_cpu_here(clean_env):
    assert not torch.cuda.is_available()
    assert runtime.detect_device_type() == "cpu"
    assert runtime.device_spec() is runtime.DEVICES["cpu"]


@pytest.mark.parametrize("forced", ["cpu", "cuda", "npu"])
def test_llmflow_device_override(clean_env, forced):
    clean_env.setenv("LLMFLOW_DEVICE", forced)
    assert runtime.detect_device_type() == forced
    assert runtime.device_spec().type == forced


def test_llmflow_device_invalid(clean_env):
    clean_env.setenv("LLMFLOW_DEVICE", "tpu")
    with pytest.raises(ValueError, match="tpu"):
        runtime.detect_device_type()


def test_device_spec_unknown_type():
    with pytest.raises(ValueError, match="'xpu'"):
        runtime.device_spec("xpu")


def test_devices_table():
    assert runtime.DEVICES["npu"].backend == "hccl"
    assert runtime.DEVICES["cuda"].backend == "nccl"
    assert runtime.DEVICES["cpu"].backend == "gloo"
    assert set(runtime.DEVICES) == {"npu", "cuda", "cpu"}
    for name, spec in runtime.DEVICES.items():
        assert spec.type == name
    assert runtime.DEVICES["npu"].visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert runtime.DEVICES["cuda"].visible_devices_env == "CUDA_VISIBLE_DEVICES"


def test_npu_not_available_here():
    runtime.npu_available.cache_clear()
    try:
        assert runtime.npu_available() is False
        assert runtime.npu_available() is False  # cached, still no exception
    finally:
        runtime.npu_available.cache_clear()
    assert runtime.bf16_supported("npu") is True
    assert runtime.bf16_supported("cpu") is False
    assert runtime.bf16_supported("cuda") is False  # no CUDA on this machine


@pytest.mark.parametrize(
    "requested,expected",
    [
        ("auto", torch.float32),
        (None, torch.float32),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_resolve_dtype_on_cpu(requested, expected):
    assert runtime.resolve_dtype(requested, "cpu") is expected


def test_resolve_dtype_auto_on_accelerators():
    assert runtime.resolve_dtype("auto", "npu") is torch.bfloat16
    # no CUDA here, so bf16 is not supported and auto falls back to fp16
    assert runtime.resolve_dtype("auto", "cuda") is torch.float16


def test_resolve_dtype_invalid_name():
    with pytest.raises(ValueError, match="'float8'"):
        runtime.resolve_dtype("float8", "cpu")


# ----------------------------------------------------------------------------- distributed env


def test_dist_env_defaults_to_single_process(clean_env):
    env = runtime.dist_env_from_environ("cpu")
    assert (env.rank, env.world_size, env.local_rank) == (0, 1, 0)
    assert env.device == torch.device("cpu")
    assert env.is_main


def test_dist_env_from_torchrun_variables(clean_env):
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_RANK", "1")
    env = runtime.dist_env_from_environ("cpu")
    assert (env.rank, env.world_size, env.local_rank) == (5, 8, 1)
    assert env.device == torch.device("cpu")
    assert not env.is_main
    # accelerators get the local rank as the device index ("npu" is only a torch device
    # type once torch_npu is loaded, so it cannot be checked here)
    assert runtime.dist_env_from_environ("cuda").device == torch.device("cuda", 1)


def test_init_distributed_without_torchrun_creates_no_group(clean_env):
    assert not dist.is_initialized()
    env = runtime.init_distributed()
    assert env.world_size == 1 and env.rank == 0
    assert env.device == torch.device("cpu")
    assert not dist.is_initialized()
    runtime.destroy_distributed()  # a no-op without a group
    assert not dist.is_initialized()


def test_one_process_gloo_group_and_mesh(clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    clean_env.setenv("LOCAL_RANK", "0")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    assert not dist.is_initialized()
    try:
        env = runtime.init_distributed("cpu", timeout_s=60)
        assert dist.is_initialized()
        assert dist.get_backend() == "gloo"
        assert env.world_size == dist.get_world_size() == 1
        mesh = build_mesh(ParallelLayout(), "cpu")
        assert mesh.mesh_dim_names == ("pp", "dp", "tp")
        assert tuple(mesh.shape) == (1, 1, 1)
        assert mesh["tp"].size() == 1
        with pytest.raises(LayoutError, match="2 ranks|1 ranks"):
            build_mesh(ParallelLayout(tp=2), "cpu")
    finally:
        runtime.destroy_distributed()
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------- layouts


def model_config(**overrides) -> ModelConfig:
    hf = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    }
    hf.update(overrides)
    return ModelConfig.from_hf(hf)


@pytest.mark.parametrize(
    "layout,world",
    [(ParallelLayout(), 1), (ParallelLayout(tp=4), 4), (ParallelLayout(dp=2, tp=4), 8), (ParallelLayout(dp=12), 12),
     (ParallelLayout(dp=2, cp=2, tp=2), 8)],
)
def test_valid_layouts_pass(layout, world):
    assert layout.world_size == world
    assert layout_problems(layout, world, model_config()) == []
    validate_layout(layout, world, model_config())
    validate_layout(layout, world)


def test_world_size_mismatch():
    with pytest.raises(LayoutError) as err:
        validate_layout(ParallelLayout(dp=3, tp=2), 8)
    msg = str(err.value)
    assert "6" in msg and "8" in msg
    assert "3*2" in msg


def test_heads_not_divisible_by_tp():
    with pytest.raises(LayoutError, match=r"num_attention_heads=6 .*tp=4"):
        validate_layout(ParallelLayout(tp=4), 4, model_config(num_attention_heads=6, num_key_value_heads=2, hidden_size=48))


def test_kv_heads_not_divisible_by_tp():
    with pytest.raises(LayoutError) as err:
        validate_layout(ParallelLayout(tp=4), 4, model_config(num_key_value_heads=2))
    msg = str(err.value)
    assert "num_key_value_heads=2" in msg and "tp=4" in msg
    assert "num_attention_heads" not in msg  # 8 heads split fine


def test_intermediate_not_divisible_by_tp():
    with pytest.raises(LayoutError, match=r"intermediate_size=100 .*tp=8"):
        validate_layout(ParallelLayout(tp=8), 8, model_config(intermediate_size=100, num_key_value_heads=8))


@pytest.mark.parametrize("field,value", [("dp", 0), ("dp", -1), ("tp", 0), ("tp", 1.5)])
def test_non_positive_degree(field, value):
    layout = ParallelLayout(**{field: value})
    with pytest.raises(LayoutError, match=f"{field}={value!r}"):
        validate_layout(layout, 1, model_config())


def test_every_problem_is_reported():
    config = model_config(num_attention_heads=6, num_key_value_heads=3, intermediate_size=99, num_hidden_layers=1, hidden_size=48)
    with pytest.raises(LayoutError) as err:
        validate_layout(ParallelLayout(dp=2, tp=4), 6, config)
    msg = str(err.value)
    for needle in ("8", "6 ranks", "num_attention_heads=6", "num_key_value_heads=3", "intermediate_size=99"):
        assert needle in msg, needle
    assert len(layout_problems(ParallelLayout(dp=2, tp=4), 6, config)) == 4


def test_layout_error_is_a_value_error():
    assert issubclass(LayoutError, ValueError)
