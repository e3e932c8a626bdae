"""Torch executor of the same `Plan`: torch_npu + HCCL on Ascend, NCCL on CUDA, gloo on CPU."""
