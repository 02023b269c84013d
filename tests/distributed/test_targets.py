"""Abstract GPU targets: their descriptions, the topology of a device count, and the error without the plugin.
Where JAX's CUDA plugin is installed (`pip install -e ".[gpu-compile]"`), the devices themselves."""

import pytest

from moe_jax.distributed import gpu_targets, targets
from moe_jax.distributed.gpu_targets import GPU_TARGETS, gpu_target
from moe_jax.distributed.targets import CompilerUnavailable, target_devices, topology_name

needs_plugin = pytest.mark.skipif(not targets.cuda_plugin_available(),
                                  reason="JAX's CUDA plugin is not installed (pip install -e \".[gpu-compile]\")")


def test_hosts_of_eight_gpus():
    assert topology_name(1) == "1x1x1" and topology_name(8) == "1x1x8"
    assert topology_name(16) == "1x2x8" and topology_name(64) == "1x8x8"
    with pytest.raises(ValueError, match="count=12 does not fill hosts of 8 GPUs"):
        topology_name(12)
    with pytest.raises(ValueError, match="count=0"):
        topology_name(0)


def test_each_target_describes_its_gpu():
    assert set(GPU_TARGETS) >= {"h100", "h200", "b200", "a100"}
    assert gpu_target("h100").compute_capability == (9, 0) and gpu_target("h100").sm_count == 132
    assert gpu_target("b200").compute_capability == (10, 0)
    assert gpu_target("a100").sm_count == 108
    text = gpu_target("h200").config_text()
    assert "core_count: 132" in text and f"device_memory_size: {141 * 10**9}" in text
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text


def test_an_unknown_target_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown GPU target 'v100': use one of h100, h200, b200, a100"):
        target_devices("v100", 8)


def test_without_the_plugin_one_error_names_the_install_line(monkeypatch):
    monkeypatch.setattr(targets, "cuda_plugin_available", lambda: False)
    with pytest.raises(CompilerUnavailable) as caught:
        target_devices("h100", 8)
    import jax

    assert f'pip install "jax[cuda13]=={jax.__version__}"' in str(caught.value)
    assert "no GPU is needed" in str(caught.value)


@needs_plugin
@pytest.mark.parametrize("hardware", sorted(gpu_targets.GPU_TARGETS))
def test_abstract_devices_of_each_target(hardware):
    devices = target_devices(hardware, 8)
    assert len(devices) == 8 and {device.platform for device in devices} == {"gpu"}
    assert devices[0].device_kind == gpu_target(hardware).device_kind
    assert all(targets.is_compile_only(device) for device in devices)


@needs_plugin
def test_sixteen_devices_are_two_hosts_of_eight():
    devices = target_devices("h100", 16)
    assert [device.process_index for device in devices] == [0] * 8 + [1] * 8
