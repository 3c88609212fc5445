"""Speculative decoding (docs/speculative.md): proposers offer draft tokens, a verify step of width depth + 1 checks
them, and each request learns from its own acceptance history how deep to draft."""
