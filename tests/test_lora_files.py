"""PEFT adapter files: what is read, what is refused (by file and field), and the torch
reference of a mixed-adapter batch against one row at a time."""

from __future__ import annotations

import json
import shutil

import attrs

import pytest
import torch

pytest.importorskip("peft")

from lora_adapters import build_adapter, edit_config  # noqa: E402

from servelab import LLM, LoRARequest, RequestError, SamplingParams  # noqa: E402
from servelab.model.lora_adapter import LoRAAdapterError, LoRAModule, load_adapter  # noqa: E402
from servelab.model.lora_layers import LoRABatch, LoRALinear, LoRAState, lora_delta_reference  # noqa: E402
from servelab.model.model_config import ModelConfig  # noqa: E402
from servelab.testing.tiny_model import tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def base() -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def config(base) -> ModelConfig:
    from pathlib import Path
    return ModelConfig.from_directory(Path(base))


@pytest.fixture(scope="module")
def saved(base, tmp_path_factory) -> str:
    return build_adapter(base, tmp_path_factory.mktemp("saved") / "a", r=4, alpha=8, seed=5,
                         target_modules=("q_proj", "o_proj", "down_proj"), rank_pattern={"o_proj": 2},
                         alpha_pattern={"down_proj": 3}, use_rslora=True)


@pytest.fixture
def copy(saved, tmp_path) -> str:
    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    return str(target)


def test_ranks_and_scales_follow_the_config_and_its_patterns(saved, config):
    adapter = load_adapter("a", saved, config, max_rank=16)
    assert set(adapter.modules) == {(layer, m) for layer in range(2) for m in ("q_proj", "o_proj", "down_proj")}
    q, o, down = (adapter.modules[(0, m)] for m in ("q_proj", "o_proj", "down_proj"))
    assert (q.rank, o.rank, down.rank) == (4, 2, 4)
    assert q.scale == pytest.approx(8 / 4 ** 0.5) and o.scale == pytest.approx(8 / 2 ** 0.5)
    assert down.scale == pytest.approx(3 / 4 ** 0.5)
    assert q.lora_a.dtype == torch.float32 and tuple(q.lora_b.shape) == (72, 4)


def write_tensors(path: str, change) -> None:
    from safetensors.torch import load_file, save_file
    file = f"{path}/adapter_model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def first_key(tensors, part: str) -> str:
    return next(k for k in sorted(tensors) if part in k)


@pytest.mark.parametrize("change, file, words", [
    (lambda p: edit_config(p, use_dora=True), "adapter_config.json", "use_dora"),
    (lambda p: edit_config(p, modules_to_save=["lm_head"]), "adapter_config.json", "modules_to_save"),
    (lambda p: edit_config(p, bias="all"), "adapter_config.json", "bias"),
    (lambda p: edit_config(p, target_modules=r".*\.nothing_here"), "adapter_config.json", "matches no module"),
    (lambda p: edit_config(p, target_modules=["q_proj", "embed_tokens"]), "adapter_config.json", "embed_tokens"),
    (lambda p: edit_config(p, r=512, rank_pattern={}), "adapter_config.json", "max_lora_rank"),
    (lambda p: edit_config(p, peft_type="IA3"), "adapter_config.json", "peft_type"),
    (lambda p: write_tensors(p, lambda t: t.__setitem__(first_key(t, "q_proj.lora_B"), torch.zeros(70, 4))),
     "adapter_model.safetensors", "do not fit"),
    (lambda p: write_tensors(p, lambda t: t[first_key(t, "lora_A")].__setitem__((0, 0), float("nan"))),
     "adapter_model.safetensors", "non-finite"),
    (lambda p: write_tensors(p, lambda t: t.pop(first_key(t, "o_proj.lora_B"))),
     "adapter_model.safetensors", "no lora_B"),
    (lambda p: (open(f"{p}/adapter_model.safetensors", "wb").write(b"garbage"),), "adapter_model.safetensors",
     "not a readable safetensors"),
    (lambda p: open(f"{p}/adapter_config.json", "w").write("{"), "adapter_config.json", "not readable JSON"),
])
def test_hostile_adapters_are_refused_naming_file_and_field(copy, config, change, file, words):
    change(copy)
    with pytest.raises(LoRAAdapterError) as caught:
        load_adapter("a", copy, config, max_rank=64)
    assert file in str(caught.value) and words in str(caught.value)


def test_a_hostile_adapter_fails_its_request_only(base, saved, copy):
    """The engine refuses the request naming a bad adapter and serves the others unchanged."""
    write_tensors(copy, lambda t: t[first_key(t, "lora_B")].fill_(float("inf")))
    llm = LLM(base, enable_lora=True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    good = LoRARequest("good", 1, saved)
    before = [out.outputs[0].token_ids for out in llm.generate([[4, 5, 6], [7, 8]], params, lora_request=[good, None])]
    with pytest.raises(RequestError, match="adapter_model.safetensors.*non-finite"):
        llm.generate([[4, 5, 6]], params, lora_request=LoRARequest("bad", 2, copy))
    after = [out.outputs[0].token_ids for out in llm.generate([[4, 5, 6], [7, 8]], params, lora_request=[good, None])]
    assert after == before
    assert [r.lora_name for r in llm.engine.runner.lora.registered()] == ["good"]


def test_the_mixed_batch_reference_equals_one_row_at_a_time():
    """Segments per adapter at mixed ranks (no padding) equal each row's own update."""
    generator = torch.Generator().manual_seed(0)
    modules = [LoRAModule(torch.randn(r, 16, generator=generator), torch.randn(10, r, generator=generator), s)
               for r, s in ((1, 0.5), (8, 2.0), (3, 1.0))] + [None]
    x = torch.randn(9, 16, generator=generator)
    row_slots = torch.tensor([2, -1, 0, 1, 2, 3, 1, -1, 0])
    got = torch.zeros(9, 10)
    for rows, delta in lora_delta_reference(x, row_slots, modules):
        got.index_add_(0, rows, delta)
    for row in range(9):
        slot = int(row_slots[row])
        module = modules[slot] if slot >= 0 else None
        want = torch.zeros(10) if module is None else (x[row] @ module.lora_a.T @ module.lora_b.T) * module.scale
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)


