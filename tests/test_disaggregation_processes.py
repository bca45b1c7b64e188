"""xPyD with one process per engine (servelab.disagg.processes): output identical to one
colocated engine through the shared-files transport, for token and text prompts; a prefill
process killed mid-stream ends each of its requests by the failure policy within a bound,
and no engine left holds a KV block; a request an engine refuses ends with an error naming
the problem, the requests beside it served and both processes alive."""

from __future__ import annotations

import time

import pytest

from servelab import LoRARequest, SamplingParams, StructuredOutput
from servelab.disagg.processes import ProcessDeployment
from servelab.llm import LLM

PROMPTS = [list(range(5, 31)), list(range(5, 17)) + list(range(60, 75)), list(range(40, 63))]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)  # first position from P
# n handoffs seeded seed + i, penalties counting P's first token, prompt logprobs from P
KINDS = SamplingParams(n=2, max_tokens=6, temperature=0.9, seed=5, presence_penalty=1.0, frequency_penalty=0.5,
                       min_tokens=3, prompt_logprobs=1, ignore_eos=True)


def _prompt_values(output) -> list[float]:
    return [p[t].logprob for p in output.prompt_logprobs if p is not None for t in sorted(p)]


@pytest.mark.parametrize("failure_policy", ["recompute", "fail"])
def test_two_processes_match_one_engine_and_survive_a_killed_prefill(servelab_tiny_checkpoint, tmp_path,
                                                                     failure_policy):
    config = {"engine": {"model": servelab_tiny_checkpoint, "block_size": 4, "num_kv_blocks": 96,
                         "max_num_seqs": 4, "max_model_len": 128}, "allocator": {"name": "hash"},
              "kv_transfer": {"name": "shared-files", "path": str(tmp_path / "kv")}}
    llm = LLM(config={k: v for k, v in config.items() if k != "kv_transfer"})
    try:
        reference = llm.generate(PROMPTS, GREEDY)
        expected = [o.token_ids for o in reference]
        kinds = llm.generate(PROMPTS, KINDS)
        longer = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        expected_longer = [o.token_ids for o in llm.generate(PROMPTS, longer)]
    finally:
        llm.close()
    with ProcessDeployment(config, failure_policy=failure_policy, lease_s=2.0) as deployment:
        outputs = deployment.generate(PROMPTS, [GREEDY] * len(PROMPTS), timeout_s=120)
        assert [o.token_ids for o in outputs] == expected
        for got, want in zip(outputs, reference):
            assert [sorted(p) for p in got.outputs[0].logprobs] == [sorted(p) for p in want.outputs[0].logprobs]
            assert [p[t].logprob for p in got.outputs[0].logprobs for t in sorted(p)] == pytest.approx(
                [p[t].logprob for p in want.outputs[0].logprobs for t in sorted(p)], abs=1e-4)
        for got, want in zip(deployment.generate(PROMPTS, [KINDS] * len(PROMPTS), timeout_s=120), kinds):
            assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
            assert got.prompt_logprobs[0] is None and _prompt_values(got) == pytest.approx(_prompt_values(want),
                                                                                           abs=1e-4)
        # kill the prefill process with requests on it: each ends within the bound. One was
        # handed on just before the death, its message still queued when the death is noticed:
        # it is decoded from its handoff, not also recomputed or failed.
        deployment.used_blocks()
        before = dict(deployment.engine_metrics["decode-0"])
        handed = deployment.add_request(PROMPTS[0], longer)
        message = deployment.results.get(timeout=60)
        assert message[:2] == ("prefilled", handed)
        deployment.results.put(message)
        deadline = time.monotonic() + 30
        while deployment.results.empty() and time.monotonic() < deadline:  # put back through a feeder thread
            time.sleep(0.01)
        ids = [deployment.add_request(p, longer) for p in PROMPTS]
        deployment.kill("prefill-0")
        ended = deployment.wait([handed, *ids], timeout_s=60)
        assert ended[0].finish_reason != "error" and ended[0].token_ids == expected_longer[0]
        for output, tokens in zip(ended[1:], expected_longer):
            if failure_policy == "recompute" or output.finish_reason != "error":
                assert output.token_ids == tokens
        assert deployment.used_blocks() == {"decode-0": 0}
        after = deployment.engine_metrics["decode-0"]
        lost = after["recomputes"] - before["recomputes"] if failure_policy == "recompute" else sum(
            o.finish_reason == "error" and "died" in o.error for o in ended)
        assert 1 <= lost <= len(ids)  # the kill caught requests before their handoff; not the handed one
        # every request reached the decode side once: by its handoff, or lost and recomputed or failed
        assert after["transfers"] - before["transfers"] + lost == len(ended)
    assert all(not process.is_alive() for process, _, _ in deployment.engines.values())


