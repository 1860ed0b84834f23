"""The HTTP APIs (OpenAI Chat Completions / Completions / Responses, Anthropic Messages) over the engine."""
