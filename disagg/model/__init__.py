"""One forward pass over paged KV: the transformer, attention, the KV cache (sharded
form too), the layer counter and the draft heads (S3b, S5a, S6, S7, S8). `loading/` turns a
`--model` spec into a config, weights and a tokenizer.
"""
