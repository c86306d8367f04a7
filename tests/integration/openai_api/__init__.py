"""The OpenAI-compatible HTTP door against tiny models on loopback."""
