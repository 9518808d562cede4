"""Speculative decoding: proposers of draft tokens (the target model verifies them)."""
