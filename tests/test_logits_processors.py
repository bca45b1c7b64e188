"""Logits processors end to end: the built-in penalties, logit_bias, min_tokens and
bad_words give transformers' greedy tokens (its own processors, or vLLM's definition
applied to transformers' logits where transformers has none); third-party processors
selected by name or config default; a processor that raises fails its request alone;
a request waiting for its processor's preparation never holds up the others."""

from __future__ import annotations

import random
import shutil
import threading
from concurrent.futures import Future

import attrs
import pytest
import torch

import servelab
from servelab import LLM, LogitsProcessorPlugin, PluginRegistry, RequestError, SamplingParams
from servelab.config import ConfigError

VOCAB = 211


def prompts(lengths, seed=5):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    return LLM(llama_checkpoint, max_model_len=128)


def hf_generate(model, prompt, max_new_tokens, **kwargs):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                         **{"eos_token_id": None, **kwargs})
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_matches_transformers(llm, hf_model):
    batch = prompts([6, 13, 2])
    outputs = llm.generate(batch, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                 repetition_penalty=1.8))
    plain = llm.generate(batch, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outputs] != [o.token_ids for o in plain]  # the penalty changed something
    for prompt, output in zip(batch, outputs):
        assert output.token_ids == hf_generate(hf_model, prompt, 20, repetition_penalty=1.8)


def test_logit_bias_matches_transformers_sequence_bias(llm, hf_model):
    prompt = prompts([9])[0]
    plain = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    bias = {plain[0]: -100.0, 33: 2.5, 150: 1.5}
    output = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias=bias))[0]
    assert plain[0] not in output.token_ids
    assert output.token_ids == hf_generate(hf_model, prompt, 12, sequence_bias={(t,): b for t, b in bias.items()})


def test_frequency_and_presence_penalties_follow_vllms_definition(llm, hf_model):
    """transformers has neither: vLLM's formula on transformers' logits, greedy, token by token."""
    prompt, frequency, presence = prompts([7])[0], 0.9, 0.6
    output = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                 frequency_penalty=frequency, presence_penalty=presence))[0]
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            logits = hf_model(torch.tensor([tokens])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(tokens[len(prompt):] or [0]), minlength=VOCAB).float()
            if len(tokens) == len(prompt):
                counts.zero_()
            logits -= frequency * counts + presence * (counts > 0).float()
            tokens.append(int(logits.argmax()))
    assert output.token_ids == tokens[len(prompt):]


