"""One node's step loop: requests, pages, the scheduler, the model runner (and its CUDA
graphs), sampling, and `LLMEngine` that ties them together (S1, S2a, S3a, S3b).
"""
