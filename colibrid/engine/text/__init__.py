"""Text in and out of token ids: the tokenizer and the chat template."""
