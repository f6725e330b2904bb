"""cs336_basics: a compact Transformer LM (model, losses, AdamW, data loading, checkpoints)."""

from .model import BasicsTransformerLM, available_attention_impls, get_attention, register_attention

__all__ = ["BasicsTransformerLM", "available_attention_impls", "get_attention", "register_attention"]
