"""Input and output the whole trainer shares: one path layer, torn-tail-safe JSONL logs, staged outputs."""
