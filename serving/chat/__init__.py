"""The chat format for the HTTP API: `ced_jax.chat` (the encoder and effort rules, shared with the
notebook API) plus `bridge.py`, a deepseek-recipe `Conversation` (from its request converters) rendered
with that encoder.
"""

from ced_jax.chat.effort import resolve_thinking
from ced_jax.chat.encoding import (
    ChatFormatError,
    PromptEncoder,
    RenderedPrompt,
    encode_prompt,
    parse_completion,
    render_messages,
)
from serving.chat.bridge import render_conversation

__all__ = [
    "ChatFormatError",
    "PromptEncoder",
    "RenderedPrompt",
    "encode_prompt",
    "parse_completion",
    "render_conversation",
    "render_messages",
    "resolve_thinking",
]
