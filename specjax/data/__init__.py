"""Data: offline corpus, tokenizers, TFDS sources, batching."""
