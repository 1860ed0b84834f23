"""DeepSeek-V4.1's chat format, shared by the notebook API (`Model.chat`) and the server's HTTP API.

- `encoding.py`: our encoder, exact to DeepSeek's reference `encoding.py` (why not deepseek-recipe's:
  see there).
- `effort.py`: the hosted API's thinking switch and effort names -> (thinking mode, prompt budget).
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

__all__ = [
    "ChatFormatError",
    "PromptEncoder",
    "RenderedPrompt",
    "encode_prompt",
    "parse_completion",
    "render_messages",
    "resolve_thinking",
]
