"""CUDA pieces of the transfer core (S3b, S5a): driver helpers, the mapped counter word, cuMem
KV memory. Importable without a GPU or cuda-python; using them without one is a `CudaError`.
"""
