"""glmcheck traces checked from outside: statistics and hashes recomputed with numpy, logits
compared with torch."""
