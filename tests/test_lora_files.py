"""PEFT adapter files: what is read, what is refused (by file and field), and the torch
reference of a mixed-adapter batch against one row at a time."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("peft")

from lora_adapters import build_adapter, edit_config  # noqa: E402

from servelab import LLM, LoRARequest, RequestError, SamplingParams  # noqa: E402
from servelab.model.lora_adapter import LoRAAdapterError, LoRAModule, load_adapter  # noqa: E402
from servelab.model.lora_layers import LoRAState, lora_delta_reference, shrink_expand_reference  # noqa: E402
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


def test_the_native_shrink_expand_equals_the_reference():
    """The C++ kernel (cpu_lora.cpp) against the torch reference, at several ranks; skipped
    where the library could not be built (no compiler: the reference serves)."""
    from servelab.plugins.kernels.cpu_build import kernel_build

    build = kernel_build()
    build.start()
    build.wait()
    kernels = build.module()
    if kernels is None:
        pytest.skip("the cpu-paged library is not built here")
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(13, 72, generator=generator)
    for rank, out in ((1, 10), (7, 72), (32, 100)):
        a, b = torch.randn(rank, 72, generator=generator), torch.randn(out, rank, generator=generator)
        rows = torch.tensor([12, 0, 5, 5, 3])
        got = kernels.lora_shrink_expand(x, rows, a, b, 0.75)
        torch.testing.assert_close(got, shrink_expand_reference(x, rows, a, b, 0.75), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="outside x"):
        kernels.lora_shrink_expand(x, torch.tensor([13]), a, b, 1.0)


def test_the_state_falls_back_to_the_reference_without_the_kernel():
    state = LoRAState(2)
    state.use_kernels(None)
    assert state.shrink_expand is shrink_expand_reference
    state.use_kernels(object())  # a library built without the kernel
    assert state.shrink_expand is shrink_expand_reference
