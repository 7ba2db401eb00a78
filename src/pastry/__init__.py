"""Pastry: a programmable LLM serving system. Inferlets drive generation through fine-grained
calls (tokenize, embed, forward over paged KV cache, sample) batched onto one model."""

__version__ = "0.1.0"
