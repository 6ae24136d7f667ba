"""Parallelism: the 3D layout (layout.py), its process groups (groups.py), Megatron-style tensor
parallelism (tensor_parallel/), spawned gloo/NCCL worlds for tests and benchmarks (spawn.py), and CPU threads per rank (threads.py)."""
