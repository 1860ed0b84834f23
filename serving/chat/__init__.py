"""DeepSeek-V4.1 chat format for the HTTP API: prompt rendering, tokenization, completion parsing, effort.

- `encoding.py`: our encoder, exact to DeepSeek's reference `encoding.py` (why not deepseek-recipe's:
  see there).
- `effort.py`: the hosted API's thinking switch and effort names -> (thinking mode, prompt budget).
- `bridge.py`: a deepseek-recipe `Conversation` (from its request converters) rendered with our encoder.
"""

from serving.chat.bridge import render_conversation
from serving.chat.effort import resolve_thinking
from serving.chat.encoding import (
    ChatFormatError,
    PromptEncoder,
    RenderedPrompt,
    encode_prompt,
    parse_completion,
    render_messages,
)

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