def test_adapter_config_json_is_what_peft_writes(saved):
    settings = json.loads(open(f"{saved}/adapter_config.json").read())
    assert settings["peft_type"] == "LORA" and settings["use_rslora"] is True


def built_kernels():
    from servelab.plugins.kernels.cpu_build import kernel_build

    build = kernel_build()
    build.start()
    build.wait()
    kernels = build.module()
    if kernels is None:
        pytest.skip("the cpu-paged library is not built here")
    return kernels


def fused_layer(dtype: torch.dtype) -> LoRALinear:
    """A qkv-like layer (parts q 0:24, k 24:32, v 32:40 over 20 inputs) under a state of 4
    slots: mixed ranks, slot 1 without a k update, slot 3 empty."""
    generator = torch.Generator().manual_seed(3)
    state = LoRAState(4)
    parts = [("q_proj", 0, 24), ("k_proj", 24, 32), ("v_proj", 32, 40)]
    for slot, ranks in ((0, (4, 1, 8)), (1, (32, None, 2)), (2, (7, 7, 7))):
        state.set_slot(slot, {(0, name): LoRAModule(torch.randn(rank, 20, generator=generator),
                                                    torch.randn(end - start, rank, generator=generator),
                                                    0.25 * (slot + 1))
                              for (name, start, end), rank in zip(parts, ranks) if rank is not None})
    base = torch.nn.Linear(20, 40, bias=False).to(dtype)
    return LoRALinear(base, 0, parts, state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_layer_update_equals_the_reference(dtype):
    """The C++ kernel (cpu_lora.cpp: every slot and part in one call) against the torch
    reference, rows of every slot and of the base model mixed; skipped where the library
    could not be built (no compiler: the reference serves)."""
    kernels = built_kernels()
    layer = fused_layer(dtype)
    x = torch.randn(11, 20, generator=torch.Generator().manual_seed(4)).to(dtype)
    layer.state.batch = LoRABatch(torch.tensor([2, -1, 0, 1, 2, 3, 1, -1, 0, 0, 2]))
    with torch.no_grad():
        want = layer(x)
        layer.state.use_kernels(kernels)
        got = layer(x)
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tolerance)
    with torch.no_grad():
        assert torch.equal(got[[1, 5, 7]], layer.base(x)[[1, 5, 7]])  # base rows and the empty slot untouched


def test_the_native_layer_update_of_a_row_does_not_depend_on_its_batch():
    """A row's update is bit for bit the same alone and among other adapters' rows (the
    base layer zeroed: torch's matmul may round a lone row differently)."""
    layer = fused_layer(torch.float32)
    layer.state.use_kernels(built_kernels())
    torch.nn.init.zeros_(layer.base.weight)
    x = torch.randn(6, 20, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        layer.state.batch = LoRABatch(torch.tensor([1, 0, 2, -1, 1, 0]))
        together = layer(x)
        for row, slot in enumerate([1, 0, 2, -1, 1, 0]):
            layer.state.batch = LoRABatch(torch.tensor([slot]))
            assert torch.equal(layer(x[row:row + 1])[0], together[row])


def test_the_packed_updates_follow_the_slots():
    """Evicting and loading an adapter rewrites its slot's region: the kernel never adds a
    gone adapter's update, nor rows of a larger one the slot held before; a slot outside
    the pool is refused by name."""
    kernels = built_kernels()
    layer = fused_layer(torch.float32)
    layer.state.use_kernels(kernels)
    x = torch.randn(2, 20)
    layer.state.batch = LoRABatch(torch.tensor([0, 2]))
    with torch.no_grad():
        before = layer(x)
        layer.state.set_slot(0, None)
        after = layer(x)
        assert torch.equal(after[0], layer.base(x)[0]) and torch.equal(after[1], before[1])
        # a lower-rank adapter into slot 2's region: its own rank only, none of the old rows
        smaller = {(0, name): LoRAModule(torch.randn(2, 20), torch.randn(end - start, 2), 0.5)
                   for name, start, end in layer.parts}
        layer.state.set_slot(2, smaller)
        got = layer(x)
        layer.state.use_kernels(None)
        torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-4)
        layer.state.use_kernels(kernels)
        with pytest.raises(RuntimeError, match="names slot 7 of 4"):
            kernels.lora_add_(layer.base(x), x, torch.tensor([7, 0]), *attrs.astuple(layer.packed_updates(),
                                                                                     recurse=False))


def test_the_state_falls_back_to_the_reference_without_the_kernel():
    state = LoRAState(2)
    state.use_kernels(None)
    assert state.kernels is None
    state.use_kernels(object())  # a library built without the kernel
    assert state.kernels is None
