"""Conformance contract of the chunk-sizing seam (`servelab.contracts.pipeline.ChunkSizing`).

    from servelab.testing.pipeline import ChunkSizingContract

    class TestMine(ChunkSizingContract):
        sizing = MyChunks()

Checked on prompts of odd lengths with a chunk time that grows with the context (as
attention's does): the chunks cover the prompt exactly, in bounds, deterministically;
`fixed` is its definition; `equal_time` keeps every chunk within the first chunk's time
and makes each as long as that allows.
"""

from __future__ import annotations

from typing import Any

from servelab.contracts.pipeline import CHUNK_SIZING_CONTRACT_VERSION, ChunkSizing

CASES = [(1, 1), (7, 3), (100, 16), (4096, 512), (513, 512), (9, 20)]


def chunk_time(tokens: int, context: int) -> float:
    """A stage's time: a fixed cost, a per-token cost, and attention over the context."""
    return 1.0 + 0.01 * tokens + 2e-5 * tokens * (context + tokens / 2)


def _fail(what: str) -> str:
    return f"{what} (chunk sizing contract version {CHUNK_SIZING_CONTRACT_VERSION})"


class ChunkSizingContract:
    sizing: Any = None

    def test_implements_the_protocol(self):
        assert isinstance(self.sizing, ChunkSizing), _fail("implements ChunkSizing")

    def test_chunks_cover_the_prompt_within_bounds(self):
        for prompt_len, max_chunk in CASES:
            chunks = self.sizing.chunks(prompt_len, max_chunk, chunk_time)
            assert sum(chunks) == prompt_len, _fail(f"the chunks {chunks[:8]}... sum to the prompt's {prompt_len}")
            assert all(1 <= c <= max_chunk for c in chunks), _fail(f"every chunk lies in 1..{max_chunk}")

    def test_is_deterministic(self):
        for prompt_len, max_chunk in CASES:
            assert (self.sizing.chunks(prompt_len, max_chunk, chunk_time)
                    == self.sizing.chunks(prompt_len, max_chunk, chunk_time)), _fail("the same inputs, the same chunks")

    def test_named_policies_keep_their_definition(self):
        for prompt_len, max_chunk in CASES:
            chunks = self.sizing.chunks(prompt_len, max_chunk, chunk_time)
            if self.sizing.name == "fixed":
                expected = [max_chunk] * (prompt_len // max_chunk) + ([prompt_len % max_chunk] * (prompt_len % max_chunk > 0))
                assert chunks == expected, _fail("fixed cuts max_chunk tokens at a time")
            elif self.sizing.name == "equal_time":
                target = chunk_time(min(max_chunk, prompt_len), 0)
                done = 0
                for index, tokens in enumerate(chunks):
                    assert chunk_time(tokens, done) <= target + 1e-12, _fail(f"chunk {index} fits the first's time")
                    longer = tokens + 1 <= min(max_chunk, prompt_len - done)
                    assert not longer or chunk_time(tokens + 1, done) > target, _fail(
                        f"chunk {index} is as long as the first chunk's time allows")
                    done += tokens
