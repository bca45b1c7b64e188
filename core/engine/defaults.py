"""Defaults more than one record shares, written once: the engine config's and the factory
contexts' (a context built outside an engine, in a test or a simulation, gets the same)."""

BLOCK_SIZE = 16  # token slots per KV block (`[engine] block_size`)
MAX_NUM_SEQS = 64  # sequences in the running batch at most (`[engine] max_num_seqs`)
