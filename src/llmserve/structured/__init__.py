"""Structured outputs: constrained decoding through xgrammar.

`grammar` turns a request's StructuredOutputsParams into an xgrammar Grammar (and checks its syntax for the
front), `compiler` compiles grammars against the tokenizer off the engine's loop (cached by constraint),
`matcher` follows one request's tokens, and `bitmask` fills a step's token bitmask and applies it to logits.
Why xgrammar over llguidance (measured): docs/structured-outputs.md.
"""
