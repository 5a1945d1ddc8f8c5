"""Layering of the model code: models/ imports no upper layer, the architecture registry is the
one list of served families, cache specs are named components, and each op is chosen once."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from thermostat import kernels
from thermostat.engine.loader import ModelLoadError, load_model
from thermostat.models import layers, llama
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.kv_spec import CacheComponent, KVCacheSpec
from thermostat.models.registry import ARCHITECTURES, model_class

MODELS_DIR = Path(llama.__file__).parent
UPPER_LAYERS = ("thermostat.engine", "thermostat.server", "thermostat.llm", "thermostat.commands")


def imported_modules(path: Path) -> list[str]:
    """Every module `path` imports (absolute names; `from a import b` counts a and a.b)."""
    package = ".".join(["thermostat", "models", *path.relative_to(MODELS_DIR).parts[:-1]])
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names.extend([module] + [f"{module}.{alias.name}" for alias in node.names])
    return names


def test_models_import_no_upper_layer():
    files = sorted(MODELS_DIR.rglob("*.py"))
    assert len(files) >= 6
    for path in files:
        bad = [m for m in imported_modules(path) if m.startswith(UPPER_LAYERS)]
        assert not bad, f"{path.relative_to(MODELS_DIR)} imports {bad}"


def test_a_family_imports_layers_not_another_family():
    families = {f"thermostat.models.{name}" for name in ("llama", "deepseek", "gemma3")}
    for path in sorted(MODELS_DIR.glob("*.py")):
        if path.stem != "registry":
            bad = {m for m in imported_modules(path) if m in families}
            assert not bad, f"{path.name} imports {bad}"


def test_registry_is_the_list_of_served_architectures(tmp_path):
    assert set(ARCHITECTURES) == {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV4ForCausalLM",
        "Gemma3ForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    }
    assert model_class(["Foo", "Qwen2ForCausalLM"]) == ("Qwen2ForCausalLM", llama.LlamaFamilyModel)
    (tmp_path / "config.json").write_text(
        '{"architectures": ["FalconForCausalLM"], "model_type": "llama"}'
    )
    with pytest.raises(ModelLoadError, match="FalconForCausalLM.*not supported") as err:
        load_model(tmp_path)
    assert all(name in str(err.value) for name in ARCHITECTURES)


def test_cache_spec_sums_named_components():
    kv = KVCacheSpec.key_value(3, 2, 64, 16, torch.bfloat16)
    assert [c.name for c in kv.components] == ["key", "value"] and kv.is_key_value
    assert kv.bytes_per_block == 2 * 3 * 16 * 2 * 64 * 2
    fp8 = KVCacheSpec.key_value(3, 2, 64, 16, torch.float8_e4m3fn)
    assert fp8.quantized and fp8.bytes_per_block == 2 * 3 * 16 * 2 * (64 + 4)  # + a scale/head
    latent = KVCacheSpec(3, 16, (CacheComponent("latent", (576,), torch.float8_e4m3fn),))
    assert not latent.is_key_value and latent.bytes_per_block == 3 * 16 * (576 + 4)
    with pytest.raises(ValueError, match="distinct"):
        KVCacheSpec(1, 16, (CacheComponent("key", (4,), torch.float32),) * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_one_component_cache_round_trip(dtype):
    """A layout other than key/value (an MLA latent) writes and gathers on the PyTorch paths,
    with or without the kernels."""
    spec = KVCacheSpec(2, 4, (CacheComponent("latent", (40,), dtype),))
    cache = PagedKVCache(spec, 6, torch.float32, kernels.ops())
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    cache.write(1, (x,), torch.tensor([8, 9, 10, 0, 23]))
    (got,) = cache.gather(1, torch.tensor([[2, 0, 5]]))  # slots 8..11, 0..3, 20..23
    assert got.shape == (1, 12, 40)
    tol = 0.07 if dtype == torch.float8_e4m3fn else 0
    torch.testing.assert_close(got[0, [0, 1, 2, 4, 11]], x, atol=tol * 4, rtol=tol)


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cache_is_zeros_committed_only_as_written():
    """A 256 MB cache starts as zeros without its memory being resident; a written block becomes
    resident, and the memory is the process's own (a fork's writes are not shared)."""
    before = resident_bytes()
    cache = PagedKVCache(KVCacheSpec.key_value(2, 4, 64, 16, torch.bfloat16), 4096, torch.float32)
    assert resident_bytes() - before < 8 * 2**20
    key = cache.store["key"][1]
    assert key.nbytes == 4096 * 16 * 4 * 64 * 2 and key.is_contiguous()
    # reading maps the zero page, nothing committed (in slices: any() makes a bool copy)
    assert not any(key[i : i + 128].any() for i in range(1024, 4096, 128))
    assert resident_bytes() - before < 8 * 2**20
    key[:3072] = 1  # 24 MB
    assert resident_bytes() - before >= 20 * 2**20 and key[:3072].eq(1).all()
    pid = os.fork()
    if pid == 0:  # the child writes its copy and leaves at once
        key[0, 0, 0, 0] = 7
        os._exit(0)
    os.waitpid(pid, 0)
    assert key[0, 0, 0, 0] == 1


def test_layers_choose_each_op_once_when_built():
    """Without the kernels every op is its PyTorch reference; with them, the compiled op where
    the shapes and the cache layout allow it."""
    assert layers.RMSNorm(64, 1e-6, None)._norm is layers._rms_norm
    plain = PagedKVCache(KVCacheSpec.key_value(1, 2, 64, 4, torch.float32), 2, torch.float32)
    assert plain._decode == plain._decode_sdpa and plain._write == plain._write_torch
    ops = kernels.ops()
    if ops is None:
        pytest.skip(f"CPU kernels {kernels.status()}")
    assert layers.RMSNorm(64, 1e-6, ops)._norm == ops.rms_norm
    assert layers.RMSNorm(24, 1e-6, ops)._norm is layers._rms_norm  # dim % 16 != 0
    bf16 = KVCacheSpec.key_value(1, 2, 64, 4, torch.bfloat16)
    mixed = PagedKVCache(bf16, 2, torch.float32, ops)  # a bf16 cache under a float32 model
    assert mixed._decode == mixed._decode_sdpa and mixed._write == mixed._write_torch
    fp8 = PagedKVCache(KVCacheSpec.key_value(1, 2, 64, 4, torch.float8_e4m3fn), 2, bf16.dtype, ops)
    assert fp8._decode == fp8._decode_compiled and fp8._write == fp8._write_compiled
    same = PagedKVCache(bf16, 2, torch.bfloat16, ops)
    assert same.in_place_kernels and fp8.in_place_kernels and not mixed.in_place_kernels
    assert layers.RMSNorm(64, 1e-6, ops).compiled and not layers.RMSNorm(24, 1e-6, ops).compiled
