"""`servelab serve --lora-modules a=PATH b=PATH`: requests for `a`, `b` and the base model in
the same batch equal peft; /v1/models lists the adapters; runtime loading and unloading
behind --allow-runtime-lora-updating, within the server's bounds; hostile adapters are
refused naming file and field and change nothing else."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

pytest.importorskip("peft")

from conftest_server import ServerProcess, served_checkpoint  # noqa: E402,F401 (fixture)
from lora_adapters import build_adapter, peft_greedy  # noqa: E402

MODEL = "tiny"
PROMPT = [5, 17, 33, 9, 41, 7]


@pytest.fixture(scope="module")
def adapters(llama_checkpoint, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server-adapters")
    return {"a": build_adapter(llama_checkpoint, root / "a", r=4, seed=11),
            "b": build_adapter(llama_checkpoint, root / "b", r=2, seed=12,
                               target_modules=("o_proj", "gate_proj", "up_proj", "down_proj")),
            "c": build_adapter(llama_checkpoint, root / "c", r=8, seed=13)}


@pytest.fixture(scope="module")
def server(served_checkpoint, adapters, tmp_path_factory):
    process = ServerProcess(served_checkpoint, "--served-model-name", MODEL, "--set", "engine.max_num_seqs=8",
                            "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}",
                            "--allow-runtime-lora-updating", "--max-lora-adapters", "3",
                            log_path=tmp_path_factory.mktemp("lora-server") / "server.log")
    yield process
    assert process.terminate() == 0, process.log()


async def complete_all(url: str, models: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}) for model in models))


def token_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_adapters_and_the_base_model_in_one_batch_equal_peft(server, adapters, llama_checkpoint):
    models = ["a", MODEL, "b", "a", MODEL, "b"]
    responses = asyncio.run(complete_all(server.url, models))
    expected = {"a": peft_greedy(llama_checkpoint, adapters["a"], PROMPT, 8),
                "b": peft_greedy(llama_checkpoint, adapters["b"], PROMPT, 8),
                MODEL: peft_greedy(llama_checkpoint, None, PROMPT, 8)}
    assert len({tuple(v) for v in expected.values()}) == 3
    for model, response in zip(models, responses):
        assert token_ids(response) == expected[model], model
        assert response.json()["model"] == model


def test_models_lists_the_adapters(server):
    data = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    listed = {entry["id"]: entry.get("parent") for entry in data}
    assert listed["a"] == MODEL and listed["b"] == MODEL and listed[MODEL] is None


def test_an_unknown_model_is_404(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 404 and "nope" in response.json()["error"]["message"]


def test_runtime_load_unload_and_hostile_adapters(server, adapters, llama_checkpoint, tmp_path):
    load = f"{server.url}/v1/load_lora_adapter"
    hostile = tmp_path / "hostile"
    shutil.copytree(adapters["c"], hostile)
    config = (hostile / "adapter_config.json").read_text().replace('"use_dora": false', '"use_dora": true')
    (hostile / "adapter_config.json").write_text(config)
    refused = httpx.post(load, json={"lora_name": "evil", "lora_path": str(hostile)}, timeout=30)
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "adapter_config.json" in message and "use_dora" in message
    assert httpx.post(load, json={"lora_name": "a", "lora_path": adapters["c"]}, timeout=30).status_code == 400
    assert httpx.post(load, json={"lora_name": "c", "lora_path": adapters["c"]}, timeout=30).status_code == 200
    full = httpx.post(load, json={"lora_name": "d", "lora_path": adapters["c"]}, timeout=30)
    assert full.status_code == 400 and "at most 3" in full.json()["error"]["message"]
    responses = asyncio.run(complete_all(server.url, ["c", "a"]))
    assert token_ids(responses[0]) == peft_greedy(llama_checkpoint, adapters["c"], PROMPT, 8)
    assert token_ids(responses[1]) == peft_greedy(llama_checkpoint, adapters["a"], PROMPT, 8)
    unload = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=30)
    assert unload.status_code == 200
    gone = httpx.post(f"{server.url}/v1/completions", json={"model": "c", "prompt": PROMPT, "max_tokens": 2},
                      timeout=30)
    assert gone.status_code == 404
    assert "evil" not in {e["id"] for e in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]}


def test_chat_names_an_adapter_too(server):
    body = {"messages": [{"role": "user", "content": "w5 w17"}], "max_tokens": 4, "temperature": 0}
    adapted = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "a", **body}, timeout=60)
    plain = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)
    assert adapted.status_code == 200 and adapted.json()["model"] == "a"
    assert plain.status_code == 200 and plain.json()["model"] == MODEL
