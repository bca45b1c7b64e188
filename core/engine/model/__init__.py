"""The Llama-family model: checkpoint loading, RoPE, the decoder, the tokenizer."""
