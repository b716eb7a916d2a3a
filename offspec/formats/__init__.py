"""Model files in: Hugging Face folders, the hub cache, GGUF files, published quantized checkpoints, our own
quantized blocks and the per-layer weight layout, the embedded demo models."""
