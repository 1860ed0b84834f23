"""The HTTP API (OpenAI Chat Completions / Completions / Responses, Anthropic Messages) over the engine."""

from serving.http.app import HttpFrontEnd

__all__ = ["HttpFrontEnd"]