def test_penalties_with_rollbacks_match_transformers_and_vllms_definition():
    """The tallies the penalties keep (updated token by token, rolled back exactly) give
    transformers' repetition penalty and vLLM's frequency / presence formula on random
    logits, at every step of a random run of accepts and rollbacks over four rows."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from servelab.interfaces import LogitsProcessorContext, ProcessorRequest
    from servelab.plugins.logits_processors.penalties import (FrequencyPenalty, PresencePenalty,
                                                              RepetitionPenalty)

    rng = random.Random(11)
    context = LogitsProcessorContext(vocab_size=VOCAB, eos_token_ids=frozenset({2}))
    params = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in ((1.8, 0.9, 0.6), (0.7, -0.5, 1.5), (1.3, 1.2, -1.0), (2.0, 0.1, 0.2))]
    batch = prompts([5, 1, 12, 3], seed=11)
    processors = [RepetitionPenalty(None, context), FrequencyPenalty(None, context), PresencePenalty(None, context)]
    states = [[p.new_state(ProcessorRequest(f"r{i}", params[i], tuple(batch[i]), None)) for i in range(4)]
              for p in processors]
    outputs = [[] for _ in range(4)]
    for _ in range(60):
        for i in range(4):
            if outputs[i] and rng.random() < 0.3:  # a rejected draft: forget the last few tokens
                k = rng.randint(1, len(outputs[i]))
                del outputs[i][-k:]
                for processor, row in zip(processors, states):
                    processor.rollback(row[i], k)
            token = rng.choice([rng.randrange(3, 12), rng.randrange(VOCAB)])  # repeats, and new tokens
            outputs[i].append(token)
            for processor, row in zip(processors, states):
                processor.accept(row[i], token)
        logits = torch.randn(4, VOCAB) * 3
        for processor, row in zip(processors, states):
            got = processor.apply(logits.clone(), row)
            for i in range(4):
                if isinstance(processor, RepetitionPenalty):
                    expected = RepetitionPenaltyLogitsProcessor(params[i].repetition_penalty)(
                        torch.tensor([batch[i] + outputs[i]]), logits[i: i + 1].clone())[0]
                else:
                    counts = torch.bincount(torch.tensor(outputs[i], dtype=torch.int64), minlength=VOCAB).float()
                    expected = logits[i] - (params[i].frequency_penalty * counts
                                            if isinstance(processor, FrequencyPenalty)
                                            else params[i].presence_penalty * (counts > 0).float())
                torch.testing.assert_close(got[i], expected, rtol=0, atol=1e-5)


def test_min_tokens_matches_transformers_min_new_tokens(llm, hf_model):
    prompt = prompts([8])[0]
    plain = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    stop = [plain[1]]  # without min_tokens the output stops after two tokens
    short = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=stop, ignore_eos=True))
    assert short[0].token_ids == plain[:2] and short[0].finish_reason == "stop"
    output = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=stop, ignore_eos=True,
                                                 min_tokens=6))[0]
    assert len(output.token_ids) >= 6
    expected = hf_generate(hf_model, prompt, 12, min_new_tokens=6, eos_token_id=stop)
    assert output.token_ids == expected[: len(output.token_ids)]
    assert output.finish_reason == ("stop" if output.token_ids[-1] == stop[0] else "length")


def test_bad_words_match_transformers_bad_words_ids(llama_checkpoint, hf_model, tmp_path):
    from conftest_server import add_word_tokenizer

    path = tmp_path / "worded"
    shutil.copytree(llama_checkpoint, path)
    add_word_tokenizer(path)  # "w5" is token 5
    llm = LLM(str(path), max_model_len=128)
    prompt = prompts([10])[0]
    plain = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    bad = [f"w{plain[0]}", f"w{plain[3]} w{plain[4]}"]  # one word, and a two-token sequence
    output = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                 bad_words=bad))[0].token_ids
    assert plain[0] not in output
    assert output == hf_generate(hf_model, prompt, 16, bad_words_ids=[[plain[0]], [plain[3], plain[4]]])


# ---------------------------------------------------------------- third-party processors


@attrs.frozen
class BanOptions:
    token: int = 5


class BanToken:
    """Bans one token; raises for requests that ask it to (extra_args explode=True)."""

    def __init__(self, options, context):
        self.token = options.token

    def new_state(self, request):
        return {"explode": dict(request.params.extra_args).get("explode", False), "seen": 0}

    def apply(self, logits, states):
        if any(state["explode"] and state["seen"] >= 2 for state in states):
            raise ValueError("asked to explode")
        logits[:, self.token] = float("-inf")
        return logits

    def accept(self, state, token_id):
        state["seen"] += 1

    def rollback(self, state, num_tokens):
        state["seen"] -= num_tokens


class Gated:
    """Its `prepare` waits for the test to open the gate (stands in for a slow grammar compile)."""

    def __init__(self, options, context):
        self.gate = Future()

    def prepare(self, params):
        return self.gate

    def new_state(self, request):
        return request.prepared

    def apply(self, logits, states):
        return logits

    def accept(self, state, token_id):
        pass

    def rollback(self, state, num_tokens):
        pass


class ThirdParty:
    @servelab.hookimpl
    def servelab_register_logits_processors(self):
        return [LogitsProcessorPlugin(name="ban-token", factory=BanToken, options=BanOptions,
                                      description="bans one token"),
                LogitsProcessorPlugin(name="gated", factory=Gated, description="waits for a gate")]


def registry():
    registry = PluginRegistry.from_entry_points()
    registry.register(ThirdParty(), name="third-party")
    return registry


def test_named_processor_and_config_defaults(llama_checkpoint):
    prompt = prompts([8])[0]
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    base = LLM(llama_checkpoint, registry=registry(), max_model_len=64)
    plain = base.generate(prompt, SamplingParams(**greedy))[0].token_ids
    banned = plain[2]
    config = {"logits_processors": {"ban-token": {"token": banned}}}
    llm = LLM(llama_checkpoint, config=config, registry=registry(), max_model_len=64)
    named = llm.generate(prompt, SamplingParams(**greedy, logits_processors=["ban-token"]))[0].token_ids
    assert banned not in named and named[:2] == plain[:2]
    assert llm.generate(prompt, SamplingParams(**greedy))[0].token_ids == plain  # not selected: untouched
    by_default = LLM(llama_checkpoint, config={**config, "logits_processors": {**config["logits_processors"],
                                                                                "default": ["ban-token"]}},
                     registry=registry(), max_model_len=64)
    assert by_default.generate(prompt, SamplingParams(**greedy))[0].token_ids == named
    with pytest.raises(RequestError, match="unknown processor 'nope'"):
        llm.generate(prompt, SamplingParams(logits_processors=["nope"]))
    with pytest.raises(ConfigError, match="unknown processor 'nope'"):
        LLM(llama_checkpoint, config={"logits_processors": {"nope": {}}}, max_model_len=64)


def test_a_processor_that_raises_fails_its_request_alone(llama_checkpoint):
    llm = LLM(llama_checkpoint, registry=registry(), max_model_len=64)
    batch = prompts([5, 9, 3])
    greedy = dict(max_tokens=10, temperature=0, ignore_eos=True, logits_processors=["ban-token"])
    alone = [o.token_ids for o in llm.generate(batch, SamplingParams(**greedy))]
    params = [SamplingParams(**greedy), SamplingParams(**greedy, extra_args={"explode": True}),
              SamplingParams(**greedy)]
    outputs = llm.generate(batch, params)
    assert outputs[1].finish_reason == "error" and "ban-token" in outputs[1].error
    assert "asked to explode" in outputs[1].error and len(outputs[1].token_ids) == 2
    assert [outputs[0].token_ids, outputs[2].token_ids] == [alone[0], alone[2]]
    assert outputs[0].finish_reason == "length" and outputs[0].error is None
    assert llm.engine.allocator.stats().num_used_blocks == 0


def test_a_request_waiting_for_its_processor_does_not_hold_up_others(llama_checkpoint):
    llm = LLM(llama_checkpoint, registry=registry(), max_model_len=64)
    engine = llm.engine
    gate = engine.logits_pipeline.processors["gated"].gate
    waiting = engine.add_request(prompts([4])[0], SamplingParams(max_tokens=3, logits_processors=["gated"]))
    others = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts([6, 7])]
    finished = {}
    for _ in range(50):
        for output in engine.step().finished:
            finished[output.request_id] = output
        if set(others) <= set(finished):
            break
    assert set(others) <= set(finished) and waiting not in finished
    threading.Timer(0.05, gate.set_result, ["compiled"]).start()
    while waiting not in finished:
        for output in engine.step().finished:
            finished[output.request_id] = output
    assert len(finished[waiting].token_ids) == 3


def test_processor_params_are_validated(llm):
    with pytest.raises(RequestError, match="repetition_penalty must be in"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(RequestError, match="presence_penalty must be in"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(RequestError, match="logit_bias token id 999 is outside"):
        llm.generate([5], SamplingParams(logit_bias={999: 1.0}))
    with pytest.raises(RequestError, match="bad_words need a tokenizer"):
        llm.generate([5], SamplingParams(bad_words=["x"]))
    with pytest.raises(RequestError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_the_server_fails_only_the_request_a_processor_failed(llama_checkpoint):
    import asyncio

    import httpx

    from servelab.server.app import ServerState, build_app
    from servelab.server.chat import ChatTemplate
    from servelab.server.codec import TextCodec
    from servelab.server.engine_loop import AsyncEngine, ThreadConnection
    from servelab.server.metrics import ServerMetrics

    engine = LLM(llama_checkpoint, registry=registry(), max_model_len=64).engine
    state = ServerState(engine=AsyncEngine(ThreadConnection(engine)), metrics=ServerMetrics(), codec=TextCodec(None, ChatTemplate(None)),
                        model_name="tiny", max_model_len=64, max_waiting=8)
    body = {"prompt": prompts([6])[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logits_processors": ["ban-token"]}

    async def scenario():
        state.engine.start()
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            good, bad, streamed = await asyncio.gather(
                client.post("/v1/completions", json=body),
                client.post("/v1/completions", json={**body, "extra_args": {"explode": True}}),
                client.post("/v1/completions", json={**body, "extra_args": {"explode": True}, "stream": True}))
            health = await client.get("/health")
        await state.engine.shutdown()
        return good, bad, streamed, health

    good, bad, streamed, health = asyncio.run(scenario())
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
    assert bad.status_code == 500 and "logits processor 'ban-token' failed" in bad.json()["error"]["message"]
    assert "asked to explode" in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
    assert health.status_code == 200
    assert engine.allocator.stats().num_used_blocks == 0
