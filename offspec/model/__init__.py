"""The Llama-family forward with explicit weights (draft and target alike), its KV cache, the resident draft, the
token ids draft and target share."""
