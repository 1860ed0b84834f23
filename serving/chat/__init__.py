"""The chat format for the HTTP API: `bridge.py` renders a deepseek-recipe `Conversation` (from its
request converters) with `ced_jax.chat`'s encoder (shared with the notebook API)."""

from serving.chat.bridge import render_conversation

__all__ = ["render_conversation"]
