"""reshard: change the tensor-parallel layout of Megatron/DeepSpeed checkpoints, correctly."""

__version__ = "0.1.0"
