"""Model families and their parts (norms, MLP/MoE, attention and its backends, rotary), the
weights loader and the family registry. Imports torch, transformers and `qworker_kernels`; knows
nothing of requests, scheduling or queues.
"""
