"""From a `--model` spec to weights: the registry, GGUF and Hugging Face loaders, tokenizers,
and the model fingerprint peers compare at handshake.
"""