def test_text_prompts_are_one_engine_s_and_a_refused_request_ends_alone(tmp_path):
    """Text prompts are tokenized as one colocated engine tokenizes them, and a prompt whose
    first token fills max_model_len ends as on one engine. Requests the prefill engine
    refuses (a prompt longer than max_model_len, an adapter it does not serve, a regex that
    does not parse, with n=2) are queued between good ones: each ends with an error naming
    the problem, the good ones get one colocated engine's output, both processes live on
    and neither holds a KV block; nor after a request aborted at once."""
    config = {"engine": {"model": "builtin:tiny", "block_size": 4, "num_kv_blocks": 96, "max_num_seqs": 4,
                         "max_model_len": 128}, "allocator": {"name": "hash"},
              "kv_transfer": {"name": "shared-files", "path": str(tmp_path / "kv")}}
    texts = ["The capital of France is", "Once upon a time there was a cat"]
    good_prompts = [*texts, list(range(5, 5 + 127))]  # the last: its first token fills the context
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(config={k: v for k, v in config.items() if k != "kv_transfer"})
    try:
        expected = [(o.prompt, o.prompt_token_ids, o.token_ids, o.outputs[0].text)
                    for o in llm.generate(good_prompts, greedy)]
    finally:
        llm.close()
    refused = {"prompt has 202 tokens, more than max_model_len=128": ("word " * 200, greedy, None),
               "serves no LoRA adapters": (texts[0], greedy, LoRARequest("absent", 1, str(tmp_path / "absent"))),
               "regex is invalid": (texts[1], SamplingParams(n=2, max_tokens=6, structured=StructuredOutput.regex(
                   "(((")), None)}
    with ProcessDeployment(config) as deployment:
        good, bad = [], []
        for prompt, (bad_prompt, params, adapter) in zip(good_prompts, refused.values()):
            good.append(deployment.add_request(prompt, greedy))
            bad.append(deployment.add_request(bad_prompt, params, adapter))
        outputs = deployment.wait(good, timeout_s=60)
        assert [(o.prompt, o.prompt_token_ids, o.token_ids, o.outputs[0].text) for o in outputs] == expected
        for reason, output in zip(refused, deployment.wait(bad, timeout_s=60)):
            assert {c.finish_reason for c in output.outputs} == {"error"} and reason in output.error, output.error
        assert all(process.is_alive() for process, _, _ in deployment.engines.values())
        assert deployment.used_blocks() == {"prefill-0": 0, "decode-0": 0}
        assert deployment.engine_metrics["decode-0"]["recomputes"] == 0  # every good one was handed over
        # an aborted request stops wherever it is and holds nothing; the next is served as before
        long = deployment.add_request(texts[0], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        deployment.abort(long)
        assert deployment.generate([good_prompts[1]], [greedy], timeout_s=60)[0].token_ids == expected[1][2]
        assert deployment.used_blocks() == {"prefill-0": 0, "decode-0": 0}


def test_a_prefill_engine_s_count_frees_the_holds_whose_transfers_ended_first():
    """The router asks for the engines' KV counts as soon as the last output came back. The
    decode side completed each transfer before it decoded, so no hold is counted any more,
    even when the prefill process has not looped (and freed it) since."""
    import queue

    from servelab.config import EngineConfig
    from servelab.disagg.processes import _run_command
    from servelab.disagg.producer import PrefillWorker
    from servelab.engine import LLMEngine
    from servelab.plugins.transports.in_process import InProcessTransport

    engine = LLMEngine(EngineConfig.load({"engine": {"model": "builtin:tiny", "block_size": 4, "num_kv_blocks": 64,
                                                     "max_model_len": 128},
                                          "allocator": {"name": "hash"}}))
    transport = InProcessTransport()
    worker = PrefillWorker(engine, transport, "prefill-0", lease_s=60.0)
    worker.add("handed", list(range(5, 31)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while not worker.num_holds:
        worker.step()
    results: queue.Queue = queue.Queue()
    _run_command(("stats",), worker, engine, "prefill-0", results, "producer")
    assert results.get_nowait()[2] == 6  # the prompt's 6 full blocks, held while the transfer is open
    transport.complete("handed")  # the decode side loaded them
    _run_command(("stats",), worker, engine, "prefill-0", results, "producer")
    assert results.get_nowait()[2] == 0 and worker.num_holds == 0
