"""transformers as the reference: Hugging Face folders loaded, run, tokenized, saved and
rewritten."""
