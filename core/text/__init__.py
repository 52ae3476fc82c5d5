"""Text: tokenizer, chat templates, incremental detokenizer and stream parsers."""
