"""Decode for Kimi K3 layers at their exact shapes (random weights), with a generic and a specialized backend."""
from .config import K3, MODELS, TINY, ModelConfig, ShardConfig, shard
from .slice import DecodeSlice

__all__ = ["K3", "TINY", "MODELS", "ModelConfig", "ShardConfig", "shard", "DecodeSlice"]
