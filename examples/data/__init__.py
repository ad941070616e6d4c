"""Example training data: a memory-mapped token file dataset and a byte-level tokenizer."""
